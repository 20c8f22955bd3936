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

Only the CUDA part needs a GPU; everything else is the same on a CPU rank and proven there
(``tests/harness_tests/test_isolation.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """The rank's CUDA state around one test, once CUDA is initialised in the rank."""

    def __init__(self) -> None:
        self._device: int | None = None

    def enter(self) -> None:
        self._device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def exit(self) -> str:
        """Put the current device and the streams back; why the rank cannot run another test ("")."""
        if not torch.cuda.is_initialized():
            return ""
        try:
            # A device-side assert or an illegal access is sticky: this fails as every later call would.
            torch.cuda.synchronize()
            if self._device is not None:
                torch.cuda.set_device(self._device)
            for index in range(torch.cuda.device_count()):
                with torch.cuda.device(index):
                    torch.cuda.set_stream(torch.cuda.default_stream(index))
        except RuntimeError as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            return f"a CUDA error left this rank unable to use its GPU ({first}): the rank is replaced"
        return ""
