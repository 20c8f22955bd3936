"""Strategies defined by storage: what each rank holds of parameters, gradients and optimizer state.

A sharding strategy is a claim about memory. :data:`STORAGE_CLAIMS` states it for every
:class:`~conformance.protocol.vocabulary.ShardingStrategy`, for the three things a rank stores
(:class:`Stored`) at each phase of a training step (:class:`Phase`): each entry is
:attr:`Holding.SHARDED` (the rank holds its share) or :attr:`Holding.WHOLE` (every rank holds all
of it). Scenarios check the claim exactly (``conformance/test_storage.py``), and the rank fixture
takes it as the evidence that a passed test exercised a sharding backend at all
(``conformance/suite/vacuity.py``): a backend that replicates what its strategy says is sharded
fails with the numbers, whatever else it gets right.

What "its share" means, checked per parameter over the ranks of one shard group: every element of
the parameter (of its gradient, of each of its optimizer-state tensors) is stored on exactly one
rank of the group, plus at most ``group size - 1`` padding elements a layout may add
(:class:`~conformance.protocol.facts.ShardLayout` states where). So the ranks of a group store
together between ``numel`` and ``numel + group size - 1`` elements of it, where a whole copy on
every rank would make ``group size x numel``. How the share is cut (flat units, rows, whole
parameters assigned to owner ranks as ``ZeroRedundancyOptimizer`` does) is the backend's; for
parameters, the declared ``SHARD_LAYOUT`` additionally fixes each rank's exact size.

The group is the world, except for HYBRID_SHARD, which shards within a group of the mesh's shard
dimension and replicates across its replicate dimension (:func:`shard_group_size`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn

from conformance.protocol.hooks import BackendHooks
from conformance.protocol.vocabulary import ShardingSpec, ShardingStrategy


class Phase(enum.Enum):
    """Where in a training step storage is claimed. The value is the text reports show."""

    AT_REST = "at rest after a step"
    FORWARD = "in forward"
    BETWEEN_FORWARD_AND_BACKWARD = "between forward and backward"
    AFTER_BACKWARD = "after backward"


class Stored(enum.Enum):
    """What a rank stores, and how a scenario reads it (the adapter hook named)."""

    PARAMETERS = "parameters"  # BackendHooks.local_shard
    GRADIENTS = "gradients"  # BackendHooks.local_grad_shard
    OPTIMIZER_STATE = "optimizer state"  # BackendHooks.local_optim_state


class Holding(enum.Enum):
    SHARDED = "sharded"  # its share: each element on one rank of the shard group, padding aside
    WHOLE = "whole"  # every rank holds all of it


_SHARDED, _WHOLE = Holding.SHARDED, Holding.WHOLE


@dataclass(frozen=True)
class StorageClaim:
    """What a rank holds under one strategy.

    ``parameters`` by phase. In :attr:`Phase.FORWARD` a unit that shards parameters holds its
    parameters whole while its own forward runs (that is what the all-gather is for); between
    forward and backward, the claim is for units below the root: a root unit may keep what it
    gathered for the backward that follows at once (torch FSDP1 and FSDP2 do).

    ``gradients`` after backward and at rest until ``zero_grad`` drops them (there are none to
    claim in forward). ``optimizer_state`` once the optimizer has state, at every phase: no
    strategy gathers optimizer state to step.
    """

    parameters: Mapping[Phase, Holding]
    gradients: Holding
    optimizer_state: Holding

    def holding(self, stored: Stored, phase: Phase) -> Holding | None:
        """The claim for ``stored`` at ``phase``; None where the strategy claims nothing."""
        if stored is Stored.PARAMETERS:
            return self.parameters[phase]
        if stored is Stored.GRADIENTS:
            return self.gradients if phase in (Phase.AFTER_BACKWARD, Phase.AT_REST) else None
        return self.optimizer_state

    def sharded(self) -> set[Stored]:
        """What this strategy shards in at least one phase."""
        return {stored for stored in Stored for phase in Phase if self.holding(stored, phase) is _SHARDED}


def _parameters(at_rest: Holding, forward: Holding, between: Holding, after_backward: Holding) -> dict[Phase, Holding]:
    return {
        Phase.AT_REST: at_rest,
        Phase.FORWARD: forward,
        Phase.BETWEEN_FORWARD_AND_BACKWARD: between,
        Phase.AFTER_BACKWARD: after_backward,
    }


_REPLICATED_PARAMETERS = _parameters(_WHOLE, _WHOLE, _WHOLE, _WHOLE)
_FULLY_SHARDED = StorageClaim(
    parameters=_parameters(_SHARDED, _WHOLE, _SHARDED, _SHARDED), gradients=_SHARDED, optimizer_state=_SHARDED
)

STORAGE_CLAIMS: Mapping[ShardingStrategy, StorageClaim] = {
    # Parameters gathered for each unit's forward and again for its backward.
    ShardingStrategy.FULL_SHARD: _FULLY_SHARDED,
    # Parameters gathered for forward stay gathered until backward has used them.
    ShardingStrategy.SHARD_GRAD_OP: StorageClaim(
        parameters=_parameters(_SHARDED, _WHOLE, _WHOLE, _SHARDED), gradients=_SHARDED, optimizer_state=_SHARDED
    ),
    # FULL_SHARD within each shard group (shard_group_size), replicated across groups.
    ShardingStrategy.HYBRID_SHARD: _FULLY_SHARDED,
    # Plain data parallelism: every rank holds everything, gradients all-reduced.
    ShardingStrategy.NO_SHARD: StorageClaim(
        parameters=_REPLICATED_PARAMETERS, gradients=_WHOLE, optimizer_state=_WHOLE
    ),
    # ZeRO-1: only the optimizer state is partitioned; each rank steps its part and the
    # updated parameters are shared again (broadcast or all-gather).
    ShardingStrategy.SHARD_OPTIM_STATE: StorageClaim(
        parameters=_REPLICATED_PARAMETERS, gradients=_WHOLE, optimizer_state=_SHARDED
    ),
    # ZeRO-2: gradients are reduced (reduce-scatter or reduce) to the rank that owns their part.
    ShardingStrategy.SHARD_GRAD_AND_OPTIM_STATE: StorageClaim(
        parameters=_REPLICATED_PARAMETERS, gradients=_SHARDED, optimizer_state=_SHARDED
    ),
}
assert set(STORAGE_CLAIMS) == set(ShardingStrategy), "every strategy needs its storage claim"


def storage_claim(strategy: ShardingStrategy) -> StorageClaim:
    return STORAGE_CLAIMS[strategy]


def shard_group_size(spec: ShardingSpec, world_size: int) -> int:
    """How many ranks share one copy of what ``spec`` shards: the world, or for HYBRID_SHARD the
    mesh's shard dimension (the copies are replicated across its replicate dimension)."""
    if ShardingStrategy.HYBRID_SHARD in spec.strategies() and spec.mesh is not None:
        return spec.mesh.size(1)
    return world_size


