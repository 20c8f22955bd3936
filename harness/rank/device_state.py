"""Per-test device settings in a warm rank: torch's global device state a test may change, put back.

`TestIsolation` (``harness.rank.isolation``) resets what a test changes of the interpreter; this
module is its device part. What it covers, with why each matters for the next test on the rank:

- the default device (``torch.set_default_device``, as meta-device initialisation uses it): left
  on ``meta``, every later test's tensors would have no data;
- float32 precision and TF32 (``torch.backends.*.fp32_precision`` where torch has it, else
  ``torch.set_float32_matmul_precision`` and the ``allow_tf32`` flags) and cuDNN's switches
  (enabled, benchmark, deterministic): a later test's numerics would depend on test order;
- on CUDA, once the rank initialised it: the current device (the rank's own, set when its world
  was joined) and the current stream (the default one) of each device the test used, and a
  sticky CUDA error: after a device-side assert every later CUDA call fails, so the rank is
  reported unusable and replaced before the next test.
- on CUDA, device memory the test left allocated: reported on its stderr with the size and the
  largest live device tensors (and the global holding each), since the next test on the rank
  starts with less memory.

Only the CUDA part needs a GPU; everything else is the same on a CPU rank and proven there
(``tests/harness_tests/test_isolation.py``).
"""

from __future__ import annotations

import gc
import sys
from dataclasses import dataclass
from typing import Any

import torch

# Where torch has the fp32 precision API (torch >= 2.9: torch.backends.*.fp32_precision), it is
# the one source of truth, and the legacy getters raise once a test mixed the two; before it,
# the legacy switches are all there is.
_PRECISION_SWITCHES = (
    ("",),
    ("cuda", "matmul"),
    ("cudnn",),
    ("cudnn", "conv"),
    ("cudnn", "rnn"),
    ("mkldnn",),
    ("mkldnn", "matmul"),
    ("mkldnn", "conv"),
    ("mkldnn", "rnn"),
)
HAS_PRECISION_API = hasattr(torch.backends, "fp32_precision")


@dataclass(frozen=True)
class DeviceSettings:
    default_device: torch.device | None
    precision: tuple[str | bool, ...]
    """The fp32 precision switches (the new API), or matmul precision and the two TF32 flags."""
    cudnn: tuple[bool, bool, bool]
    """enabled, benchmark, deterministic."""


def _backend(path: tuple[str, ...]) -> object:
    target: object = torch.backends
    for name in path:
        if name:
            target = getattr(target, name)
    return target


