"""SHARD_OPTIM_STATE (ZeRO-1): replicated parameters and gradients, partitioned optimizer state."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard
from two_linear_block import Block, Net, batches, train_alongside  # tests/engine_tests/two_linear_block.py

import engine
from engine import ShardingStrategy

ZERO1 = ShardingStrategy.SHARD_OPTIM_STATE
OPTIMIZERS = {
    "sgd": functools.partial(torch.optim.SGD, lr=1e-2),  # scale-sensitive: a wrong average shows
    "adam": functools.partial(torch.optim.Adam, lr=1e-2),
}
PARAMS = pytest.mark.parametrize("use_orig_params", [True, False], ids=["orig_params", "flat_params"])


def shard(local: nn.Module, form: str, **options) -> nn.Module:
    model = copy.deepcopy(local)
    if form == "wrapper":
        return engine.ShardedModule(model, auto_wrap_classes={Block}, strategy=ZERO1, **options)
    return engine.fully_shard(model, auto_wrap_classes={Block}, strategy=ZERO1, **options)


def assert_replicated_and_equal(local: nn.Module, model: nn.Module, what: str) -> None:
    """The model shows full parameters (no unshard needed) equal to the local model's."""
    names = dict(model.named_parameters())
    for name, expected in local.named_parameters():
        got = names[name]
        assert got.shape == expected.shape, f"{what}: {name} is not replicated: {tuple(got.shape)}"
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{what}: {n}: {m}")


@pytest.mark.world_size([2, 4])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("form", ["wrapper", "composable"])
def test_parity_with_single_process_training(device, rank, world_size, optimizer, form):
    """Each rank trains on its batch; parameters equal one plain model on the global batch after
    every step, and the stored gradients are the full average (replicated, ZeRO-1)."""
    torch.manual_seed(0)
    local = Net().to(device)
    model = shard(local, form)
    local_optim = OPTIMIZERS[optimizer](p for p in local.parameters() if p.requires_grad)
    optim = engine.ShardedOptimizer(model, OPTIMIZERS[optimizer])
    for step, batch in enumerate(batches(world_size, device, 4)):
        local_optim.zero_grad()
        local(batch.view(-1, 10)).sum().div(world_size).backward()
        optim.zero_grad(set_to_none=step % 2 == 0)
        model(batch[rank]).sum().backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        for name, param in local.named_parameters():
            if param.grad is not None:
                torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-5, msg=name)
        local_optim.step()
        optim.step()
        assert_replicated_and_equal(local, model, f"step {step}")


@pytest.mark.world_size(2)
@pytest.mark.parametrize("options", [{"use_orig_params": False}, {"offload_params": True}], ids=["flat", "offload"])
def test_parity_flat_parameters_and_offload(device, rank, world_size, options):
    torch.manual_seed(0)
    local = Net().to(device)
    model = shard(local, "composable", device=device, **options)
    local_optim = torch.optim.Adam((p for p in local.parameters() if p.requires_grad), lr=1e-2)
    optim = engine.ShardedOptimizer(model, functools.partial(torch.optim.Adam, lr=1e-2))

    def check(step: int) -> None:
        with engine.unshard_params(model):
            assert_replicated_and_equal(local, model, f"step {step}")

    train_alongside(local, local_optim, [(model, optim)], rank, world_size, device, after_step=check)


def per_param_state_numel(optim: engine.ShardedOptimizer) -> dict[str, int]:
    totals: dict[str, int] = {}
    for state in optim.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                totals[key] = totals.get(key, 0) + value.numel()
    return totals


