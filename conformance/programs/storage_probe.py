"""Reads what this rank stores of parameters, gradients and optimizer state, and checks it
against the strategy's storage claim over all ranks (``conformance.protocol.storage``): shared by
the storage scenario (``conformance/test_storage.py``) and the generated programs, which check
the claim after every operation."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from conformance.protocol import (
    BackendAdapter,
    Holding,
    Phase,
    ShardingSpec,
    Stored,
    shard_group_size,
    share_bounds,
    storage_claim,
    stored_elements,
)


class StorageProbe:
    """Reads what this rank stores and checks it against the strategy's claim over all ranks."""

    def __init__(
        self,
        backend: BackendAdapter,
        sharded: nn.Module,
        spec: ShardingSpec,
        numels: dict[str, int],
        *,
        rank: int,
        world_size: int,
        where: str,
    ) -> None:
        self.backend = backend
        self.sharded = sharded
        self.strategy = spec.strategy
        self.claim = storage_claim(spec.strategy)
        self.group_size = shard_group_size(spec, world_size)
        self.numels = numels
        self.rank = rank
        self.world_size = world_size
        self.where = where
        self.step = 0
        self.problems: list[str] = []

    def check(
        self,
        stored: Stored,
        phase: Phase,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        exempt: frozenset[str] = frozenset(),
    ) -> None:
        """Collective: every rank calls it at the same point with the same arguments."""
        holding = self.claim.holding(stored, phase)
        if holding is None:
            return
        fqns = [fqn for fqn in self.numels if fqn not in exempt]
        local = stored_elements(self.backend, self.sharded, stored, fqns, optimizer)
        per_rank: list[dict[str, int]] = [{} for _ in range(self.world_size)]
        dist.all_gather_object(per_rank, local)
        keys = sorted({key for counts in per_rank for key in counts})
        if stored is Stored.GRADIENTS and phase is Phase.AT_REST:
            pass  # a step may drop the gradients it used (DeepSpeed's does): only stored ones are claimed
        elif stored is not Stored.OPTIMIZER_STATE:
            missing = [fqn for fqn in fqns if fqn not in keys]
            if missing:
                self.problems.append(
                    f"{self.where}, step {self.step}, {phase.value}: no rank stores {stored.value} of {missing} "
                    f"({self.claim_text(stored, holding)})"
                )
        elif not keys:
            self.problems.append(
                f"{self.where}, step {self.step}, {phase.value}: no rank stores any optimizer state after an Adam step "
                "(local_optim_state returned nothing on every rank)"
            )
        for key in keys:
            numel = self.numels[key.split("[", 1)[0]]
            counts = [counts.get(key, 0) for counts in per_rank]
            low, high = share_bounds(numel, holding, self.world_size, self.group_size)
            whole_everywhere = holding is Holding.WHOLE and any(count != numel for count in counts)
            if not low <= sum(counts) <= high or whole_everywhere:
                self.problems.append(
                    f"{self.where}, step {self.step}, {phase.value}: {stored.value} of {key!r} "
                    f"({numel} elements): the ranks store {counts} (together {sum(counts)}); "
                    f"{self.claim_text(stored, holding)}, "
                    f"so together between {low} and {high}"
                    + (", each rank all of it" if holding is Holding.WHOLE else "")
                )

    def claim_text(self, stored: Stored, holding: Holding) -> str:
        group = "" if self.group_size == self.world_size else f" within shard groups of {self.group_size}"
        return f"{self.strategy.name} claims {stored.value} {holding.value}{group}"