def _precision() -> tuple[str | bool, ...]:
    if HAS_PRECISION_API:
        return tuple(getattr(_backend(path), "fp32_precision", "") for path in _PRECISION_SWITCHES)
    return (
        torch.get_float32_matmul_precision(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
    )


def _set_precision(saved: tuple[str | bool, ...]) -> None:
    if HAS_PRECISION_API:
        for path, value in zip(_PRECISION_SWITCHES, saved):
            if value:
                _backend(path).fp32_precision = value
        return
    precision, matmul_tf32, cudnn_tf32 = saved
    torch.set_float32_matmul_precision(str(precision))
    torch.backends.cuda.matmul.allow_tf32 = bool(matmul_tf32)
    torch.backends.cudnn.allow_tf32 = bool(cudnn_tf32)


def _default_device() -> torch.device | None:
    get_default = getattr(torch, "get_default_device", None)  # torch >= 2.3
    if get_default is None:
        return None
    try:
        return get_default()
    except AttributeError:
        # torch 2.6 (at least): set_default_device(None) leaves an empty context that its own
        # getter cannot read; no context is no default device, which is cpu.
        return torch.device("cpu")


def current_settings() -> DeviceSettings:
    cudnn = torch.backends.cudnn
    return DeviceSettings(
        default_device=_default_device(),
        precision=_precision(),
        cudnn=(cudnn.enabled, cudnn.benchmark, cudnn.deterministic),
    )


def restore_settings(saved: DeviceSettings) -> None:
    """Put ``saved`` back (cheap where nothing changed: the settings are compared first)."""
    now = current_settings()
    if now == saved:
        return
    if now.default_device != saved.default_device and saved.default_device is not None:
        # A default of cpu is no default at all: a mode left active would slow every factory call.
        torch.set_default_device(None if saved.default_device.type == "cpu" else saved.default_device)
    if now.precision != saved.precision:
        _set_precision(saved.precision)
    cudnn = torch.backends.cudnn
    cudnn.enabled, cudnn.benchmark, cudnn.deterministic = saved.cudnn


class CudaState:
    """The rank's CUDA state around one test, once CUDA is initialised in the rank.

    `cuda` is `torch.cuda`, or a stand-in with the same functions: the CPU self-tests simulate a
    GPU with one, since the state here only exists where CUDA does."""

    def __init__(self, cuda: Any = None, tensor_device: str = "cuda") -> None:
        self._cuda = cuda if cuda is not None else torch.cuda
        self._tensor_device = tensor_device
        self._device: int | None = None
        self._allocated: dict[int, int] = {}

    def enter(self) -> None:
        cuda = self._cuda
        if not cuda.is_initialized():
            self._device, self._allocated = None, {}  # a test that initialises CUDA starts from nothing allocated
            return
        self._device = cuda.current_device()
        self._allocated = {index: cuda.memory_allocated(index) for index in range(cuda.device_count())}

    def exit(self) -> str:
        """Put the current device and the streams back; why the rank cannot run another test ("")."""
        cuda = self._cuda
        if not cuda.is_initialized():
            return ""
        try:
            # A device-side assert or an illegal access is sticky: this fails as every later call would.
            cuda.synchronize()
            if self._device is not None:
                cuda.set_device(self._device)
            for index in range(cuda.device_count()):
                with cuda.device(index):
                    cuda.set_stream(cuda.default_stream(index))
        except RuntimeError as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            return f"a CUDA error left this rank unable to use its GPU ({first}): the rank is replaced"
        return ""

    def leaked_memory(self) -> str:
        """Device memory the test left allocated (call after its garbage was collected): one note
        with each device's growth and the largest live device tensors, or "" when none grew.

        `memory_allocated` counts the caching allocator's live blocks, which include cuBLAS's
        per-stream workspaces (allocated at a process's first matmul, kept for good): those are
        released first, so that only what the test's objects hold is counted."""
        cuda = self._cuda
        if not cuda.is_initialized():
            return ""
        grown = self._grown()
        if grown:
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None and self._tensor_device == "cuda":
                clear_workspaces()
            grown = self._grown()
        if not grown:
            return ""
        where = "; ".join(
            f"cuda:{index} {_size(after - before)} ({_size(before)} before the test, {_size(after)} after)"
            for index, (before, after) in grown.items()
        )
        return (
            f"the test left device memory allocated: {where}; the largest live tensors on the device: "
            f"{_largest_live_tensors(self._tensor_device)} (a later test on this rank starts with less memory)"
        )

    def _grown(self) -> dict[int, tuple[int, int]]:
        cuda = self._cuda
        grown = {}
        for index in range(cuda.device_count()):
            before, after = self._allocated.get(index, 0), cuda.memory_allocated(index)
            if after > before:
                grown[index] = (before, after)
        return grown


def _size(count: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


def _largest_live_tensors(device_type: str, shown: int = 3) -> str:
    """The largest tensors on `device_type` that are still alive, each with the module-level name
    that holds it where one does (a global cache is the usual leak): where the memory went."""
    tensors: dict[int, torch.Tensor] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == device_type:
            try:
                tensors.setdefault(obj.untyped_storage().data_ptr(), obj)
            except RuntimeError:
                continue  # a tensor without storage (meta, some subclasses): holds no memory
    largest = sorted(tensors.values(), key=lambda tensor: tensor.untyped_storage().nbytes(), reverse=True)[:shown]
    if not largest:
        return "none found (the memory is held below Python)"
    holders = _module_holders({id(tensor) for tensor in largest})
    return ", ".join(
        f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')} "
        f"({_size(tensor.untyped_storage().nbytes())})"
        + (f" held by {holders[id(tensor)]}" if id(tensor) in holders else "")
        for tensor in largest
    )


def _module_holders(wanted: set[int]) -> dict[int, str]:
    """`module.name` for the wanted objects a module global refers to, directly or in a list,
    tuple or dict value."""
    found: dict[int, str] = {}
    for module_name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            values = (
                value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
            )
            for item in values:
                if id(item) in wanted:
                    found.setdefault(id(item), f"{module_name}.{name}")
    return found
