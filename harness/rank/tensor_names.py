"""Tensor identity for the collective trace: which parameter, buffer, gradient or user-named tensor a
collective carries (rank side).

Why: two same-shape collectives issued outside any module forward (a hand-written gradient sync
that reduces `fc1.weight.grad` then `fc2.weight.grad` on one rank and the other order on another)
carry no module label, so op, shape and dtype agree and the swap would pass. Naming the tensors
makes them differ.

How a tensor is named, first wins:
  1. a name the user gave with `name_tensor(tensor, "metrics/loss_sum")` (the tensor or any view
     sharing its storage);
  2. a parameter, buffer or `.grad` of a module this rank has seen: every module whose forward ran
     as the outermost one (found by `harness.rank.labels`' forward hooks), and every module passed to
     `name_tensor(module)`. Names are FQNs relative to that module, wrapper segments dropped.
A tensor is named after its storage, whatever part of it it covers: a view of a parameter (or
of a gradient) has the parameter's name. Only storages that one parameter, buffer or gradient owns
whole are named: a storage that holds several (a flat parameter), or of which a tensor is only a
part (a shard of a flat parameter, padded), or a parameter a sharding wrapper flattened, would be
named differently on different ranks issuing the same collective, since which parameters a shard
covers depends on the rank. Those collectives are told apart by their labels instead.

Only the ops whose members all pass the same logical tensor look names up
(`OpSpec.same_tensor`: all-reduce, broadcast, reduce, reduce-scatter): a gather's or all-to-all's
input is each rank's own piece, which in a sharding engine is a different parameter on each rank.

Tensors are matched by storage address, and a match is only trusted after checking that the named
tensor is still alive and still uses that storage, so a recycled address never names a stranger.
The map from storage to names is rebuilt when a lookup misses (gradients appear after the
forward), at most `_REBUILDS_PER_FORWARD` times between two outermost forwards: collectives on
fresh buffers (FSDP2's all-gather outputs) miss every time and must not cost a walk of the model
each. The rebuild pattern depends only on the sequence of calls, so ranks running the same code
name the same tensors.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection
from typing import Any

import torch

__all__ = [
    "WRAPPER_SEGMENTS",
    "module_path",
    "name_tensor",
    "named_path",
    "names_of",
    "note_outermost_module",
    "reset",
    "strip_path_components",
]

_REBUILDS_PER_FORWARD = 2
WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
"""Path components torch's wrappers insert between a module and its children (FSDP1, activation
checkpointing, torch.compile): dropped from the names the trace shows, so they read like the
user's FQNs."""


def strip_path_components(path: str, components: Collection[str] = WRAPPER_SEGMENTS) -> str:
    """Dotted `path` (a module or parameter FQN) without the components in `components` and
    without empty ones: the one way the harness and the conformance suite see through wrappers."""
    return ".".join(part for part in path.split(".") if part and part not in components)


# storage address -> (weak ref to the named tensor, its name); user names and module names apart,
# user names first.
_user_names: dict[int, tuple[weakref.ref, str]] = {}
_module_names: dict[int, tuple[weakref.ref, str]] = {}
_roots: dict[int, tuple[weakref.ref, str]] = {}  # id(module) -> (weak module, prefix)
_named_roots: dict[int, tuple[weakref.ref, str]] = {}  # the ones passed to name_tensor(module)
# id(module) -> (weak module, its path under a named root): modules called outside their
# container's forward (units called one by one) are labelled by that path.
_named_paths: dict[int, tuple[weakref.ref, str]] = {}
_generation = 0
_built_generation = -1
_rebuilds = 0


def name_tensor(value: torch.Tensor | torch.nn.Module, name: str | None = None) -> None:
    """Name a tensor in this rank's collective trace (rank side; forgotten at the end of the test).

    `name_tensor(total, "metrics/loss_sum")`: collectives on `total`, or on a view of it, show and
    compare that name. `name_tensor(model)` (optionally with a prefix): name the parameters,
    buffers and gradients of `model` before its first forward (e.g. for a parameter broadcast at
    initialisation), and label collectives of its submodules by their FQN under `model` even when
    they are called one by one rather than from `model`'s forward; modules whose forward ran are
    named without this.
    """
    if isinstance(value, torch.nn.Module):
        _add_root(value, name or "")
        _set_module_entry(_named_roots, value, name or "")
        _named_paths.clear()
        return
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"name_tensor() takes a tensor or a module, not {type(value).__name__}; pass the tensor")
    if not name:
        raise ValueError("name_tensor(tensor, name) needs a non-empty name to show in the trace")
    tensor = _local(value)
    _user_names[_storage(tensor)] = (weakref.ref(tensor), name)


def note_outermost_module(module: torch.nn.Module) -> None:
    """An outermost module forward starts (called by `harness.rank.labels`): a new naming generation."""
    global _generation
    _generation += 1
    known = _roots.get(id(module))
    # An id names a root only while that root lives: a root freed earlier in the test (the
    # oracle's model) leaves its id to the next object allocated there, often the sharded model.
    # Taking the id alone for "already a root" would leave that model out on whichever rank's
    # allocator happened to recycle the address, and its units unnamed there only.
    if known is None or known[0]() is not module:
        _add_root(module, "")


def names_of(tensors: list[torch.Tensor]) -> tuple[str, ...]:
    """The name of each tensor ("" when it has none); empty when none is named (the common case
    of no module seen and no user names costs nothing)."""
    if not (_user_names or _roots) or not tensors:
        return ()
    if len(tensors) == 1:  # the common case, without building a generator
        name = _name(tensors[0])
        return (name,) if name else ()
    names = tuple(_name(tensor) for tensor in tensors)
    return names if any(names) else ()


