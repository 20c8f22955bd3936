"""Ordinary data-parallel bugs, written as a user writes them in a harness test: each bug beside its fix.

Not collected here: tests/harness_tests/test_divergence_real_bugs.py runs it in an inner session.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def _ddp_model():
    torch.manual_seed(0)
    return DDP(nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 4)))


def _train_until_converged(rank, agree):
    model = _ddp_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(rank)
    scale = 0.1 if rank == 0 else 1.0  # rank 0's shard of the data is easier
    for step in range(4):
        loss = model(torch.randn(4, 10) * scale).square().mean()
        converged = torch.tensor(float(loss.item() < 0.03))
        if agree:  # the fix: every rank stops when any has converged
            dist.all_reduce(converged, op=dist.ReduceOp.MAX)
        if step >= 1 and converged.item():
            break
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.world_size(2)
def test_ddp_early_stop(rank):
    _train_until_converged(rank, agree=False)


@pytest.mark.world_size(2)
def test_ddp_early_stop_fixed(rank):
    _train_until_converged(rank, agree=True)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head, self.aux = nn.Linear(10, 16), nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x, with_aux):
        h = self.body(x).relu()
        return self.head(h) + self.aux(h) if with_aux else self.head(h)


def _train_two_heads(rank, find_unused):
    torch.manual_seed(0)
    model = DDP(TwoHeads(), find_unused_parameters=find_unused)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        with_aux = not (rank == 1 and step == 1)  # rank 1 skips the auxiliary head once
        model(torch.randn(4, 10), with_aux=with_aux).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.world_size(2)
def test_ddp_unused_parameter(rank):
    _train_two_heads(rank, find_unused=False)


@pytest.mark.world_size(2)
def test_ddp_unused_parameter_fixed(rank):
    _train_two_heads(rank, find_unused=True)


def _train_with_metric(rank, everywhere):
    model = _ddp_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = model(torch.randn(4, 10)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if everywhere or rank == 0:  # the bug: only rank 0 logs, and the log all-reduces
            metric = torch.tensor([loss.item(), 1.0, 2.0, 3.0])
            dist.all_reduce(metric)


@pytest.mark.world_size(2)
def test_metric_all_reduced_on_rank_0_only(rank):
    _train_with_metric(rank, everywhere=False)


@pytest.mark.world_size(2)
def test_metric_all_reduced_on_rank_0_only_fixed(rank):
    _train_with_metric(rank, everywhere=True)


def _train_fsdp2(rank, clip_everywhere):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        if clip_everywhere or rank == 0:  # the bug: clipping where only rank 0 logs the norm
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.world_size(2)
def test_clip_on_one_rank_under_fsdp2(rank):
    _train_fsdp2(rank, clip_everywhere=False)


@pytest.mark.world_size(2)
def test_clip_on_one_rank_under_fsdp2_fixed(rank):
    _train_fsdp2(rank, clip_everywhere=True)
