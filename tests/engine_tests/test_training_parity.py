"""Training parity: the engine on per-rank batches vs one plain model on the global batch."""

from __future__ import annotations

import copy
import functools
import gc
import weakref

import pytest
import torch
import torch.nn as nn

import engine
from engine import MixedPrecision, ShardingStrategy

STRATEGIES = list(ShardingStrategy)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(100, 100)
        self.mlp = nn.Sequential(nn.ReLU(), nn.Linear(100, 100), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.proj(x))


class Net(nn.Module):
    """Root-level parameters plus two blocks: units at two nesting levels."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(100, 100)
        self.b1 = Block()
        self.b2 = Block()
        self.head = nn.Parameter(torch.randn(100, 7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.b2(self.b1(self.embed(x))) @ self.head).relu()


def shard(model: nn.Module, api: str, auto: bool, world_size: int, **options) -> nn.Module:
    if options.get("strategy") is ShardingStrategy.HYBRID_SHARD:
        options["shard_group_size"] = max(1, world_size // 2)
    if api == "wrapper":
        if auto:
            return engine.ShardedModule(model, auto_wrap_classes={Block}, **options)
        model.b2 = engine.ShardedModule(model.b2, **options)
        return engine.ShardedModule(model, **options)
    if auto:
        return engine.fully_shard(model, auto_wrap_classes={Block}, **options)
    engine.fully_shard(model.b2, **options)
    return engine.fully_shard(model, **options)


def seeded_pair(
    world_size: int, device: torch.device, api: str = "composable", auto: bool = True, **options: object
) -> tuple[Net, nn.Module]:
    """A plain `Net` seeded alike on every rank and a sharded copy of it (`shard`): the two models
    a parity test trains side by side."""
    torch.manual_seed(0)
    local = Net().to(device)
    return local, shard(copy.deepcopy(local), api, auto, world_size, **options)


def train_both(local, model, rank, world_size, device, iters=5):
    local_optim = torch.optim.Adam(local.parameters(), lr=1e-2)
    make_optim = functools.partial(torch.optim.Adam, lr=1e-2)
    # ZeRO-2 stores gradients only in the optimizer partitions: it needs the partitioning
    # optimizer (ZeRO-1 keeps training with a plain one here, as documented).
    if any(unit.partitions_grads for unit in engine.units(model)):
        optim = engine.ShardedOptimizer(model, make_optim)
    else:
        optim = make_optim(model.parameters())
    generator = torch.Generator().manual_seed(1234)
    for step in range(iters):
        batch = torch.randn(world_size, 2, 100, generator=generator).to(device)
        local_optim.zero_grad()
        (local(batch.view(-1, 100)).sum() / world_size).backward()
        local_optim.step()
        optim.zero_grad(set_to_none=step % 2 == 0)
        model(batch[rank]).sum().backward()
        optim.step()
        assert not any(unit.is_unsharded for unit in engine.units(model))


def assert_same_params(local, model, atol=2e-4):
    with engine.unshard_params(model):
        pairs = list(zip(local.named_parameters(), model.named_parameters()))
        assert len(pairs) == len(list(local.parameters()))
        for (name, expected), (got_name, got) in pairs:
            assert name == got_name and expected.shape == got.shape
            torch.testing.assert_close(got, expected, atol=atol, rtol=1e-3, msg=name)


PARAMS = pytest.mark.parametrize("use_orig_params", [True, False], ids=["orig_params", "flat_params"])


@pytest.mark.world_size([2, 4])
@PARAMS
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
@pytest.mark.parametrize("auto", [True, False], ids=["auto", "manual"])
@pytest.mark.parametrize("api", ["wrapper", "composable"])
def test_training_matches_single_process(rank, world_size, device, api, auto, strategy, use_orig_params):
    local, model = seeded_pair(world_size, device, api, auto, strategy=strategy, use_orig_params=use_orig_params)
    names = [n for n, _ in model.named_parameters()]
    if use_orig_params:
        assert names == [n for n, _ in local.named_parameters()]
    else:
        assert (
            names == ["_flat_param", "b1._flat_param", "b2._flat_param"] if auto else ["_flat_param", "b2._flat_param"]
        )
    train_both(local, model, rank, world_size, device)
    assert_same_params(local, model)


@pytest.mark.world_size(1)
@PARAMS
@pytest.mark.parametrize("api", ["wrapper", "composable"])
def test_one_rank_trains_like_the_plain_model(rank, world_size, device, api, use_orig_params):
    local, model = seeded_pair(world_size, device, api, use_orig_params=use_orig_params)
    train_both(local, model, rank, world_size, device)
    assert_same_params(local, model)


@pytest.mark.world_size([2, 4])
@PARAMS
@pytest.mark.parametrize("forward_prefetch", [True, False], ids=["forward_prefetch", "no_forward_prefetch"])
@pytest.mark.parametrize("backward_prefetch", [True, False], ids=["backward_prefetch", "no_backward_prefetch"])
def test_prefetching_trains_like_the_plain_model(
    rank, world_size, device, forward_prefetch, backward_prefetch, use_orig_params
):
    local, model = seeded_pair(
        world_size,
        device,
        forward_prefetch=forward_prefetch,
        backward_prefetch=backward_prefetch,
        use_orig_params=use_orig_params,
    )
    train_both(local, model, rank, world_size, device)
    assert_same_params(local, model)


@pytest.mark.world_size(2)
@PARAMS
@pytest.mark.parametrize("strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD], ids=lambda s: s.name)
def test_cpu_offload_keeps_shards_and_grads_on_cpu(rank, world_size, device, strategy, use_orig_params):
    local, model = seeded_pair(
        world_size, device, strategy=strategy, offload_params=True, use_orig_params=use_orig_params
    )
    train_both(local, model, rank, world_size, device)
    for param in model.parameters():
        assert param.device.type == "cpu" and param.grad.device.type == "cpu"
    assert_same_params(local, model)


@pytest.mark.world_size([1, 2])
@PARAMS
def test_mixed_precision_computes_low_keeps_fp32_master(rank, world_size, device, use_orig_params):
    local, model = seeded_pair(
        world_size, device, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16), use_orig_params=use_orig_params
    )
    seen: list[torch.dtype] = []
    model.b1.proj.register_forward_hook(lambda m, i, o: seen.append(m.weight.dtype))
    x = torch.randn(2, 100, device=device)
    loss = model(x).float().sum()
    loss.backward()
    assert seen == [torch.bfloat16]
    for param in model.parameters():
        assert param.dtype == torch.float32 and param.grad.dtype == torch.float32
    expected = local(x).sum()
    torch.testing.assert_close(loss, expected, rtol=5e-2, atol=5e-1)


@pytest.mark.world_size(4)
@PARAMS
def test_hybrid_shard_from_explicit_2d_mesh(rank, world_size, device, use_orig_params):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    local = Net().to(device)
    model = engine.fully_shard(
        copy.deepcopy(local),
        auto_wrap_classes={Block},
        strategy=ShardingStrategy.HYBRID_SHARD,
        mesh=mesh,
        use_orig_params=use_orig_params,
    )
    unit = engine.units(model)[1]
    assert (unit.topology.shard_size, unit.topology.dp_world_size) == (2, 4)
    train_both(local, model, rank, world_size, device)
    assert_same_params(local, model)


@pytest.mark.world_size(4)  # shard groups of 2 and replica groups of 2: both are new groups
@pytest.mark.parametrize("api", ["wrapper", "composable"])
@pytest.mark.parametrize("use_orig_params", [True, False], ids=["orig_params", "flat_params"])
def test_a_trained_model_is_freed_with_its_groups(rank, world_size, device, api, use_orig_params):
    """Dropping a sharded, trained model frees it, its buffers and its process groups: no engine
    registry or hook keeps it alive (a HYBRID model's groups would otherwise keep gloo threads)."""
    model = shard(
        Net().to(device),
        api,
        True,
        world_size,
        strategy=ShardingStrategy.HYBRID_SHARD,
        use_orig_params=use_orig_params,
    )
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 100, device=device)).sum().backward()
    optim.step()
    # The topologies hold the process groups (the harness destroys those at the test's end; its
    # trace refers to them until then, so their own freeing is checked in tests/harness_tests).
    topologies = [weakref.ref(unit.topology) for unit in engine.units(model)]
    assert any(ref().shard_group is not None for ref in topologies), "HYBRID_SHARD built no shard group"
    freed = weakref.ref(model)
    del model, optim
    gc.collect()
    assert freed() is None, "the sharded model outlived every reference to it"
    assert all(ref() is None for ref in topologies), "a unit's topology (and its groups) outlived the model"
