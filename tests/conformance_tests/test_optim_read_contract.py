"""Reading optimizer state must leave the live optimizer alone, and a failure caused by the read
says so.

The checkpoint scenarios read a trained optimizer's state (``optim_state_dict``) and then step
that optimizer on. A backend whose read changes the optimizer it reads (state converted in
place, running averages reset) would otherwise go unseen or fail later as a step that differs:
the restored pair's own read-back changes it alike. The round trip reads twice and names the
contract when the reads differ: "optim_state_dict must not modify the live optimizer".
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import conformance.test_checkpoint as checkpoint  # the module, so its tests are not collected here
from conformance.protocol import BackendAdapter, BackendEnv, ShardingStrategy, StateDictKind
from conformance.suite import registry

CONTRACT = "optim_state_dict must not modify the live optimizer"


def _reading_resets_the_optimizer(base: type[BackendAdapter]) -> type[BackendAdapter]:
    """``base`` whose optimizer state dict is correct, but reading it zeroes the live optimizer's
    per-parameter state tensors (Adam's running averages) afterwards."""

    class ReadResetsOptimizer(base):  # type: ignore[valid-type, misc]
        name = f"{base.name}+read-resets-optimizer"

        def _optim_state_dict(self, model: nn.Module, optim: Any, kind: StateDictKind) -> dict[str, Any]:
            state = copy.deepcopy(super()._optim_state_dict(model, optim, kind))
            with torch.no_grad():
                for entry in optim.state.values():
                    for value in entry.values():
                        if isinstance(value, torch.Tensor) and value.dim() > 0:
                            value.zero_()
            return state

    return ReadResetsOptimizer


def _round_trip_failure(adapter: BackendAdapter, rank: int, world_size: int, device: torch.device) -> str | None:
    """The round trip's assertion message on this rank, or None when it passed."""
    try:
        checkpoint.test_optim_state_dict_round_trip(
            backend=adapter,
            wrap="auto",
            kind=StateDictKind.FULL,
            param_offload=False,
            strategy=ShardingStrategy.FULL_SHARD,
            world_size=world_size,
            rank=rank,
            device=device,
        )
    except AssertionError as error:
        return str(error)
    return None


# Not named `backend`: the conformance plugin parametrizes every test taking that argument.
@pytest.mark.world_size(2)
def test_a_read_that_resets_the_optimizer_names_the_contract(rank: int, world_size: int, device: torch.device) -> None:
    base = registry.load("reference")
    env = BackendEnv(rank, world_size, device)
    runs = {
        "clean": _round_trip_failure(base(env), rank, world_size, device),
        "mutant": _round_trip_failure(_reading_resets_the_optimizer(base)(env), rank, world_size, device),
    }
    per_rank: list[dict[str, str | None]] = [{} for _ in range(world_size)]
    dist.all_gather_object(per_rank, runs)

    clean = [found["clean"] for found in per_rank if found["clean"] is not None]
    assert not clean, "the round trip fails on the clean reference adapter:\n" + "\n".join(clean)[-3000:]
    texts = [found["mutant"] for found in per_rank]
    assert all(text is not None for text in texts), f"a read that resets the optimizer passed on some rank: {texts}"
    assert all(CONTRACT in text for text in texts if text is not None), (
        f"the round trip failed without naming {CONTRACT!r}:\n" + "\n".join(map(str, texts))[-3000:]
    )
