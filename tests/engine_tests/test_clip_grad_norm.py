"""`engine.clip_grad_norm_`: one total norm over ranks, whatever each rank stores.

Every strategy in both parameter modes (pairwise), a unit of its own beside root parameters of an
odd element count (uneven, padded shards), world size 2 and 4 (HYBRID_SHARD on a (2, 2) mesh at
4): the norm returned equals `torch.nn.utils.clip_grad_norm_` over a plain model holding the
averaged gradients, on every rank, for the 2-norm and the inf-norm, and after clipping the
gradients the step applies are the plain model's clipped ones (so are the parameters after it).
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
import torch.nn as nn
from two_linear_block import Block  # tests/engine_tests/two_linear_block.py

import engine
from engine import ShardingStrategy


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.odd = nn.Parameter(torch.randn(10, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.block(x) @ self.odd).sum(dim=-1)


CASES = [
    pytest.param(
        strategy, index % 2 == 0, norm_type, id=f"{strategy.name}-{'orig' if index % 2 == 0 else 'flat'}-{name}"
    )
    for index, strategy in enumerate(ShardingStrategy)
    for norm_type, name in ((2.0, "l2"), (math.inf, "inf"))
]


@pytest.mark.world_size([2, 4])
@pytest.mark.parametrize(("strategy", "use_orig_params", "norm_type"), CASES)
def test_the_norm_is_the_whole_models_and_the_clip_matches_a_plain_model(
    rank, world_size, device, strategy, use_orig_params, norm_type
):
    torch.manual_seed(0)
    local = Net().to(device)
    options = {"shard_group_size": 2} if strategy is ShardingStrategy.HYBRID_SHARD else {}
    model = engine.fully_shard(
        copy.deepcopy(local), auto_wrap_classes={Block}, strategy=strategy, use_orig_params=use_orig_params, **options
    )
    make_optim = functools.partial(torch.optim.SGD, lr=0.5)
    local_optim = make_optim(local.parameters())
    optim = engine.ShardedOptimizer(model, make_optim)
    batch = torch.randn(world_size, 4, 10, generator=torch.Generator().manual_seed(1234)).to(device)
    (local(batch.view(-1, 10)).sum() / world_size).backward()
    model(batch[rank]).sum().backward()

    expected = torch.nn.utils.clip_grad_norm_(local.parameters(), 0.1, norm_type=norm_type)
    norm = engine.clip_grad_norm_(model, 0.1, norm_type=norm_type)
    assert expected > 0.2, "the clip must act for the test to mean anything"
    torch.testing.assert_close(norm, expected.to(norm.dtype), rtol=1e-5, atol=0.0)
    everyone = [torch.zeros_like(norm) for _ in range(world_size)]
    torch.distributed.all_gather(everyone, norm)
    assert all(torch.equal(other, norm) for other in everyone), f"ranks returned different norms: {everyone}"

    with engine.unshard_params(model, with_grads=True):
        for name, param in model.named_parameters():
            wanted = dict(local.named_parameters())[name].grad
            torch.testing.assert_close(param.grad, wanted, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    local_optim.step()
    optim.step()
    with engine.unshard_params(model):
        for name, param in model.named_parameters():
            wanted = dict(local.named_parameters())[name]
            torch.testing.assert_close(param, wanted, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.world_size(1)
def test_a_norm_type_that_is_not_positive_is_refused(device):
    model = engine.fully_shard(Net().to(device))
    with pytest.raises(ValueError, match=r"norm_type must be positive or math\.inf, got 0\.0"):
        engine.clip_grad_norm_(model, 1.0, norm_type=0)
