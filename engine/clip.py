"""`clip_grad_norm_`: clip the gradients the next optimizer step uses to one total norm over ranks.

The total is the norm of the whole model's averaged gradient, as one process holding every
parameter whole would compute it (`torch.nn.utils.clip_grad_norm_`), whatever the strategy. Every
element of a gradient counts exactly once, so each stored piece is summed over the ranks that hold
distinct pieces of it and no further:

- a sharded unit's gradient (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD's shard dimension): over the
  unit's shard group (HYBRID_SHARD's replicas hold equal sums after the replicate all-reduce);
- a ZeRO-2 unit's gradient partition (SHARD_GRAD_AND_OPTIM_STATE): over its optimizer group;
- a gradient every rank holds whole (NO_SHARD, SHARD_OPTIM_STATE before its step hands the
  partition its piece), and a parameter no unit manages: as this rank has it.

The classic bug this guards against is the local norm: each rank clipping by the norm of its own
shard only, which scales every rank's update differently. Per-group sums are all-reduced once per
group, in the order the groups first occur among the units (the same on every rank). Padding of a
flat shard holds zeros and adds nothing. The norm returned is the one before clipping, as torch's.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from engine import collectives
from engine.state import unit_of
from engine.unit import ShardedUnit

_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_: the coefficient is max_norm / (total + 1e-6)


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients of ``module`` (in place, on every rank) so that their total norm over
    all ranks is at most ``max_norm``; return that total norm before clipping (float32, 0-dim, the
    same on every rank). Collective: call it on every rank, between backward and the optimizer step.
    ``norm_type``: a positive p, or ``math.inf`` (the largest absolute entry)."""
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise ValueError(f"clip_grad_norm_: norm_type must be positive or math.inf, got {norm_type}")
    by_group = _stored_grads(module)
    device = _device_of(module)
    is_inf = math.isinf(norm_type)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for group, grads in by_group:
        partial = _partial(grads, norm_type, device)
        if group is not None and dist.get_world_size(group) > 1:
            if is_inf:
                dist.all_reduce(partial, op=dist.ReduceOp.MAX, group=group)
            else:
                collectives.all_reduce_sum(partial, group)
        total = torch.maximum(total, partial) if is_inf else total + partial
    total_norm = total if is_inf else total ** (1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (total_norm + _EPS), max=1.0)
    with torch.no_grad():
        for _, grads in by_group:
            for grad in grads:
                grad.mul_(coefficient.to(grad.device, grad.dtype))
    return total_norm


def _stored_grads(module: nn.Module) -> list[tuple[dist.ProcessGroup | None, list[torch.Tensor]]]:
    """The gradients this rank stores, by the group their partial norms are summed over (None:
    counted as they are here), groups in their first order among the units."""
    groups: dict[int, tuple[dist.ProcessGroup | None, list[torch.Tensor]]] = {}
    covered: set[int] = set()
    seen_units: set[int] = set()

    def add(group: dist.ProcessGroup | None, grad: torch.Tensor | None) -> None:
        if grad is None:
            return
        key = id(group) if group is not None else 0
        groups.setdefault(key, (group, []))[1].append(grad)

    for submodule in module.modules():
        unit = unit_of(submodule)
        if unit is None or id(unit) in seen_units:
            continue
        seen_units.add(id(unit))
        for param in unit.optimizer_params:
            covered.add(id(param))
        _add_unit(unit, add)
    for param in module.parameters():
        if id(param) not in covered:
            add(None, param.grad)
    return list(groups.values())


def _add_unit(unit: ShardedUnit, add: Callable[[dist.ProcessGroup | None, torch.Tensor | None], None]) -> None:
    if unit.partitions_grads:  # ZeRO-2: the partition holds this rank's piece of the gradient
        assert unit.optim_partition is not None
        for piece in unit.optim_partition.params:
            add(unit.optim_partition.group, piece.grad)
        return
    group = unit.topology.shard_group  # None: every rank holds the gradient whole
    for param in unit.optimizer_params:
        add(group, param.grad)


def _partial(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """This rank's share: the largest absolute entry (inf) or the sum of |g|^p, in float32."""
    grads = [grad for grad in grads if grad.numel()]  # a rank may hold no element of a parameter
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack(
        [torch.linalg.vector_norm(grad.detach(), norm_type, dtype=torch.float32).to(device) for grad in grads]
    )
    return norms.max() if math.isinf(norm_type) else (norms**norm_type).sum()


def _device_of(module: nn.Module) -> torch.device:
    for submodule in module.modules():
        unit = unit_of(submodule)
        if unit is not None:
            return unit.device
    for param in module.parameters():
        return param.device
    return torch.device("cpu")
