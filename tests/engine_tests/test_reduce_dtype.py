"""Mixed precision: gradients are reduced in the dtype asked for, stored and applied in fp32.

Two ranks contribute per-element gradients 1 and 2**-8. Their sum, 1 + 2**-8, lies exactly half
a bfloat16 step (2**-7 at 1) above 1, so a bfloat16 reduction rounds it to 1 (ties to even) and
the average is 0.5; a float32 reduction keeps it, and the average is 0.501953125 = 0.5 + 2**-9,
which bfloat16 cannot represent either. So the stored gradient tells, exactly, which dtype the
reduction ran in, and an SGD step with lr=1 tells whether the fp32 master was updated in fp32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import engine
from engine import MixedPrecision, ShardingStrategy

LOW = torch.bfloat16
SMALL = 2.0**-8  # rank 1's gradient: half a bfloat16 step at 1
LOW_PRECISION_AVERAGE = 0.5  # (1 + 2**-8 rounded to bfloat16) / 2
FULL_PRECISION_AVERAGE = 0.5 + 2.0**-9  # (1 + 2**-8) / 2, exact in float32


class Scaled(nn.Module):
    """loss = sum(weight * x): the gradient of `weight` is the input, whatever its value."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(numel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * x).sum()


STRATEGIES = [
    ShardingStrategy.FULL_SHARD,  # reduce-scatter
    ShardingStrategy.NO_SHARD,  # all-reduce
    ShardingStrategy.SHARD_GRAD_AND_OPTIM_STATE,  # reduce-scatter to the partition owner
]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
@pytest.mark.parametrize("reduce_dtype", [None, torch.float32], ids=["reduce_in_param_dtype", "reduce_in_fp32"])
def test_reduction_runs_in_the_requested_dtype(rank, world_size, device, strategy, reduce_dtype):
    numel = 4  # two elements per rank under the sharded strategies
    model = engine.fully_shard(
        Scaled(numel).to(device),
        strategy=strategy,
        mixed_precision=MixedPrecision(param_dtype=LOW, reduce_dtype=reduce_dtype),
    )
    unit = engine.units(model)[0]
    assert unit.reduce_dtype == (reduce_dtype or LOW)
    optim = engine.ShardedOptimizer(model, lambda params: torch.optim.SGD(params, lr=1.0))
    x = torch.full((numel,), 1.0 if rank == 0 else SMALL, device=device)
    model(x).backward()

    expected = LOW_PRECISION_AVERAGE if reduce_dtype is None else FULL_PRECISION_AVERAGE
    store = unit.optim_partition if unit.partitions_grads else unit.exposure
    grad = store.grad_chunk()
    assert grad.dtype == torch.float32, "the stored gradient must be in the master dtype"
    valid = store.layout.valid_in_chunk
    assert grad[:valid].tolist() == [expected] * valid, f"rank {rank}: reduced in the wrong dtype"

    optim.step()
    with engine.unshard_params(model):
        weight = model.weight.detach()
        assert weight.dtype == torch.float32
        # 0 - lr * average: in fp32 the full-precision average survives the update exactly.
        assert weight.tolist() == [-expected] * numel, f"rank {rank}: master not updated in fp32"
