"""Model and optimizer state dicts: full / sharded round trips across sharding layouts."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

import engine
from engine import ShardingStrategy, StateDictKind


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 12)
        self.register_buffer("running", torch.arange(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) + self.running.sum()


class Model(nn.Module):
    """Blocks, a root parameter, a tied weight and an odd-sized parameter (uneven shards)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(12, 12)
        self.b1 = Block()
        self.b2 = Block()
        self.tail = nn.Linear(12, 12, bias=False)
        self.tail.weight = self.embed.weight
        self.odd = nn.Parameter(torch.randn(5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.b2(self.b1(self.embed(x)))).sum() + self.odd.sum()


LAYOUTS = {
    "auto": lambda m: engine.fully_shard(m, auto_wrap_classes={Block}),
    "submodules_only": lambda m: (engine.fully_shard(m.b1), engine.fully_shard(m.b2), m)[-1],
    "mixed_no_shard_root": lambda m: (
        engine.fully_shard(m.b1), engine.fully_shard(m, strategy=ShardingStrategy.NO_SHARD)
    )[-1],
    "ignored": lambda m: engine.fully_shard(m, auto_wrap_classes={Block}, ignored_modules=[m.b2]),
    "wrapper": lambda m: engine.ShardedModule(m, auto_wrap_classes={Block}),
    "shard_grad_op": lambda m: engine.fully_shard(m, auto_wrap_classes={Block}, strategy=ShardingStrategy.SHARD_GRAD_OP),
}


def gathered(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def assert_same_state(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(gathered(got[key]).to(value.device), value, msg=key)


def zero_(model: nn.Module) -> None:
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()


@pytest.mark.world_size([1, 2, 4])
@pytest.mark.parametrize("kind", list(StateDictKind), ids=lambda k: k.name)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_save_matches_local_and_load_restores(device, layout, kind):
    torch.manual_seed(0)
    local = Model().to(device)
    build = LAYOUTS[layout]
    saved = build(copy.deepcopy(local))
    engine.set_state_dict_type(saved, kind) if kind is StateDictKind.SHARDED else None
    state = saved.state_dict()
    assert_same_state(state, local.state_dict())
    if kind is StateDictKind.SHARDED and layout in ("auto", "wrapper"):
        weight = state["b1.fc.weight"]
        assert isinstance(weight, DTensor) and weight.placements == (Shard(0),)
    loaded = build(copy.deepcopy(local))
    zero_(loaded)
    engine.set_state_dict_type(loaded, kind) if kind is StateDictKind.SHARDED else None
    loaded.load_state_dict({k: v.clone() if not isinstance(v, DTensor) else v for k, v in state.items()})
    for (name, got), (_, expected) in zip(loaded.named_parameters(), saved.named_parameters()):
        torch.testing.assert_close(got, expected, msg=name)
    with engine.unshard_params(loaded):
        for (name, got), (_, expected) in zip(loaded.named_parameters(), local.named_parameters()):
            torch.testing.assert_close(got, expected, msg=name)


@pytest.mark.world_size(2)
def test_full_state_dict_rank0_only_offloaded(rank, device):
    torch.manual_seed(0)
    local = Model().to(device)
    model = engine.fully_shard(copy.deepcopy(local), auto_wrap_classes={Block})
    engine.set_state_dict_type(model, StateDictKind.FULL, rank0_only=True, offload_to_cpu=True)
    state = model.state_dict()
    if rank == 0:
        assert_same_state(state, local.state_dict())
        assert all(v.device.type == "cpu" for k, v in state.items() if k.endswith("weight"))
    else:
        assert not [k for k in state if k.endswith("weight") or k.endswith("bias")]


@pytest.mark.world_size(4)
def test_hybrid_sharded_state_dict_is_replicate_shard(device):
    torch.manual_seed(0)
    local = Model().to(device)
    model = engine.fully_shard(
        copy.deepcopy(local), auto_wrap_classes={Block}, strategy=ShardingStrategy.HYBRID_SHARD, shard_group_size=2
    )
    engine.set_state_dict_type(model, StateDictKind.SHARDED)
    state = model.state_dict()
    assert state["b1.fc.weight"].device_mesh.mesh_dim_names == ("replicate", "shard")
    assert_same_state(state, local.state_dict())


@pytest.mark.world_size([2, 4])
@pytest.mark.parametrize("sharded", [False, True], ids=["full", "sharded"])
def test_optimizer_state_dict_round_trip(device, sharded):
    torch.manual_seed(0)
    local = Model().to(device)
    model = engine.fully_shard(copy.deepcopy(local), auto_wrap_classes={Block})
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    local_optim = torch.optim.Adam(local.parameters(), lr=1e-2)
    x = torch.randn(2, 12, device=device)
    for target, target_optim in ((model, optim), (local, local_optim)):
        target(x).backward()
        target_optim.step()
    state = engine.optim_state_dict(model, optim, sharded=sharded)
    names = [n for n, _ in local.named_parameters()]
    assert set(state["state"]) == set(names) and state["param_groups"][0]["params"] == names
    for name, param in local.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            # every rank saw the same batch, so the engine's averaged gradient equals the local one
            torch.testing.assert_close(
                gathered(state["state"][name][key]), local_optim.state[param][key], msg=f"{name}.{key}"
            )
    fresh = engine.fully_shard(copy.deepcopy(local), auto_wrap_classes={Block})
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    engine.load_optim_state_dict(fresh, fresh_optim, state)
    for p_old, p_new in zip(optim.param_groups[0]["params"], fresh_optim.param_groups[0]["params"]):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(fresh_optim.state[p_new][key], optim.state[p_old][key])
