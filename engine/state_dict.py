"""Model and optimizer state dicts: full (gathered) or sharded (DTensor, Shard(0)) and load.

Each unit unshards itself in a `state_dict` pre-hook and reshards in the post-hook, so at most
one unit per nesting level is gathered at a time.  Keys are the original parameter FQNs.
Tensor-parallel parameters (and their optimizer state) are global tensors in full state dicts
and DTensors on the (dp, tp) mesh in sharded ones.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from . import collectives
from .config import ShardingStrategy, StateDictKind
from .flat_param import ParamInfo
from .state import WRAPPED_ATTR, RootState, root_of, unit_of
from .topology import root_mesh
from .unit import ShardedUnit
from .unshard import UnitUnshard

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
        roots = {0: _root(module)}
    for root in roots.values():
        root.state_dict_kind = kind
        root.state_dict_rank0_only = rank0_only
        root.state_dict_offload_to_cpu = offload_to_cpu


def _root(module: nn.Module) -> RootState:
    root = root_of(module)
    if root is None:
        unit = unit_of(module)
        root = unit.root if unit is not None else None
    if root is None:
        raise ValueError(
            f"{type(module).__name__} is not sharded; pass the module fully_shard / ShardedModule "
            "was applied to"
        )
    return root


def _kind(unit: ShardedUnit) -> StateDictKind:
    return unit.root.state_dict_kind or StateDictKind.FULL


def _keys(unit: ShardedUnit, info: ParamInfo, prefix: str) -> list[str]:
    return [prefix + ref.fqn for ref in info.refs]


def to_dtensor(unit: ShardedUnit, full: torch.Tensor) -> DTensor:
    """`full` as a DTensor chunked along dim 0 over the unit's shard mesh (replicated across)."""
    topology = unit.topology
    mesh = topology.shard_mesh(unit.device)
    full = full.to(unit.device)
    if unit.strategy is ShardingStrategy.NO_SHARD or full.dim() == 0:
        placements: list[Any] = [Replicate()] * mesh.ndim
        local = full.clone()
    else:
        step = -(-full.shape[0] // topology.shard_size)
        start = min(topology.shard_rank * step, full.shape[0])
        local = full[start : min(start + step, full.shape[0])].clone()
        placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
    )


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
    if any(isinstance(p, Shard) and p.dim == 0 for p in spec.placements):
        from torch.distributed.tensor.placement_types import _StridedShard

        dp_placement = _StridedShard(0, split_factor=spec.mesh.size())
    names = parent.mesh_dim_names
    placements = [Replicate()] * parent.ndim
    placements[names.index(dp_mesh.mesh_dim_names[0])] = dp_placement
    placements[names.index(spec.mesh.mesh_dim_names[0])] = spec.placements[0]
    return DTensor.from_local(piece, parent, placements, run_check=False, shape=spec.shape, stride=spec.stride)


