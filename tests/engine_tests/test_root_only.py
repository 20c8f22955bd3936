"""Unit-less plans: the root is the only unit, for every strategy.

ZeRO-1 and ZeRO-2 are usually applied without units (DeepSpeed has none), so the engine must
train, save and load such a model exactly as one with units: training matches one plain model,
full and sharded state dicts round-trip, optimizer state dicts (full and sharded) read back what
was loaded, and the unshard context shows the trained parameters.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from two_linear_block import train_alongside  # tests/engine_tests/two_linear_block.py

import engine
from engine import ShardingStrategy, StateDictKind

ADAM = functools.partial(torch.optim.Adam, lr=1e-2)


class Net(nn.Module):
    """Parameters of odd sizes directly under the root and in a child (uneven partitions)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 7)
        self.odd = nn.Parameter(torch.randn(7, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(self.fc(x)) @ self.odd).sum(dim=-1)


def root_only(local: nn.Module, strategy: ShardingStrategy, use_orig_params: bool) -> nn.Module:
    options = {"shard_group_size": 1} if strategy is ShardingStrategy.HYBRID_SHARD else {}
    return engine.fully_shard(copy.deepcopy(local), strategy=strategy, use_orig_params=use_orig_params, **options)


def full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def assert_same_optim_state(got: dict, expected: dict) -> None:
    assert set(got["state"]) == set(expected["state"])
    for fqn, entry in expected["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(full(got["state"][fqn][key]), full(value), rtol=0, atol=0, msg=f"{fqn}.{key}")


# Every strategy, each in one parameter mode, both modes covered.
CASES = [
    pytest.param(strategy, index % 2 == 0, id=f"{strategy.name}-{'orig' if index % 2 == 0 else 'flat'}_params")
    for index, strategy in enumerate(ShardingStrategy)
]


@pytest.mark.world_size(2)
@pytest.mark.parametrize(("strategy", "use_orig_params"), CASES)
def test_root_only_trains_saves_and_loads(device, rank, world_size, strategy, use_orig_params):
    torch.manual_seed(0)
    local = Net().to(device)
    model = root_only(local, strategy, use_orig_params)
    assert len(engine.units(model)) == 1
    local_optim = ADAM(local.parameters())
    optim = engine.ShardedOptimizer(model, ADAM)
    train_alongside(local, local_optim, [(model, optim)], rank, world_size, device, steps=2)

    with engine.unshard_params(model):
        for name, expected in local.named_parameters():
            got = dict(model.named_parameters())[name]
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=f"unshard: {name}")

    for kind in StateDictKind:
        engine.set_state_dict_type(model, kind)
        state = model.state_dict()
        for name, expected in local.state_dict().items():
            torch.testing.assert_close(full(state[name]), expected, rtol=1e-4, atol=1e-5, msg=f"{kind}: {name}")
        fresh = root_only(Net().to(device), strategy, use_orig_params)
        engine.set_state_dict_type(fresh, kind)
        fresh.load_state_dict(state)
        with engine.unshard_params(fresh):
            for name, expected in local.named_parameters():
                got = dict(fresh.named_parameters())[name]
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=f"{kind} load: {name}")

        sharded = kind is StateDictKind.SHARDED
        saved = engine.optim_state_dict(model, optim, sharded=sharded)
        assert set(saved["state"]) == {name for name, _ in local.named_parameters()}
        for name, param in local.named_parameters():
            torch.testing.assert_close(
                full(saved["state"][name]["exp_avg"]), local_optim.state[param]["exp_avg"], rtol=1e-4, atol=1e-6
            )
        fresh_optim = engine.ShardedOptimizer(fresh, ADAM)
        engine.load_optim_state_dict(fresh, fresh_optim, copy.deepcopy(saved))
        assert_same_optim_state(engine.optim_state_dict(fresh, fresh_optim, sharded=sharded), saved)