@pytest.mark.world_size([2, 4])
@PARAMS
def test_each_rank_holds_only_its_partition_of_the_state(device, rank, world_size, use_orig_params):
    torch.manual_seed(0)
    local = Net().to(device)
    model = shard(local, "composable", use_orig_params=use_orig_params)
    optim = engine.ShardedOptimizer(model, functools.partial(torch.optim.Adam, lr=1e-2))
    model(torch.randn(4, 10, device=device)).sum().backward()
    optim.step()
    units = [unit for unit in engine.units(model) if unit.has_params]
    # FULL_SHARD's chunk layout: ceil(N / world) elements per unit, padding in flat mode only.
    expected = sum(
        unit.optim_partition.layout.chunk if not use_orig_params else unit.optim_partition.layout.valid_in_chunk
        for unit in units
    )
    full = sum(unit.layout.numel for unit in units)
    numel = per_param_state_numel(optim)
    assert numel == {"exp_avg": expected, "exp_avg_sq": expected}, (numel, expected, full)
    assert expected <= -(-full // world_size) * len(units)
    held = torch.tensor([float(expected)], device=device)
    dist.all_reduce(held)
    # Across ranks every element's state exists exactly once (plus the flat mode's padding).
    padding = sum(unit.optim_partition.layout.padded_numel - unit.layout.numel for unit in units)
    assert held.item() == full + (0 if use_orig_params else padding)
    # ... while parameters and gradients stay whole on every rank.
    if use_orig_params:
        for name, param in model.named_parameters():
            assert param.shape == dict(local.named_parameters())[name].shape, name
            if param.requires_grad:
                assert param.grad is not None and param.grad.shape == param.shape, name
    else:
        for unit in units:
            assert unit.flat_param.numel() == unit.layout.numel
            assert unit.flat_param.grad is not None and unit.flat_param.grad.numel() == unit.layout.numel


def adam_step(model: nn.Module, optim, device: torch.device) -> None:
    model(torch.randn(4, 10, generator=torch.Generator().manual_seed(1)).to(device)).sum().backward()
    optim.step()


def assert_same_state(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for fqn, entry in expected.items():
        assert set(got[fqn]) == set(entry), fqn
        for key, value in entry.items():
            mine = got[fqn][key]
            mine = mine.full_tensor() if isinstance(mine, DTensor) else mine
            value = value.full_tensor() if isinstance(value, DTensor) else value
            torch.testing.assert_close(mine, value, rtol=0, atol=0, msg=f"{fqn}.{key}")


@pytest.mark.world_size([2, 4])
@PARAMS
@pytest.mark.parametrize("sharded", [False, True], ids=["full", "sharded"])
def test_optimizer_state_dict_round_trip(device, rank, world_size, use_orig_params, sharded):
    """Keyed by original FQNs, equal to a plain Adam's state on the same batch; sharded dicts
    chunk each state tensor over the ranks (Shard(0)); it loads into a fresh ZeRO-1 optimizer
    (each rank takes back its partition) and into FULL_SHARD, and FULL_SHARD's into ZeRO-1."""
    torch.manual_seed(0)
    local = Net().to(device)
    adam = functools.partial(torch.optim.Adam, lr=1e-2)
    model = shard(local, "composable", use_orig_params=use_orig_params)
    optim = engine.ShardedOptimizer(model, adam)
    adam_step(model, optim, device)
    local_optim = adam(local.parameters())
    adam_step(local, local_optim, device)  # every rank saw this batch: the same gradients
    saved = engine.optim_state_dict(model, optim, sharded=sharded)
    trained = {n for n, p in local.named_parameters() if p.requires_grad}
    assert set(saved["state"]) == trained
    for name, param in local.named_parameters():
        if not param.requires_grad:
            continue
        for key in ("exp_avg", "exp_avg_sq"):
            value = saved["state"][name][key]
            if sharded:
                assert isinstance(value, DTensor) and value.placements == (Shard(0),), (name, key)
                value = value.full_tensor()
            torch.testing.assert_close(value, local_optim.state[param][key], msg=f"{name}.{key}")

    fresh = shard(local, "composable", use_orig_params=not use_orig_params)  # the other mode
    fresh_optim = engine.ShardedOptimizer(fresh, adam)
    engine.load_optim_state_dict(fresh, fresh_optim, copy.deepcopy(saved))
    assert_same_state(engine.optim_state_dict(fresh, fresh_optim, sharded=sharded)["state"], saved["state"])
    assert per_param_state_numel(fresh_optim)["exp_avg"] < sum(p.numel() for p in trained_params(local))

    full_shard = engine.fully_shard(copy.deepcopy(local), auto_wrap_classes={Block}, use_orig_params=use_orig_params)
    full_shard_optim = adam(full_shard.parameters())
    engine.load_optim_state_dict(full_shard, full_shard_optim, copy.deepcopy(saved))
    from_full_shard = engine.optim_state_dict(full_shard, full_shard_optim, sharded=sharded)
    assert_same_state(from_full_shard["state"], saved["state"])
    again = shard(local, "composable", use_orig_params=use_orig_params)
    again_optim = engine.ShardedOptimizer(again, adam)
    engine.load_optim_state_dict(again, again_optim, from_full_shard)
    assert_same_state(engine.optim_state_dict(again, again_optim)["state"], saved["state"])
    # The loaded state steps as the saved one does: one more step agrees with the original.
    for trained_model, trained_optim in ((model, optim), (again, again_optim)):
        trained_optim.zero_grad()
        adam_step(trained_model, trained_optim, device)
    for (name, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def trained_params(local: nn.Module) -> list[nn.Parameter]:
    return [p for p in local.parameters() if p.requires_grad]


@pytest.mark.world_size(2)
def test_state_saved_for_another_model_is_refused(device):
    torch.manual_seed(0)
    local = Net().to(device)
    model = shard(local, "composable")
    optim = engine.ShardedOptimizer(model, functools.partial(torch.optim.Adam, lr=1e-2))
    adam_step(model, optim, device)
    saved = engine.optim_state_dict(model, optim)
    saved["state"]["odd"]["exp_avg"] = torch.zeros(7)
    with pytest.raises(ValueError, match=r"'exp_avg' of odd has 7 elements, the parameter 30"):
        engine.load_optim_state_dict(model, optim, saved)


@pytest.mark.world_size(2)
def test_parameter_groups_and_a_plain_optimizer(device, rank, world_size):
    """Parameter groups keep their options per partition; a plain torch optimizer over the
    replicated parameters trains the same (its state is then replicated, NO_SHARD-like)."""
    torch.manual_seed(0)
    local = Net().to(device)
    groups = lambda m: [  # noqa: E731
        {"params": list(m.b1.parameters()), "lr": 1e-2},
        {"params": [p for n, p in m.named_parameters() if not n.startswith("b1.")], "lr": 1e-3},
    ]
    zero1 = shard(local, "composable")
    zero1_optim = engine.ShardedOptimizer(zero1, functools.partial(torch.optim.SGD), params=groups(zero1))
    assert [g["lr"] for g in zero1_optim.param_groups] == [1e-2, 1e-3]
    plain = shard(local, "wrapper")
    plain_optim = torch.optim.SGD(groups(plain))
    reference = copy.deepcopy(local)
    reference_optim = torch.optim.SGD(groups(reference))
    train_alongside(reference, reference_optim, [(zero1, zero1_optim), (plain, plain_optim)], rank, world_size, device)
    assert_replicated_and_equal(reference, zero1, "ShardedOptimizer with groups")
    assert_replicated_and_equal(reference, plain, "plain optimizer")


@pytest.mark.world_size(2)
def test_units_of_other_strategies_pass_through(device, rank, world_size):
    """A FULL_SHARD unit under a SHARD_OPTIM_STATE root: the optimizer steps its shards as they
    are, the root's parameters through the partition; training matches one process."""
    torch.manual_seed(0)
    local = Net().to(device)
    model = copy.deepcopy(local)
    engine.fully_shard(model.b1)
    engine.fully_shard(model, strategy=ZERO1)
    optim = engine.ShardedOptimizer(model, functools.partial(torch.optim.SGD, lr=1e-2))
    b1_shards = {id(p) for p in model.b1.parameters()}
    inner = {id(p) for group in optim.param_groups for p in group["params"]}
    assert b1_shards <= inner and not any(id(p) in inner for p in model.b2.parameters())
    local_optim = torch.optim.SGD(local.parameters(), lr=1e-2)
    train_alongside(local, local_optim, [(model, optim)], rank, world_size, device)
    with engine.unshard_params(model):
        assert_replicated_and_equal(local, model, "mixed strategies")
