"""SHARD_GRAD_AND_OPTIM_STATE (ZeRO-2): replicated parameters, partitioned gradients and state.

Training parity in both forms, with and without units and in both parameter modes, is also part
of `test_training_parity.py` (every strategy); here what ZeRO-2 alone promises is checked step by
step against one plain model on the global batch: after backward a rank stores exactly its
partition's piece of the averaged gradient and nothing of the rest (the replicated parameters
carry no gradient), the optimizer state covers only that partition, and after the step every
rank holds the same, correctly updated, whole parameters.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from two_linear_block import Block, Net, batches  # tests/engine_tests/two_linear_block.py

import engine
from engine import ShardingStrategy

ZERO2 = ShardingStrategy.SHARD_GRAD_AND_OPTIM_STATE
ADAM = functools.partial(torch.optim.Adam, lr=1e-2)


def expected_partition_grad(unit, local_grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """This rank's chunk of the unit's flat averaged gradient, from the plain model's gradients
    (zeros on padding), in the partition's layout."""
    layout = unit.optim_partition.layout
    flat = torch.zeros(layout.padded_numel, device=unit.shard.device)
    for fqn, info in zip(unit.param_fqns, unit.layout.params):
        flat[info.offset : info.offset + info.numel] = local_grads[fqn].reshape(-1)
    return flat[layout.chunk_start : layout.chunk_start + layout.chunk]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("use_orig_params", [True, False], ids=["orig_params", "flat_params"])
def test_each_rank_stores_its_gradient_partition_and_trains_like_one_process(device, rank, world_size, use_orig_params):
    torch.manual_seed(0)
    local = Net().to(device)
    model = engine.fully_shard(
        copy.deepcopy(local), auto_wrap_classes={Block}, strategy=ZERO2, use_orig_params=use_orig_params
    )
    units = [unit for unit in engine.units(model) if unit.has_params]
    assert all(unit.partitions_grads for unit in units)
    local_optim = ADAM(local.parameters())
    optim = engine.ShardedOptimizer(model, ADAM)
    for step, batch in enumerate(batches(world_size, device, 3)):
        local_optim.zero_grad()
        (local(batch.view(-1, 10)).sum() / world_size).backward()
        optim.zero_grad()
        model(batch[rank]).sum().backward()

        assert all(param.grad is None for param in model.parameters()), "replicated parameters got gradients"
        local_grads = {name: param.grad for name, param in local.named_parameters()}
        stored = 0
        for unit in units:
            partition = unit.optim_partition
            got = partition.grad_chunk()
            assert got is not None and got.numel() == partition.layout.chunk
            torch.testing.assert_close(
                got, expected_partition_grad(unit, local_grads), rtol=1e-4, atol=1e-5, msg=f"step {step}"
            )
            stored += sum(p.grad.numel() for p in partition.params)
        # Across ranks every gradient element is stored once (plus flat padding).
        total = torch.tensor([stored], device=device)
        dist.all_reduce(total)
        numel = sum(unit.layout.numel for unit in units)
        padding = sum(unit.optim_partition.layout.padded_numel - unit.layout.numel for unit in units)
        assert total.item() == numel + (0 if use_orig_params else padding)

        local_optim.step()
        optim.step()
        for name, expected in local.named_parameters():
            got = dict(model.named_parameters()).get(name) if use_orig_params else None
            if got is not None:  # whole on every rank without any unshard
                assert got.shape == expected.shape, name
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=f"step {step}: {name}")
    with engine.unshard_params(model):
        for name, expected in local.named_parameters():
            got = dict(model.named_parameters())[name]
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=name)
    # The optimizer state covers this rank's partitions only.
    held = sum(v.numel() for s in optim.state.values() for k, v in s.items() if k == "exp_avg")
    assert held == sum(
        unit.optim_partition.layout.valid_in_chunk if use_orig_params else unit.optim_partition.layout.chunk
        for unit in units
    )


@pytest.mark.world_size(2)
def test_unshard_with_grads_shows_and_writes_back_the_whole_gradient(device, rank, world_size):
    """`with_grads` gathers the partitions into full gradients; a write lands in each rank's
    partition (what the next step applies)."""
    torch.manual_seed(0)
    local = Net().to(device)
    model = engine.fully_shard(copy.deepcopy(local), auto_wrap_classes={Block}, strategy=ZERO2)
    batch = torch.randn(world_size, 4, 10, generator=torch.Generator().manual_seed(7)).to(device)
    (local(batch.view(-1, 10)).sum() / world_size).backward()
    model(batch[rank]).sum().backward()
    with engine.unshard_params(model, with_grads=True):
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, dict(local.named_parameters())[name].grad, msg=name)
            param.grad.fill_(1.0)
    for unit in engine.units(model):
        if unit.has_params:
            partition = unit.optim_partition
            valid = partition.layout.valid_in_chunk
            assert partition.grad_chunk()[:valid].eq(1.0).all(), unit.module_fqn