def register_state_dict_hooks(unit: ShardedUnit) -> None:
    """Gather the unit around `state_dict()` / `load_state_dict()` of its module."""
    if not unit.has_params:
        return
    saving: list[UnitUnshard] = []
    loading: list[UnitUnshard] = []

    def before_save(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        root = unit.root
        rank0_only = _kind(unit) is StateDictKind.FULL and root.state_dict_rank0_only
        shown = UnitUnshard(unit, False, rank0_only, False, False)
        shown.enter()
        saving.append(shown)

    def after_save(module: nn.Module, state_dict: dict, prefix: str, metadata: Any) -> None:
        shown = saving.pop()
        kind, root = _kind(unit), unit.root
        for info in unit.layout.params:
            for key in _keys(unit, info, prefix):
                if key not in state_dict:
                    continue
                if not shown.visible:
                    del state_dict[key]
                    continue
                value = state_dict[key].detach()
                if kind is StateDictKind.SHARDED:
                    state_dict[key] = (
                        to_2d_dtensor(unit, info, value) if info.tp_spec is not None else to_dtensor(unit, value)
                    )
                else:
                    if info.tp_spec is not None:
                        value = value.full_tensor()  # may alias the unsharded buffer: copy below
                    target = torch.device("cpu") if root.state_dict_offload_to_cpu else value.device
                    state_dict[key] = value.to(target, copy=True)
        shown.exit()

    def before_load(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        for info in unit.layout.params:
            for key in _keys(unit, info, prefix):
                value = state_dict.get(key)
                if isinstance(value, DTensor):
                    value = state_dict[key] = value.full_tensor()
                if info.tp_spec is not None and isinstance(value, torch.Tensor):
                    spec = info.tp_spec
                    state_dict[key] = distribute_tensor(value.to(unit.device), spec.mesh, list(spec.placements))
        shown = UnitUnshard(unit, True, False, False, False)
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


# ---------------------------------------------------------------------- optimizer state
def _owners(root: RootState) -> dict[int, tuple[ShardedUnit, ParamInfo]]:
    return {
        id(param): (unit, info)
        for unit in root.units
        for info, param in zip(unit.layout.params, unit.sharded_params)
    }


def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, sharded: bool = False) -> dict:
    """Optimizer state keyed by original FQNs; per-parameter tensors full or DTensor-sharded.

    Collective over the shard groups: call it on every rank.
    """
    root = _root(model)
    owners = _owners(root)
    names = {id(p): name for name, p in model.named_parameters()}
    native = optim.state_dict()
    params = [p for group in optim.param_groups for p in group["params"]]

    def fqn(param: torch.Tensor) -> str:
        owner = owners.get(id(param))
        return owner[0].param_fqns[owner[0].layout.params.index(owner[1])] if owner else names[id(param)]

    state: dict[str, dict[str, Any]] = {}
    for param in params:
        if param in optim.state and id(param) not in owners:
            state[fqn(param)] = dict(optim.state[param])
    for unit in root.units:
        _gather_unit_optim_state(unit, optim, state, sharded)
    groups = []
    for group, native_group in zip(optim.param_groups, native["param_groups"]):
        groups.append({**native_group, "params": [fqn(p) for p in group["params"]]})
    return {"state": state, "param_groups": groups}


def _gather_unit_optim_state(
    unit: ShardedUnit, optim: torch.optim.Optimizer, out: dict[str, dict[str, Any]], sharded: bool
) -> None:
    layout = unit.layout
    tracked = [(info, p) for info, p in zip(layout.params, unit.sharded_params) if p in optim.state]
    keys = sorted(
        {
            key
            for _, p in tracked
            for key, value in optim.state[p].items()
            if isinstance(value, torch.Tensor) and value.shape == p.shape and value.dim() > 0
        }
    )
    for info, p in tracked:
        index = layout.params.index(info)
        out[unit.param_fqns[index]] = {
            key: value for key, value in optim.state[p].items() if key not in keys
        }
    for key in keys:
        local = torch.zeros(layout.chunk, dtype=unit.master_dtype, device=unit.device)
        for info, p in tracked:
            if key in optim.state[p]:
                unit.sharded_view(local, info).copy_(optim.state[p][key])
        full = local
        if unit.topology.shard_group is not None:
            full = torch.empty(layout.padded_numel, dtype=local.dtype, device=local.device)
            with collectives.labelled(unit.label):
                collectives.all_gather_flat(full, local, unit.topology.shard_group)
        for info, p in tracked:
            entry = out[unit.param_fqns[layout.params.index(info)]]
            entry[key] = _presented(unit, info, layout.full_view(full, info).clone(), sharded)


def _presented(unit: ShardedUnit, info: ParamInfo, value: torch.Tensor, sharded: bool) -> torch.Tensor:
    """A gathered (dp-full) per-parameter state tensor as the state dict shows it.

    Like the parameter itself: full = the global tensor (TP-local pieces gathered over tp too);
    sharded = DTensor on the shard mesh, or on the (dp, tp) mesh for tensor-parallel ones.
    """
    if info.tp_spec is None:
        return to_dtensor(unit, value) if sharded else value
    tp_value = info.tp_spec.wrap(value)
    return to_2d_dtensor(unit, info, tp_value) if sharded else tp_value.full_tensor()


def load_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, state_dict: dict) -> None:
    """Load a dict from `optim_state_dict` (full or sharded) into `optim` on every rank."""
    root = _root(model)
    owners = _owners(root)
    names = {id(p): name for name, p in model.named_parameters()}
    fqns: list[str] = []
    native_state: dict[int, dict[str, Any]] = {}
    index = 0
    for group in optim.param_groups:
        for param in group["params"]:
            owner = owners.get(id(param))
            name = owner[0].param_fqns[owner[0].layout.params.index(owner[1])] if owner else names[id(param)]
            fqns.append(name)
            saved = state_dict["state"].get(name)
            if saved is not None:
                native_state[index] = {
                    key: _local_piece(owner, value, param) for key, value in saved.items()
                }
            index += 1
    groups = []
    position = 0
    for saved_group in state_dict["param_groups"]:
        count = len(saved_group["params"])
        groups.append({**saved_group, "params": list(range(position, position + count))})
        position += count
    optim.load_state_dict({"state": native_state, "param_groups": groups})


def _local_piece(
    owner: Optional[tuple[ShardedUnit, ParamInfo]], value: Any, param: torch.Tensor
) -> Any:
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if owner is None or not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    unit, info = owner
    layout = unit.layout
    if info.tp_spec is not None:  # global value -> this rank's TP-local piece (no communication)
        spec = info.tp_spec
        value = distribute_tensor(
            value.to(unit.device), spec.mesh, list(spec.placements), src_data_rank=None
        ).to_local()
    flat = value.reshape(-1).to(param.device, param.dtype)
    if layout.shard_size == 1:
        return flat.view(info.shape).clone()
    lo, hi = layout.local_range(info)
    start = layout.chunk_start - info.offset
    return flat[lo + start : hi + start].clone() if hi > lo else flat[:0].clone()