def module_path(module: torch.nn.Module) -> str:
    """`module`'s FQN under a module this rank has seen (wrapper segments dropped), or ""."""
    for module_ref, prefix in list(_roots.values()):
        root = module_ref()
        if root is None:
            continue
        for fqn, candidate in root.named_modules():
            if candidate is module:
                return _clean(prefix, fqn)
    return ""


def named_path(module: torch.nn.Module) -> str:
    """`module`'s FQN under a module given to `name_tensor(module)`, or "" (cheap when none was)."""
    if not _named_roots:
        return ""
    cached = _named_paths.get(id(module))
    if cached is not None and cached[0]() is module:
        return cached[1]
    path = ""
    for module_ref, prefix in list(_named_roots.values()):
        root = module_ref()
        found = next((fqn for fqn, sub in root.named_modules() if sub is module), None) if root is not None else None
        if found is not None:
            path = _clean(prefix, found)
            break
    _named_paths[id(module)] = (weakref.ref(module), path)
    return path


def reset() -> None:
    """Forget every name and module (between tests)."""
    global _built_generation, _rebuilds
    _user_names.clear()
    _module_names.clear()
    _roots.clear()
    _named_roots.clear()
    _named_paths.clear()
    _built_generation, _rebuilds = -1, 0


# ------------------------------------------------------------------------------------ internals


def _add_root(module: torch.nn.Module, prefix: str) -> None:
    global _built_generation
    _set_module_entry(_roots, module, prefix)
    _built_generation = -1  # the next miss rebuilds, whatever the budget


def _set_module_entry(table: dict[int, tuple[weakref.ref, str]], module: torch.nn.Module, value: str) -> None:
    """`table[id(module)] = (weak module, value)`, placed last when the id was a dead module's.

    Lookups take the first root that holds a module, so a root's place must be when this test
    noted it: left in the dead module's place, it would depend on whether this process's
    allocator recycled that address, which differs from rank to rank."""
    key = id(module)
    known = table.get(key)
    if known is not None and known[0]() is not module:
        del table[key]
    table[key] = (weakref.ref(module), value)


def _name(tensor: torch.Tensor) -> str:
    tensor = _local(tensor)
    try:
        storage = _storage(tensor)
    except (RuntimeError, NotImplementedError):  # a tensor without storage (meta, fake, sparse)
        return ""
    if not storage or tensor.numel() == 0:  # an empty shard has no storage to match: unnamed everywhere
        return ""
    found = _lookup(_user_names, storage) if _user_names else None
    if found is None:
        found = _lookup(_module_names, storage)
        if found is None and _may_rebuild():
            _rebuild()
            found = _lookup(_module_names, storage)
    return found or ""


def _lookup(table: dict[int, tuple[weakref.ref, str]], storage: int) -> str | None:
    entry = table.get(storage)
    if entry is None:
        return None
    owner = entry[0]()
    if owner is None or _storage(owner) != storage:  # gone or moved: the address was recycled
        del table[storage]
        return None
    return entry[1]


def _may_rebuild() -> bool:
    global _built_generation, _rebuilds
    if not _roots:
        return False
    if _built_generation != _generation:
        _built_generation, _rebuilds = _generation, 0
    if _rebuilds >= _REBUILDS_PER_FORWARD:
        return False
    _rebuilds += 1
    return True


def _rebuild() -> None:
    _module_names.clear()
    owners: dict[int, tuple[torch.Tensor, str, int]] = {}  # storage -> (first tensor, its name, sharers)
    for key, (module_ref, prefix) in list(_roots.items()):
        module = module_ref()
        if module is None:
            del _roots[key]
            continue
        for fqn, parameter in module.named_parameters():
            name = _clean(prefix, fqn)
            _remember(owners, parameter, name)
            # A non-leaf parameter (a view into a flat parameter) has no .grad; asking warns.
            grad = parameter.grad if parameter.is_leaf else None
            if grad is not None:
                _remember(owners, grad, f"{name}.grad")
        for fqn, buffer in module.named_buffers():
            _remember(owners, buffer, _clean(prefix, fqn))
    for storage, (tensor, name, sharers) in owners.items():
        if sharers == 1 and _owns_whole_storage(tensor):
            _module_names[storage] = (weakref.ref(tensor), name)


def _remember(owners: dict[int, tuple[torch.Tensor, str, int]], tensor: Any, name: str) -> None:
    tensor = _local(tensor)
    try:
        storage = _storage(tensor)
    except (RuntimeError, NotImplementedError):
        return
    if not storage:
        return
    known = owners.get(storage)
    # The first (outermost, in registration order) name of a shared storage names it.
    owners[storage] = (tensor, name, 1) if known is None else (known[0], known[1], known[2] + 1)


def _owns_whole_storage(tensor: torch.Tensor) -> bool:
    """The tensor is its storage, and no sharding wrapper flattened it (FSDP1, DeepSpeed)."""
    if (
        getattr(tensor, "_fsdp_flattened", False)
        or hasattr(tensor, "ds_id")
        or type(tensor).__name__ == "FlatParameter"
    ):
        return False
    return tensor.storage_offset() == 0 and tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes()


def _clean(prefix: str, fqn: str) -> str:
    return ".".join(filter(None, (prefix, strip_path_components(fqn))))


def _local(tensor: Any) -> torch.Tensor:
    """A DTensor's local shard (its own storage is not where the bytes live)."""
    if type(tensor) is torch.Tensor:  # the common case, without a failing attribute lookup
        return tensor
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor


def _storage(tensor: torch.Tensor) -> int:
    """The address of the tensor's storage (cheaper than building its `untyped_storage()`)."""
    return tensor.data_ptr() - tensor.storage_offset() * tensor.element_size()
