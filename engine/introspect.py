"""Read-only views of the engine's state, for tests and adapters."""

from __future__ import annotations

import torch.nn as nn

from engine.state import managing_unit, resolve_root, unit_of
from engine.unit import ShardedUnit


def units(module: nn.Module) -> list[ShardedUnit]:
    """All units of the root that `module` belongs to, in pre-order (parents before children)."""
    return list(resolve_root(module).units)


def unit_fqns(module: nn.Module) -> list[tuple[str, tuple[str, ...]]]:
    """(unit module FQN, original parameter FQNs) per unit; FQNs relative to the root."""
    return [(unit.module_fqn, tuple(unit.param_fqns)) for unit in resolve_root(module).units]


def is_unsharded(module: nn.Module) -> bool:
    """Whether the unit owning `module` (or managing its parameters) currently holds full params,
    for compute or shown by `unshard_params`."""
    unit = unit_of(module) or managing_unit(module)
    if unit is None:
        raise ValueError(f"{type(module).__name__} is not managed by a sharded unit")
    return unit.is_unsharded or unit.shown_by_unshard


def events(module: nn.Module) -> list[tuple[str, str]]:
    """("unshard" | "reshard", unit module FQN) in the order they happened for `module`'s root."""
    return list(resolve_root(module).context.events)


def clear_events(module: nn.Module) -> None:
    """Forget the recorded unshard / reshard events of `module`'s root."""
    resolve_root(module).context.events.clear()


def partitions_optimizer_state(module: nn.Module) -> bool:
    """Whether `module` or a submodule is a SHARD_OPTIM_STATE or SHARD_GRAD_AND_OPTIM_STATE unit:
    its optimizer must be an `engine.ShardedOptimizer` for the optimizer state to be partitioned
    (and, for SHARD_GRAD_AND_OPTIM_STATE, for the gradients to be applied at all)."""
    return any(unit is not None and unit.optim_partition is not None for unit in (unit_of(m) for m in module.modules()))
