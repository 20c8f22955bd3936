"""Model and optimizer state dicts: full / sharded round trips across sharding layouts."""

from __future__ import annotations

import copy
import functools

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
    "auto": lambda m, **o: engine.fully_shard(m, auto_wrap_classes={Block}, **o),
    "submodules_only": lambda m, **o: (engine.fully_shard(m.b1, **o), engine.fully_shard(m.b2, **o), m)[-1],
    "mixed_no_shard_root": lambda m, **o: (
        engine.fully_shard(m.b1, **o),
        engine.fully_shard(m, strategy=ShardingStrategy.NO_SHARD, **o),
    )[-1],
    "ignored": lambda m, **o: engine.fully_shard(m, auto_wrap_classes={Block}, ignored_modules=[m.b2], **o),
    "wrapper": lambda m, **o: engine.ShardedModule(m, auto_wrap_classes={Block}, **o),
    "shard_grad_op": lambda m, **o: engine.fully_shard(
        m, auto_wrap_classes={Block}, strategy=ShardingStrategy.SHARD_GRAD_OP, **o
    ),
}
PARAMS = pytest.mark.parametrize("use_orig_params", [True, False], ids=["orig_params", "flat_params"])


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
@PARAMS
@pytest.mark.parametrize("kind", list(StateDictKind), ids=lambda k: k.name)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_save_matches_local_and_load_restores(device, layout, kind, use_orig_params):
    torch.manual_seed(0)
    local = Model().to(device)
    build = functools.partial(LAYOUTS[layout], use_orig_params=use_orig_params)
    saved = build(copy.deepcopy(local))
    engine.set_state_dict_type(saved, kind) if kind is StateDictKind.SHARDED else None
    state = saved.state_dict()
    assert_same_state(state, local.state_dict())
    if kind is StateDictKind.SHARDED:  # also for b1 sharded first, then re-rooted by an outer application
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
        assert not [k for k in state if k.endswith(("weight", "bias"))]


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


def trained_with_adam(local: nn.Module, use_orig_params: bool, device: torch.device):
    """(sharded model, its optimizer) after one Adam step on the batch every rank shares."""
    model = engine.fully_shard(copy.deepcopy(local), auto_wrap_classes={Block}, use_orig_params=use_orig_params)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(2, 12, generator=torch.Generator().manual_seed(1)).to(device)).backward()
    optim.step()
    return model, optim


def assert_same_tree(got, expected, where: str = "") -> None:
    if isinstance(expected, dict):
        assert set(got) == set(expected), where
        for key in expected:
            assert_same_tree(got[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, list):
        assert len(got) == len(expected), where
        for index, (a, b) in enumerate(zip(got, expected)):
            assert_same_tree(a, b, f"{where}/{index}")
    elif isinstance(expected, torch.Tensor):
        torch.testing.assert_close(gathered(got), gathered(expected), rtol=0, atol=0, msg=where)
    else:
        assert got == expected, where


@pytest.mark.world_size([2, 4])
@PARAMS
@pytest.mark.parametrize("sharded", [False, True], ids=["full", "sharded"])
def test_optimizer_state_dict_round_trip(device, sharded, use_orig_params):
    torch.manual_seed(0)
    local = Model().to(device)
    model, optim = trained_with_adam(local, use_orig_params, device)
    local_optim = torch.optim.Adam(local.parameters(), lr=1e-2)
    local(torch.randn(2, 12, generator=torch.Generator().manual_seed(1)).to(device)).backward()
    local_optim.step()
    state = engine.optim_state_dict(model, optim, sharded=sharded)
    names = [n for n, _ in local.named_parameters()]
    assert set(state["state"]) == set(names)
    assert sorted(state["param_groups"][0]["params"]) == sorted(names)
    for name, param in local.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            # every rank saw the same batch, so the engine's averaged gradient equals the local one
            torch.testing.assert_close(
                gathered(state["state"][name][key]), local_optim.state[param][key], msg=f"{name}.{key}"
            )
    fresh = engine.fully_shard(copy.deepcopy(local), auto_wrap_classes={Block}, use_orig_params=use_orig_params)
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    engine.load_optim_state_dict(fresh, fresh_optim, state)
    for p_old, p_new in zip(optim.param_groups[0]["params"], fresh_optim.param_groups[0]["params"]):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(fresh_optim.state[p_new][key], optim.state[p_old][key])


@pytest.mark.world_size([2, 4])
@pytest.mark.parametrize("sharded", [False, True], ids=["full", "sharded"])
def test_optimizer_state_dicts_agree_across_parameter_modes(device, sharded):
    """Both modes step the same elements alike: their FQN-keyed dicts are equal, and each loads
    into the other mode to give the same dict back."""
    torch.manual_seed(0)
    local = Model().to(device)
    trained = {mode: trained_with_adam(local, mode, device) for mode in (True, False)}
    states = {mode: engine.optim_state_dict(*trained[mode], sharded=sharded) for mode in trained}
    # Groups list FQNs in optimizer order, which differs between the modes; state must not.
    assert_same_tree(states[False]["state"], states[True]["state"], "flat vs orig")
    for source, target in ((True, False), (False, True)):
        model = engine.fully_shard(copy.deepcopy(local), auto_wrap_classes={Block}, use_orig_params=target)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        engine.load_optim_state_dict(model, optim, copy.deepcopy(states[source]))
        assert_same_tree(engine.optim_state_dict(model, optim, sharded=sharded)["state"], states[target]["state"])
