"""Optimizer state dicts keyed by original parameter FQNs, in both parameter modes.

The optimizer holds state per exposed parameter: per original parameter (this rank's piece) with
`use_orig_params=True`, per unit (this rank's chunk of the flat buffer) without.  Either way the
state dict shows one entry per original FQN, as torch FSDP1's `optim_state_dict` does:
per-parameter tensors (those shaped like the exposed parameter) are gathered and cut into the
original parameters, full tensors (or DTensors with ``sharded=True``); scalars (e.g. Adam's
``step``) are copied to every FQN of the unit.  ``param_groups`` list FQNs.  Loading cuts each
rank's piece back out, so a dict saved in one mode loads into the other.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from engine import collectives
from engine.flat_param import FlatLayout, ParamInfo
from engine.state import RootState, clean_fqn, resolve_root
from engine.state_dict import full_tensor, to_2d_dtensor, to_dtensor
from engine.unit import ShardedUnit


@dataclass(frozen=True)
class _StateLayout:
    """How an optimizer may hold one unit's state: over the parameters the unit exposes, or
    (SHARD_OPTIM_STATE) over this rank's optimizer partition, laid out like FULL_SHARD's shards."""

    unit: ShardedUnit
    layout: FlatLayout  # where each original parameter lies in a rank's chunk
    params: tuple[torch.Tensor, ...]  # one per original parameter, or the single flat one
    flat: bool
    group: dist.ProcessGroup | None  # gathers the chunks (None: one rank holds everything)
    partitioned: bool  # a SHARD_OPTIM_STATE partition: sharded dicts chunk it over `group`

    @property
    def flat_param(self) -> torch.Tensor | None:
        return self.params[0] if self.flat else None

    def fqn(self, info: ParamInfo) -> str:
        return self.unit.param_fqns[self.unit.layout.params.index(info)]


def _state_layouts(unit: ShardedUnit) -> list[_StateLayout]:
    exposed = _StateLayout(
        unit,
        unit.layout,
        tuple(unit.optimizer_params),
        unit.flat_param is not None,
        unit.topology.shard_group,
        partitioned=False,
    )
    partition = unit.optim_partition
    if partition is None:
        return [exposed]
    # A plain optimizer over the replicated parameters still works (state then replicated).
    return [
        exposed,
        _StateLayout(unit, partition.layout, tuple(partition.params), partition.flat, partition.group, True),
    ]


# id(optimizer parameter) -> (its state layout, the original parameter it is, or None for a flat one)
_Owners = dict[int, tuple[_StateLayout, ParamInfo | None]]


def _owners(root: RootState) -> _Owners:
    owners: _Owners = {}
    for unit in root.units:
        for view in _state_layouts(unit):
            if view.flat:
                owners[id(view.params[0])] = (view, None)
            else:
                for info, param in zip(view.layout.params, view.params):
                    owners[id(param)] = (view, info)
    return owners


def _fqns(owners: _Owners, names: dict[int, str], param: torch.Tensor) -> list[str]:
    """The original FQNs an optimizer parameter stands for."""
    owner = owners.get(id(param))
    if owner is None:
        return [names[id(param)]]
    view, info = owner
    return list(view.unit.param_fqns) if info is None else [view.fqn(info)]


def _is_per_param(value: Any, param: torch.Tensor) -> bool:
    """State shaped like the exposed parameter (exp_avg, momentum, ...), not a scalar (step)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


def optim_state_dict(model: nn.Module, optim: Any, sharded: bool = False) -> dict:
    """Optimizer state keyed by original FQNs; per-parameter tensors full or DTensor-sharded.

    Collective over the shard groups: call it on every rank.
    """
    root = resolve_root(model)
    owners = _owners(root)
    names = {id(p): clean_fqn(name) for name, p in model.named_parameters()}
    native = optim.state_dict()
    state: dict[str, dict[str, Any]] = {}
    for group in optim.param_groups:
        for param in group["params"]:
            if param in optim.state and id(param) not in owners:
                state[names[id(param)]] = dict(optim.state[param])
    held = {id(p) for group in optim.param_groups for p in group["params"]}
    for unit in root.units:
        for view in _state_layouts(unit):
            if any(id(p) in held for p in view.params):  # the same on every rank
                _gather_unit_state(view, optim, state, sharded)
    groups = [
        {**native_group, "params": [fqn for p in group["params"] for fqn in _fqns(owners, names, p)]}
        for group, native_group in zip(optim.param_groups, native["param_groups"])
    ]
    return {"state": state, "param_groups": groups}


def _gather_unit_state(view: _StateLayout, optim: Any, out: dict[str, dict[str, Any]], sharded: bool) -> None:
    """Add one entry per original parameter of `view`'s unit to `out` (collective over its group)."""
    unit, layout = view.unit, view.layout
    chunks: dict[str, torch.Tensor] = {}  # state key -> this rank's chunk of the flat layout
    flat = view.flat_param
    if flat is not None:
        if flat not in optim.state:
            return
        flat_state = optim.state[flat]
        tracked = list(layout.params)
        keys = sorted(key for key, value in flat_state.items() if _is_per_param(value, flat))
        for info in tracked:
            out[view.fqn(info)] = {k: v for k, v in flat_state.items() if k not in keys}
        for key in keys:
            chunks[key] = flat_state[key].to(unit.device, unit.master_dtype)
    else:
        pairs = [(info, p) for info, p in zip(layout.params, view.params) if p in optim.state]
        tracked = [info for info, _ in pairs]
        keys = sorted({key for _, p in pairs for key, value in optim.state[p].items() if _is_per_param(value, p)})
        for info, p in pairs:
            out[view.fqn(info)] = {k: v for k, v in optim.state[p].items() if k not in keys}
        for key in keys:
            chunk = torch.zeros(layout.chunk, dtype=unit.master_dtype, device=unit.device)
            for info, p in pairs:
                if key in optim.state[p]:
                    layout.sharded_view(chunk, info).copy_(optim.state[p][key])
            chunks[key] = chunk
    for key, chunk in chunks.items():
        full = chunk
        if view.group is not None:
            full = torch.empty(layout.padded_numel, dtype=chunk.dtype, device=chunk.device)
            with collectives.labelled(unit.label):
                collectives.all_gather_flat(full, chunk, view.group)
        for info in tracked:
            value = layout.full_view(full, info).clone()
            out[view.fqn(info)][key] = _presented(view, info, value, sharded)


