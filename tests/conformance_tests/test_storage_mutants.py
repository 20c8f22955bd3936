"""The storage family catches a backend that keeps whole what its strategy claims to shard.

For every shipped backend and every sharding strategy it declares (FSDP's FULL_SHARD and
SHARD_GRAD_OP, ZeRO-1 SHARD_OPTIM_STATE, ZeRO-2 SHARD_GRAD_AND_OPTIM_STATE), the storage scenario
runs against ``storage_mutants.replicating(<backend>)``: the backend's declarations over plain DDP
with an unsharded optimizer. Training is right, so the oracle families pass it; the storage
scenario must fail on every rank, naming the claim and the numbers. The unmutated backends pass
the same scenario in the suite itself, which makes these failures the mutation's.
"""

from __future__ import annotations

import importlib.util

import pytest
import storage_mutants  # tests/conformance_tests/storage_mutants.py
import torch
import torch.distributed as dist

import conformance.test_storage as storage
from conformance.protocol import BackendEnv, Capability, ShardingStrategy
from conformance.suite import registry

SHIPPED = ("reference", "torch-fsdp1", "torch-fsdp2", "deepspeed", "torch-zero")
CLAIMING_STRATEGIES = (
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.SHARD_OPTIM_STATE,
    ShardingStrategy.SHARD_GRAD_AND_OPTIM_STATE,
)


def _loadable(name: str) -> str | None:
    """Why ``name`` cannot be loaded here, or None."""
    if name in registry.BUILTIN:
        return None
    if name in registry.OPTIONAL_BUILTIN:
        library = registry.OPTIONAL_BUILTIN[name][0]
        return None if importlib.util.find_spec(library) else f"{library} is not installed"
    return f"{name} is not a built-in backend of this tree"


@pytest.mark.world_size(2)
@pytest.mark.parametrize("strategy", CLAIMING_STRATEGIES, ids=lambda s: s.name)
@pytest.mark.parametrize("backend_name", SHIPPED)
def test_storage_family_catches_ddp_declaring_a_sharding_strategy(
    backend_name: str, strategy: ShardingStrategy, rank: int, world_size: int, device: torch.device
) -> None:
    missing = _loadable(backend_name)
    if missing:
        pytest.skip(reason=f"{backend_name} cannot be loaded here ({missing}): its mutant runs where it can")
    mutant = storage_mutants.replicating(registry.load(backend_name))(BackendEnv(rank, world_size, device, rank))
    if not mutant.supports(Capability.for_strategy(strategy)):
        pytest.skip(reason=f"{backend_name} does not declare {strategy.name}: no claim to fake")
    failure = None
    try:
        storage.test_storage_claim(
            backend=mutant, strategy=strategy, plan="whole_model", world_size=world_size, rank=rank, device=device
        )
    except AssertionError as error:
        failure = str(error)
    except pytest.skip.Exception as skipped:  # a combination the backend lacks: same on every rank
        pytest.skip(reason=f"the storage scenario skips {backend_name}'s {strategy.name} unit-less: {skipped}")
    per_rank: list[str | None] = [None] * world_size
    dist.all_gather_object(per_rank, failure)
    assert all(per_rank), f"the storage scenario passed plain DDP declaring {backend_name}'s {strategy.name}"
    claimed = storage.storage_claim(strategy).sharded()
    for text in per_rank:
        assert "storage differs from what the strategy claims" in text, text
        assert any(f"{strategy.name} claims {stored.value} sharded" in text for stored in claimed), text
        assert "so together between" in text, text
