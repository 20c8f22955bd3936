"""Labels for torch FSDP1 and FSDP2 collectives issued outside any module forward (rank side).

Why: FSDP's backward reduce-scatters (and the all-gathers of a backward prefetch) run in autograd
hooks, where no module forward is on the stack, so `harness.rank.labels` has nothing to name them by:
two same-sized units reduced in different orders on different ranks would look identical. This
module names them by unit, for any test that uses torch FSDP, whether or not a backend adapter
labels them (an adapter's label provider, when present, wins).

How: the units' entry points are wrapped once per process, at the first test start
(`harness.rank.labels.begin_test`) or outermost module forward after torch imported them (importing
FSDP ourselves would cost every rank about a second): FSDP2's `FSDPParamGroup.unshard` /
`post_backward` and FSDP1's `FlatParamHandle.unshard` and `_runtime_utils._reduce_grad*`. The
wrapper publishes the unit's name in a context variable for the duration of the call. Internals
that moved in another torch are skipped: the collectives keep their module labels.

FSDP2 units are named by their parameters inside a module forward too (`gathering_unit`): a unit's
forward all-gather is issued from a pre-forward hook, where the running module is the unit's
own path ("0" in a Sequential), or another unit's when FSDP2 prefetches, so a module label would
say less, or the wrong unit. FSDP1's forward gathers keep their module labels.
"""

from __future__ import annotations

import contextvars
import functools
import sys
import weakref
from collections.abc import Callable
from typing import Any

from harness.rank import tensor_names

__all__ = ["current_label", "gathering_unit", "maybe_install", "reset"]

_FSDP2 = "torch.distributed.fsdp._fully_shard._fsdp_param_group"
_FSDP1_HANDLE = "torch.distributed.fsdp._flat_param"
_FSDP1_RUNTIME = "torch.distributed.fsdp._runtime_utils"

_label: contextvars.ContextVar[str | None] = contextvars.ContextVar("torch_fsdp_label", default=None)
# Set with `_label` by the FSDP2 wrappers only: their unit's parameters name its collectives even
# inside a module forward (see `gathering_unit`).
_fsdp2_label: contextvars.ContextVar[str | None] = contextvars.ContextVar("torch_fsdp2_label", default=None)
_done: set[str] = set()
_module_paths: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def current_label() -> str | None:
    """The unit whose collective is being issued, or None outside a wrapped FSDP call."""
    return _label.get()


def gathering_unit() -> str | None:
    """The FSDP2 unit whose all-gather or reduce-scatter is being issued, None outside one.

    It names the collective even inside a module forward: a unit's forward all-gather runs in a
    pre-forward hook, under the running module's path ("0" for a Sequential's first child, or
    the previous unit's path when FSDP2 prefetches the next unit from its forward), so only the
    parameters say which unit it gathers, as they do in backward."""
    return _fsdp2_label.get()


def reset() -> None:
    """Forget the units' paths (between tests, with `harness.rank.labels.reset`): a path is found under
    the roots one test ran, and a module that outlives the test must be named afresh in the next
    one, as it is on a rank whose process never ran that test."""
    _module_paths.clear()


def maybe_install() -> None:
    """Wrap the FSDP entry points torch has imported by now (cheap when there is nothing new)."""
    if len(_done) == 3:
        return
    modules = sys.modules
    if _FSDP2 not in _done and _FSDP2 in modules:
        group_class = getattr(modules[_FSDP2], "FSDPParamGroup", None)
        if group_class is not None:
            _wrap(group_class, "unshard", _fsdp2_unit, _fsdp2_label)
            _wrap(group_class, "post_backward", _fsdp2_unit, _fsdp2_label)
        _done.add(_FSDP2)
    if _FSDP1_HANDLE not in _done and _FSDP1_HANDLE in modules:
        handle_class = getattr(modules[_FSDP1_HANDLE], "FlatParamHandle", None)
        if handle_class is not None:
            _wrap(handle_class, "unshard", _fsdp1_unit)
        _done.add(_FSDP1_HANDLE)
    if _FSDP1_RUNTIME not in _done and _FSDP1_RUNTIME in modules:
        runtime = modules[_FSDP1_RUNTIME]
        for name in ("_reduce_grad", "_reduce_grad_no_shard"):
            _wrap(runtime, name, lambda _state, handle, *args, **kwargs: _fsdp1_unit(handle))
        _done.add(_FSDP1_RUNTIME)


def _wrap(
    owner: Any, name: str, unit_of: Callable[..., str | None], also: contextvars.ContextVar[str | None] | None = None
) -> None:
    """Publish `unit_of(*args)` in `_label` (and `also`, when given) for the duration of `owner.name`."""
    original = getattr(owner, name, None)
    if original is None or getattr(original, "__harness_labelled__", False):
        return

    @functools.wraps(original)
    def labelled(*args: Any, **kwargs: Any) -> Any:
        try:
            unit = unit_of(*args, **kwargs)
        except Exception:  # noqa: BLE001 - a label is never worth failing the call it names
            unit = None
        token = _label.set(unit)
        also_token = None if also is None else also.set(unit)
        try:
            return original(*args, **kwargs)
        finally:
            if also_token is not None:
                also.reset(also_token)  # type: ignore[union-attr]
            _label.reset(token)

    labelled.__harness_labelled__ = True  # type: ignore[attr-defined]
    setattr(owner, name, labelled)


def _fsdp2_unit(group: Any, *args: Any, **kwargs: Any) -> str | None:
    fqns = [p._param_fqn for p in getattr(group, "fsdp_params", ()) if getattr(p, "_param_fqn", None)]
    # FQNs are relative to the FSDP root; a unit that is its own root (units called one by one)
    # gets its path under a container the test registered (`harness.name_tensor(model)`).
    modules = getattr(group, "modules", None) or ()
    prefix = tensor_names.named_path(modules[0]) if modules else ""
    if prefix and not all(fqn.startswith(prefix + ".") for fqn in fqns):
        fqns = [f"{prefix}.{fqn}" for fqn in fqns]
    return ", ".join(fqns) or None


def _fsdp1_unit(handle: Any) -> str | None:
    """The FQNs of a flat parameter, from the model root when the module it shards is known."""
    if handle is None:
        return None
    names = list(getattr(handle.flat_param, "_fqns", ()))
    module = getattr(handle, "_fully_sharded_module", None)
    prefix = _module_path(module) if module is not None else ""
    return ", ".join(f"{prefix}.{name}" if prefix else name for name in names) or None


def _module_path(module: Any) -> str:
    """`module`'s FQN under the outermost module this rank ran (wrapper segments dropped)."""
    path = _module_paths.get(module)
    if path is None:
        path = tensor_names.module_path(module)
        if path:  # "" may only mean its root has not run yet: look again next time
            _module_paths[module] = path
    return path