def _presented(view: _StateLayout, info: ParamInfo, value: torch.Tensor, sharded: bool) -> torch.Tensor:
    """A gathered (dp-full) per-parameter state tensor as the state dict shows it.

    Like the parameter itself: full = the global tensor (TP-local pieces gathered over tp too);
    sharded = DTensor on the shard mesh (a SHARD_OPTIM_STATE partition: chunked over the ranks
    that partition it), or on the (dp, tp) mesh for tensor-parallel ones.
    """
    if info.tp_spec is None:
        return to_dtensor(view.unit, value, partitioned=view.partitioned) if sharded else value
    tp_value = info.tp_spec.wrap(value)
    return to_2d_dtensor(view.unit, info, tp_value) if sharded else tp_value.full_tensor()


def load_optim_state_dict(model: nn.Module, optim: Any, state_dict: dict) -> None:
    """Load a dict from `optim_state_dict` (full or sharded, either mode) into `optim` on every rank.

    Groups are matched by position; each group keeps `optim`'s parameters and takes the saved
    hyperparameters.
    """
    root = resolve_root(model)
    owners = _owners(root)
    names = {id(p): clean_fqn(name) for name, p in model.named_parameters()}
    saved_state: dict[str, dict[str, Any]] = state_dict["state"]
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(optim.param_groups):
        raise ValueError(
            f"the optimizer state dict has {len(saved_groups)} parameter groups, the optimizer "
            f"{len(optim.param_groups)}; build the optimizer with the same groups it was saved with"
        )
    native_state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for group, saved_group in zip(optim.param_groups, saved_groups):
        indices = []
        for param in group["params"]:
            owner = owners.get(id(param))
            if owner is None:
                saved = saved_state.get(names[id(param)])
                if saved is not None:
                    native_state[index] = {key: _unsharded(value) for key, value in saved.items()}
            elif owner[1] is None:
                entries = [saved_state.get(fqn) for fqn in owner[0].unit.param_fqns]
                if any(entry is not None for entry in entries):
                    native_state[index] = _flat_state(owner[0], entries, param)
            else:
                view, info = owner
                saved = saved_state.get(view.fqn(info))
                if saved is not None:
                    native_state[index] = {
                        key: _local_piece(view, info, key, value, param) for key, value in saved.items()
                    }
            indices.append(index)
            index += 1
        groups.append({**saved_group, "params": indices})
    optim.load_state_dict({"state": native_state, "param_groups": groups})


# Every rank holds the same global value: each keeps its own piece. A torch without
# src_data_rank (2.6) scatters from the mesh's first rank instead: the same pieces.
_LOCAL_ONLY = {"src_data_rank": None} if "src_data_rank" in inspect.signature(distribute_tensor).parameters else {}


def _unsharded(value: Any) -> Any:
    return full_tensor(value) if isinstance(value, DTensor) else value


def _flat_state(view: _StateLayout, entries: list[dict[str, Any] | None], flat: torch.Tensor) -> dict[str, Any]:
    """One flat parameter's state from its original parameters' saved entries."""
    keys = sorted({key for entry in entries if entry is not None for key in entry})
    state: dict[str, Any] = {}
    for key in keys:
        values = [entry.get(key) if entry is not None else None for entry in entries]
        first = next(value for value in values if value is not None)
        if not (isinstance(first, torch.Tensor) and first.dim() > 0):
            state[key] = _unsharded(first)  # a scalar shared by the unit's parameters
            continue
        chunk = torch.zeros(view.layout.chunk, dtype=flat.dtype, device=flat.device)
        for info, value in zip(view.layout.params, values):
            if value is not None:
                view.layout.sharded_view(chunk, info).copy_(_local_piece(view, info, key, value, flat))
        state[key] = chunk
    return state


def _local_piece(view: _StateLayout, info: ParamInfo, key: str, value: Any, param: torch.Tensor) -> Any:
    """This rank's piece of one original parameter's saved state value (scalars unchanged)."""
    value = _unsharded(value)
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    unit, layout = view.unit, view.layout
    if info.tp_spec is not None:  # global value -> this rank's TP-local piece (no communication)
        spec = info.tp_spec
        value = distribute_tensor(value.to(unit.device), spec.mesh, list(spec.placements), **_LOCAL_ONLY).to_local()
    if value.numel() != info.numel:
        raise ValueError(
            f"optimizer state {key!r} of {view.fqn(info)} has {value.numel()} elements, the parameter "
            f"{info.numel}: the state dict was saved for another model; load one saved from this model"
        )
    flat = value.reshape(-1).to(param.device, param.dtype)
    if layout.shard_size == 1:
        return flat.view(info.shape).clone()
    lo, hi = layout.local_range(info)
    start = layout.chunk_start - info.offset
    return flat[lo + start : hi + start].clone() if hi > lo else flat[:0].clone()
