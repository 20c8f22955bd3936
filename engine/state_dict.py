"""Model state dicts: full (gathered) or sharded (DTensor, Shard(0)) and load.

Each unit unshards itself in a `state_dict` pre-hook and reshards in the post-hook, so at most
one unit per nesting level is gathered at a time.  Keys are the original parameter FQNs in both
parameter modes (the unshard context shows the original parameters; `_flat_param` never appears).
Tensor-parallel parameters are global tensors in full state dicts and DTensors on the (dp, tp)
mesh in sharded ones.  `to_dtensor` / `to_2d_dtensor` are shared with `optim_state.py`.

This module owns the state-dict settings (`config.StateDictSettings`): `set_state_dict_type`
replaces them on each root's `UnitContext` and the hooks read them from their unit's context.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from engine.config import ShardingStrategy, StateDictKind, StateDictSettings
from engine.flat_param import ParamInfo
from engine.state import WRAPPED_ATTR, resolve_root, root_of
from engine.topology import root_mesh
from engine.unit import ShardedUnit
from engine.unshard import UnitUnshard, UnshardOptions

_WRAPPED_PREFIX = f"{WRAPPED_ATTR}."


def set_state_dict_type(
    module: nn.Module,
    kind: StateDictKind,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
) -> None:
    """Choose what `module.state_dict()` returns for every sharded root in `module`."""
    roots = {id(r): r for r in (root_of(m) for m in module.modules()) if r is not None}
    if not roots:
        roots = {0: resolve_root(module)}
    settings = StateDictSettings(kind, rank0_only, offload_to_cpu)
    for root in roots.values():
        root.context.state_dict = settings


def _settings(unit: ShardedUnit) -> StateDictSettings:
    """The state-dict settings of `unit`'s root (defaults for a unit not rooted yet)."""
    return unit.context.state_dict if unit.context is not None else StateDictSettings()


def _keys(info: ParamInfo, prefix: str) -> list[str]:
    return [prefix + ref.fqn for ref in info.refs]


