"""Gradient accumulation: k backwards before a step add up, with or without `engine.no_sync`.

After k micro-batches the stored gradients must be the sum of the k gradients averaged over the
ranks (what one plain model accumulates over the k global batches, each loss divided by the
world size), whatever the strategy stores them as (sharded, whole, or ZeRO-2's partition), and
the step must apply exactly that.  With the switch, micro-batches alternate: inside `no_sync`
no reduction may be issued and the stored gradients stay as they were; the next backward
reduces the local sum once and adds it to what is stored (so both the unreduced local sum and
the stored gradients accumulate).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn
from two_linear_block import Block  # tests/engine_tests/two_linear_block.py

import engine
from engine import ShardingStrategy, collectives

MICRO_BATCHES = 4
REDUCTIONS = ("reduce_scatter_flat", "all_reduce_sum")


class Net(nn.Module):
    """A unit of its own and root parameters with an odd element count (uneven partitions)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.odd = nn.Parameter(torch.randn(10, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.block(x) @ self.odd).sum(dim=-1)


@contextlib.contextmanager
def counted_reductions() -> Iterator[list[str]]:
    """Record each gradient reduction the engine issues (the label of its unit)."""
    issued: list[str] = []
    originals = {name: getattr(collectives, name) for name in REDUCTIONS}

    def counting(original):
        def issue(*args, **kwargs):
            issued.append(collectives.current_label())
            return original(*args, **kwargs)

        return issue

    try:
        for name, original in originals.items():
            setattr(collectives, name, counting(original))
        yield issued
    finally:
        for name, original in originals.items():
            setattr(collectives, name, original)


def stored_grads(model: nn.Module) -> list[torch.Tensor | None]:
    """Copies of every stored gradient: the exposed parameters' and (ZeRO-2) the partitions'."""
    partitions = [unit.optim_partition for unit in engine.units(model) if unit.optim_partition is not None]
    params = [*model.parameters(), *(p for partition in partitions for p in partition.params)]
    return [None if param.grad is None else param.grad.clone() for param in params]


# Pairwise over (strategy, sync) x parameter mode: every strategy with and without no_sync, and
# each in both parameter modes.
CASES = [
    pytest.param(strategy, no_sync, (index + no_sync) % 2 == 0, id=f"{strategy.name}-{mode}-{params}")
    for index, strategy in enumerate(ShardingStrategy)
    for no_sync, mode in ((False, "synced"), (True, "no_sync"))
    for params in [("orig_params" if (index + no_sync) % 2 == 0 else "flat_params")]
]


@pytest.mark.world_size(2)
@pytest.mark.parametrize(("strategy", "no_sync", "use_orig_params"), CASES)
def test_micro_batches_accumulate_the_averaged_gradients(rank, world_size, device, strategy, no_sync, use_orig_params):
    torch.manual_seed(0)
    local = Net().to(device)
    options = {"shard_group_size": 1} if strategy is ShardingStrategy.HYBRID_SHARD else {}
    model = engine.fully_shard(
        copy.deepcopy(local),
        auto_wrap_classes={Block},
        strategy=strategy,
        use_orig_params=use_orig_params,
        **options,
    )
    make_optim = functools.partial(torch.optim.SGD, lr=0.1)
    local_optim = make_optim(local.parameters())
    optim = engine.ShardedOptimizer(model, make_optim)
    generator = torch.Generator().manual_seed(1234)
    batches = [torch.randn(world_size, 4, 10, generator=generator).to(device) for _ in range(MICRO_BATCHES)]

    for batch in batches:  # the plain model accumulates the averaged gradients
        (local(batch.view(-1, 10)).sum() / world_size).backward()
    units = sum(unit.has_params for unit in engine.units(model))
    for index, batch in enumerate(batches):
        skip_sync = no_sync and index % 2 == 0
        before = stored_grads(model)
        with counted_reductions() as issued, engine.no_sync(model) if skip_sync else contextlib.nullcontext():
            model(batch[rank]).sum().backward()
        assert len(issued) == (0 if skip_sync else units), f"micro-batch {index}: reductions {issued}"
        if skip_sync:
            after = stored_grads(model)
            for old, new in zip(before, after):
                assert (old is None and new is None) or torch.equal(old, new), (
                    f"micro-batch {index}: a stored gradient changed inside no_sync"
                )

    with engine.unshard_params(model, with_grads=True):
        for name, param in model.named_parameters():
            expected = dict(local.named_parameters())[name].grad
            torch.testing.assert_close(param.grad, expected, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    local_optim.step()
    optim.step()
    with engine.unshard_params(model):
        for name, param in model.named_parameters():
            expected = dict(local.named_parameters())[name]
            torch.testing.assert_close(param, expected, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