def share_bounds(numel: int, holding: Holding, world_size: int, group_size: int) -> tuple[int, int]:
    """How many elements of a tensor of ``numel`` elements all ``world_size`` ranks together may
    store under ``holding`` (inclusive bounds): a whole copy on every rank, or one copy per
    shard group with at most ``group_size - 1`` padding elements each."""
    if holding is Holding.WHOLE:
        return world_size * numel, world_size * numel
    copies = world_size // group_size
    return copies * numel, copies * (numel + group_size - 1)


def stored_elements(
    backend: BackendHooks,
    model: nn.Module,
    stored: Stored,
    fqns: Iterable[str],
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, int]:
    """How many elements this rank stores of ``stored`` for each parameter in ``fqns``, read
    through the adapter's hooks (``local_shard``, ``local_grad_shard``, ``local_optim_state``):
    key ``fqn`` for parameters and gradients (a parameter without a stored gradient is left
    out), ``"fqn[state name]"`` for each optimizer-state tensor (``optimizer`` required). Reads
    only: no collective, so a rank may call it alone (a forward hook, the vacuity check)."""
    counts: dict[str, int] = {}
    for fqn in fqns:
        if stored is Stored.PARAMETERS:
            counts[fqn] = backend.local_shard(model, fqn).numel()
        elif stored is Stored.GRADIENTS:
            grad = backend.local_grad_shard(model, fqn)
            if grad is not None:
                counts[fqn] = grad.numel()
        else:
            if optimizer is None:
                raise ValueError("stored_elements(OPTIMIZER_STATE) reads an optimizer's state: pass optimizer=")
            for name, value in backend.local_optim_state(model, optimizer, fqn).items():
                counts[f"{fqn}[{name}]"] = value.numel()
    return counts