def to_dtensor(unit: ShardedUnit, full: torch.Tensor, *, partitioned: bool = False) -> DTensor:
    """`full` as a DTensor chunked along dim 0 over the unit's shard mesh (replicated across).

    Replicated for units that keep parameters whole (NO_SHARD, SHARD_OPTIM_STATE,
    SHARD_GRAD_AND_OPTIM_STATE); with `partitioned` (their partitioned optimizer state) chunked
    over the ranks partitioning it.
    """
    topology = unit.topology
    mesh = topology.shard_mesh(unit.device)
    full = full.to(unit.device)
    if partitioned:
        size, rank = topology.optim_size, topology.optim_rank
    else:
        size, rank = topology.shard_size, topology.shard_rank
    replicated = unit.strategy is ShardingStrategy.NO_SHARD or unit.strategy.partitions_optimizer_state
    whole = replicated and not partitioned
    if whole or full.dim() == 0:
        placements: list[Any] = [Replicate()] * mesh.ndim
        local = full.clone()
    else:
        step = -(-full.shape[0] // size)
        start = min(rank * step, full.shape[0])
        local = full[start : min(start + step, full.shape[0])].clone()
        placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def to_2d_dtensor(unit: ShardedUnit, info: ParamInfo, shown: DTensor) -> DTensor:
    """A tensor-parallel parameter as a DTensor on the (dp, tp) mesh: dp Shard(0) + TP placement.

    The TP-local tensor is chunked along dim 0 over dp.  When TP itself shards dim 0, that is
    "dp chunks inside TP chunks", which DTensor spells `_StridedShard(0, split_factor=tp)`.
    """
    spec = info.tp_spec
    dp_mesh = unit.topology.mesh
    parent = root_mesh(dp_mesh) if dp_mesh is not None else None
    if parent is None or parent is dp_mesh or parent.mesh_dim_names is None:
        raise NotImplementedError(
            "a SHARDED state dict of tensor-parallel parameters needs the dp mesh to be a named "
            "dimension of the 2-D mesh (pass mesh=mesh_2d['dp']); use StateDictKind.FULL otherwise"
        )
    local = shown.to_local()
    dp_size, dp_rank = unit.topology.shard_size, unit.topology.shard_rank
    step = -(-local.shape[0] // dp_size)
    start = min(dp_rank * step, local.shape[0])
    piece = local[start : min(start + step, local.shape[0])].clone()
    dp_placement: Any = Shard(0)
    if unit.strategy is ShardingStrategy.NO_SHARD:
        # Every dp rank holds the whole TP-local tensor: replicated over dp, not Shard(0) (a
        # layout that claimed Shard(0) made every redistribution of it fail; found by a
        # generated 2-D program).
        dp_placement = Replicate()
    elif any(isinstance(p, Shard) and p.dim == 0 for p in spec.placements):
        from torch.distributed.tensor.placement_types import _StridedShard

        dp_placement = _StridedShard(0, split_factor=spec.mesh.size())
    names = parent.mesh_dim_names
    placements = [Replicate()] * parent.ndim
    placements[names.index(dp_mesh.mesh_dim_names[0])] = dp_placement
    placements[names.index(spec.mesh.mesh_dim_names[0])] = spec.placements[0]
    return DTensor.from_local(piece, parent, placements, run_check=False, shape=spec.shape, stride=spec.stride)


def full_tensor(value: DTensor) -> torch.Tensor:
    """``value.full_tensor()``, also where this torch cannot gather an uneven ``_StridedShard``.

    torch 2.6 and 2.7 assert that a ``_StridedShard`` dimension splits evenly, so a SHARDED 2-D
    state dict of a model whose TP-local rows do not divide by dp (what :func:`to_2d_dtensor`
    writes) could not be loaded there. The assertion comes before any collective and on every
    rank alike, so the pieces are then gathered here by the layout that placement names.
    """
    try:
        return value.full_tensor()
    except AssertionError as error:
        if not str(error).startswith("_StridedShard requires even sharding"):
            raise
    mesh, placements = value.device_mesh, list(value.placements)
    strided = next(i for i, p in enumerate(placements) if type(p).__name__ == "_StridedShard")
    outer = 1 - strided
    if mesh.ndim != 2 or placements[outer] != Shard(0):
        raise NotImplementedError(f"gathering {placements} on this torch: only (_StridedShard(0), Shard(0)) is known")
    # dp pieces make a TP rank's rows; the TP ranks' rows, in order, make the tensor.
    tp_local = _concatenated(value.to_local(), mesh.get_group(strided))
    return _concatenated(tp_local, mesh.get_group(outer))


def _concatenated(piece: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every member's ``piece`` of ``group`` (sizes may differ), concatenated in group-rank order."""
    pieces: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(pieces, piece.cpu(), group=group)
    return torch.cat(pieces).to(piece.device)


def register_state_dict_hooks(unit: ShardedUnit) -> None:
    """Gather the unit around `state_dict()` / `load_state_dict()` of its module."""
    if not unit.has_params:
        return
    saving: list[UnitUnshard] = []
    loading: list[UnitUnshard] = []

    def before_save(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        settings = _settings(unit)
        rank0_only = settings.kind is StateDictKind.FULL and settings.rank0_only
        shown = UnitUnshard(unit, UnshardOptions(writeback=False, rank0_only=rank0_only))
        shown.enter()
        saving.append(shown)

    def after_save(module: nn.Module, state_dict: dict, prefix: str, metadata: Any) -> None:
        shown = saving.pop()
        settings = _settings(unit)
        for info in unit.layout.params:
            for key in _keys(info, prefix):
                if key not in state_dict:
                    continue
                if not shown.visible:
                    del state_dict[key]
                    continue
                value = state_dict[key].detach()
                if settings.kind is StateDictKind.SHARDED:
                    state_dict[key] = (
                        to_2d_dtensor(unit, info, value) if info.tp_spec is not None else to_dtensor(unit, value)
                    )
                else:
                    if info.tp_spec is not None:
                        value = value.full_tensor()  # may alias the unsharded buffer: copy below
                    target = torch.device("cpu") if settings.offload_to_cpu else value.device
                    state_dict[key] = value.to(target, copy=True)
        shown.exit()

    def before_load(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        for info in unit.layout.params:
            for key in _keys(info, prefix):
                value = state_dict.get(key)
                if isinstance(value, DTensor):
                    value = state_dict[key] = full_tensor(value)
                if info.tp_spec is not None and isinstance(value, torch.Tensor):
                    spec = info.tp_spec
                    state_dict[key] = distribute_tensor(value.to(unit.device), spec.mesh, list(spec.placements))
        shown = UnitUnshard(unit, UnshardOptions(writeback=True))
        shown.enter()
        loading.append(shown)

    def after_load(module: nn.Module, incompatible_keys: Any) -> None:
        loading.pop().exit()

    unit.module.register_state_dict_pre_hook(before_save)
    unit.module.register_state_dict_post_hook(after_save)
    unit.module.register_load_state_dict_pre_hook(before_load)
    unit.module.register_load_state_dict_post_hook(after_load)


def register_wrapper_key_hooks(wrapper: nn.Module) -> None:
    """Loading: insert the wrapper's attribute into keys (runs before the units' load hooks)."""

    def before_load(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        inner = prefix + _WRAPPED_PREFIX
        for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
            state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)

    wrapper.register_load_state_dict_pre_hook(before_load)


def register_wrapper_key_post_hook(wrapper: nn.Module) -> None:
    """Saving: drop the wrapper's attribute from keys (runs after the units' save hooks)."""

    def after_save(module: nn.Module, state_dict: dict, prefix: str, metadata: Any) -> None:
        inner = prefix + _WRAPPED_PREFIX
        for key in [k for k in state_dict if k.startswith(inner)]:
            state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)

    wrapper.register_state_dict_post_hook(after_save)
