"""Flat-parameter mode (use_orig_params=False): what modules expose, in every state."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn as nn

import engine
from engine import MixedPrecision, ShardingStrategy


class Block(nn.Module):
    """7 + 7*5 + 5 = 47 elements: uneven at world sizes 2 and 4 (padding on the last rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.out = nn.Linear(7, 5, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x)))


class Net(nn.Module):
    """Root parameters around two blocks; `none_bias` has a `None` entry in `_parameters`."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 5)
        self.b1 = Block()
        self.b2 = Block()
        self.none_bias = nn.Linear(5, 3, bias=False)
        self.scale = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.none_bias(self.b2(self.b1(self.embed(x)))) * self.scale


def shard(model: nn.Module, form: str, **options) -> nn.Module:
    options.setdefault("use_orig_params", False)
    if form == "wrapper":
        return engine.ShardedModule(model, auto_wrap_classes={Block}, **options)
    return engine.fully_shard(model, auto_wrap_classes={Block}, **options)


def flat_values(module: nn.Module) -> torch.Tensor:
    """What the flat buffer of a unit managing `module`'s parameters holds (unpadded)."""
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def expected_chunk(values: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    chunk = -(-values.numel() // world_size)
    padded = torch.zeros(chunk * world_size, dtype=values.dtype, device=values.device)
    padded[: values.numel()] = values
    return padded[rank * chunk : (rank + 1) * chunk]


def root_values(local: Net) -> torch.Tensor:
    blocks = {id(p) for block in (local.b1, local.b2) for p in block.parameters()}
    return torch.cat([p.detach().reshape(-1) for p in local.parameters() if id(p) not in blocks])


@pytest.mark.world_size([1, 2, 4])
@pytest.mark.parametrize("form", ["wrapper", "composable"])
def test_one_flat_parameter_per_unit_holding_this_ranks_chunk(rank, world_size, device, form):
    torch.manual_seed(0)
    local = Net().to(device)
    model = shard(copy.deepcopy(local), form)
    named = dict(model.named_parameters())
    assert list(named) == ["_flat_param", "b1._flat_param", "b2._flat_param"]
    assert all(type(p) is nn.Parameter and p.dim() == 1 for p in named.values())
    expected = {
        "_flat_param": root_values(local),
        "b1._flat_param": flat_values(local.b1),
        "b2._flat_param": flat_values(local.b2),
    }
    for name, values in expected.items():
        torch.testing.assert_close(
            named[name].detach(), expected_chunk(values, rank, world_size), rtol=0, atol=0, msg=name
        )
    # Registered where torch FSDP1 registers it: on the module the user holds as the unit.
    root_holder = model.module if form == "wrapper" else model
    assert root_holder._parameters["_flat_param"] is named["_flat_param"]
    raw = [name for name, _ in nn.Module.named_parameters(model)]
    wrapped = "_sharded_wrapped_module."
    assert raw == (
        [f"{wrapped}_flat_param", f"{wrapped}b1.{wrapped}_flat_param", f"{wrapped}b2.{wrapped}_flat_param"]
        if form == "wrapper"
        else list(named)
    )
    # The original parameters are plain tensors now, not parameters.
    assert type(model.b1.inp.weight) is torch.Tensor and model.b1.inp.weight.shape == (7, 5)
    assert model.none_bias.bias is None


@pytest.mark.world_size([1, 2, 4])
@pytest.mark.parametrize("form", ["wrapper", "composable"])
@pytest.mark.parametrize("writeback", [True, False])
def test_unshard_registers_originals_in_order_and_writes_back(rank, world_size, device, form, writeback):
    torch.manual_seed(0)
    local = Net().to(device)
    model = shard(copy.deepcopy(local), form)
    with engine.unshard_params(model, writeback=writeback):
        pairs = list(itertools.zip_longest(local.named_parameters(), model.named_parameters()))
        for (name, expected), (got_name, got) in pairs:
            assert got_name == name and type(got) is nn.Parameter
            torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)
        assert not any("_flat_param" in name for name, _ in nn.Module.named_parameters(model))
        with torch.no_grad():
            for param in model.parameters():
                param.fill_(3.0)
    assert [name for name, _ in model.named_parameters()] == ["_flat_param", "b1._flat_param", "b2._flat_param"]
    persists = writeback or world_size == 1  # one rank: the shown parameters are the stored ones
    for unit in engine.units(model):
        valid = unit.layout.valid_in_chunk
        stored = unit.flat_param.detach()
        if persists:
            assert bool((stored[:valid] == 3.0).all())
        else:
            assert not bool((stored[:valid] == 3.0).any())
        assert not bool(stored[valid:].any()), "padding must stay zero"


class Recorder(nn.Module):
    """Records what `weight` is while forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.weight)
        return x @ self.weight


@pytest.mark.world_size(2)
@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
def test_forward_uses_plain_views_of_the_unsharded_buffer(device, mixed):
    model = engine.fully_shard(
        nn.Sequential(Recorder(), Recorder()).to(device),
        auto_wrap_classes={Recorder},
        use_orig_params=False,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16) if mixed else None,
    )
    x = torch.randn(3, 4, device=device)
    model(x.to(torch.bfloat16) if mixed else x).float().sum().backward()
    for recorder, unit in zip(model, engine.units(model)[1:]):
        (weight,) = recorder.seen
        assert type(weight) is torch.Tensor and weight.requires_grad and weight.shape == (4, 4)
        assert weight.dtype == (torch.bfloat16 if mixed else torch.float32)
        assert weight.untyped_storage()._cdata == unit._full.untyped_storage()._cdata
        assert unit.flat_param.grad is not None and unit.flat_param.grad.dtype == torch.float32
        assert unit.flat_param.grad.shape == unit.flat_param.shape


@pytest.mark.world_size(2)
def test_mixed_requires_grad_in_one_unit_is_refused(device):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)).to(device)
    model[0].requires_grad_(False)
    with pytest.raises(ValueError, match=r"requires_grad.*use_orig_params=True"):
        engine.fully_shard(model, use_orig_params=False)


@pytest.mark.world_size(2)
def test_frozen_flat_parameter_gets_no_gradient(device):
    model = engine.fully_shard(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)).to(device), use_orig_params=False)
    (flat,) = model.parameters()
    flat.requires_grad_(False)
    output = model(torch.randn(2, 3, device=device, requires_grad=True))
    output.sum().backward()
    assert flat.grad is None


@pytest.mark.world_size([2, 4])
@pytest.mark.parametrize("strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD], ids=lambda s: s.name)
def test_with_grads_shows_averaged_original_gradients(rank, world_size, device, strategy):
    torch.manual_seed(0)
    local = Net().to(device)
    model = shard(copy.deepcopy(local), "composable", strategy=strategy)
    batch = torch.randn(world_size, 2, 5, generator=torch.Generator().manual_seed(3)).to(device)
    (local(batch.view(-1, 5)).sum() / world_size).backward()
    model(batch[rank]).sum().backward()
    with engine.unshard_params(model, with_grads=True, writeback=False):
        for (name, expected), (_, got) in zip(local.named_parameters(), model.named_parameters()):
            torch.testing.assert_close(got.grad, expected.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.world_size(2)
def test_offloaded_flat_parameters_and_gradients_stay_on_cpu(device):
    torch.manual_seed(0)
    model = shard(Net().to(device), "composable", offload_params=True)
    model(torch.randn(2, 5, device=device)).sum().backward()
    for param in model.parameters():
        assert param.device.type == "cpu" and param.grad.device.type == "cpu"


@pytest.mark.world_size(2)
@pytest.mark.parametrize("strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD], ids=lambda s: s.name)
def test_unit_without_parameters_of_its_own_has_no_flat_parameter(rank, world_size, device, strategy):
    """A unit whose parameters all belong to units nested in it (each Block over two Linear
    units) holds no ``_flat_param``, as in torch FSDP1: an empty one showed in its full state
    dict (found by a generated program: nested units, flat parameters)."""
    torch.manual_seed(0)
    local = Net().to(device)
    model = engine.ShardedModule(
        copy.deepcopy(local), auto_wrap_classes={Block, nn.Linear}, use_orig_params=False, strategy=strategy
    )
    names = [name for name, _ in model.named_parameters()]
    assert "b1._flat_param" not in names and "b2._flat_param" not in names, names
    assert "b1.inp._flat_param" in names
    state = model.state_dict()
    assert sorted(state) == sorted(local.state_dict()), sorted(set(state) ^ set(local.state_dict()))
    for name, value in local.state_dict().items():
        torch.testing.assert_close(state[name].detach(), value, rtol=0, atol=0, msg=name)
