"""Labels for DDP's bucket all-reduces: which parameters a bucket holds.

DDP's reducer all-reduces flat buckets of gradients from C++ (`harness.rank.dispatch_hooks` sees
them); the tensor it reduces is the bucket's own buffer, which no parameter owns, so neither the
module stack nor tensor names can say what it is. When a DDP module's forward ends (the global
forward hook of `harness.rank.labels`), its bucket layout is read (`note_forward`); a bucket
reduced later is found in it by process group, element count and dtype, and labelled
"DDP bucket 1 of 2 [fc2.bias, fc2.weight]".

The layout is read at the end of forward, never while a bucket is being reduced: the reducer holds
its lock while it calls the process group, and reading its buckets then would deadlock. It is read
with `Reducer._get_zeros_like_grad_buckets()`, which allocates a zeroed copy of each bucket, so
once per DDP module and bucket layout (DDP rebuilds its buckets once, at the start of the second
iteration's forward, in the order gradients became ready), and not at all for models over
`_MAX_ELEMENTS` gradient elements, whose buckets are labelled by size alone.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["bucket_label", "note_forward", "reset"]

_MAX_ELEMENTS = 1 << 24
_modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
_latest: weakref.ref | None = None
"""The DDP module whose forward ended last."""
_layouts: dict[tuple[int, bool], tuple[weakref.ref, list[tuple[int, torch.dtype, str]]]] = {}
"""(id(ddp), whether its buckets were rebuilt) -> (the module, its buckets: elements, dtype, names)."""


def note_forward(module: torch.nn.Module) -> None:
    """An outermost module's forward ended: if it is DDP, remember it and read its bucket layout."""
    global _latest
    if type(module).__name__ == "DistributedDataParallel" and hasattr(module, "reducer"):
        _modules.add(module)
        _latest = weakref.ref(module)
        _read_layout(module)


def reset() -> None:
    global _latest
    _modules.clear()
    _layouts.clear()
    _latest = None


def bucket_label(tensors: list[torch.Tensor], process_group: Any) -> str:
    """The label of an all-reduce of `tensors` on `process_group` if it is a DDP bucket's, else "".

    The DDP module whose forward ended last is asked first (its backward is the one running); the
    others only when it has no such bucket, and then only one that alone has one: two DDP modules of
    the same shape on one group (a model and its restored copy) would otherwise be told apart by
    the order of a set, which differs by rank. Names are sorted: a bucket is its set of parameters,
    whatever order DDP put them in."""
    if len(tensors) != 1 or not _modules:
        return ""
    tensor = tensors[0]
    numel, dtype = tensor.numel(), tensor.dtype
    latest = _latest() if _latest is not None else None
    candidates = [ddp for ddp in list(_modules) if getattr(ddp, "process_group", None) is process_group]
    if latest in candidates:
        label = _label_in(latest, numel, dtype)
        if label:
            return label
        candidates.remove(latest)
    labels = {label for ddp in candidates if (label := _label_in(ddp, numel, dtype))}
    return labels.pop() if len(labels) == 1 else (f"DDP bucket ({numel} elements)" if labels else "")


def _label_in(ddp: Any, numel: int, dtype: torch.dtype) -> str:
    """The label of `ddp`'s bucket of `numel` elements of `dtype`, "" when it has none."""
    known = _layouts.get(_layout_key(ddp))
    buckets = known[1] if known is not None and known[0]() is ddp else None
    if buckets is None:
        return f"DDP bucket of {type(ddp.module).__name__} ({numel} elements)"
    found = [index for index, (elements, kind, _) in enumerate(buckets) if elements == numel and kind == dtype]
    if len(found) == 1:
        index = found[0]
        return f"DDP bucket {index} of {len(buckets)} [{buckets[index][2]}]"
    if found:
        return f"DDP bucket {' or '.join(map(str, found))} of {len(buckets)} ({numel} elements)"
    return ""


def _layout_key(ddp: Any) -> tuple[int, bool]:
    return (id(ddp), bool(getattr(ddp, "_has_rebuilt_buckets", False)))


def _read_layout(ddp: Any) -> None:
    key = _layout_key(ddp)
    known = _layouts.get(key)
    if known is not None and known[0]() is ddp:
        return
    parameters = [p for p in ddp.module.parameters() if p.requires_grad]
    if sum(p.numel() for p in parameters) > _MAX_ELEMENTS:
        return
    names = {id(parameter): name for name, parameter in ddp.module.named_parameters()}
    try:
        buckets = ddp.reducer._get_zeros_like_grad_buckets()
        layout = [
            (
                bucket.buffer().numel(),
                bucket.buffer().dtype,
                ", ".join(sorted(names.get(id(p), "?") for p in bucket.parameters())),
            )
            for bucket in buckets
        ]
    except Exception:  # noqa: BLE001 - an older reducer without it: buckets labelled by size
        return
    _layouts[key] = (weakref.ref(ddp), layout)
