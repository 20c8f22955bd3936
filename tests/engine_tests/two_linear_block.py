"""What the ZeRO, root-only and gradient-accumulation engine tests share: the two-layer block they
shard as a unit, the two-block model of the ZeRO tests, and training a plain model on the global
batch alongside sharded copies on each rank's part of it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 10)
        self.out = nn.Linear(10, 10, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc(x)))


class Net(nn.Module):
    """Two blocks (units of their own) and a root parameter with an odd element count (uneven
    partitions, padding on the last rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.b1 = Block()
        self.b2 = Block()
        self.odd = nn.Parameter(torch.randn(10, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.b2(self.b1(x)) @ self.odd).sum(dim=-1)


def batches(world_size: int, device: torch.device, steps: int) -> Iterator[torch.Tensor]:
    """`steps` global batches of 4 rows per rank, the same on every rank (a fixed generator)."""
    generator = torch.Generator().manual_seed(1234)
    for _ in range(steps):
        yield torch.randn(world_size, 4, 10, generator=generator).to(device)


def train_alongside(
    local: nn.Module,
    local_optim: torch.optim.Optimizer,
    sharded: Sequence[tuple[nn.Module, torch.optim.Optimizer]],
    rank: int,
    world_size: int,
    device: torch.device,
    steps: int = 3,
    after_step: Callable[[int], None] | None = None,
) -> None:
    """Train `local` on the global batch and every (model, optimizer) of `sharded` on this rank's
    part of it, step by step; `after_step(step)` runs after each step."""
    for step, batch in enumerate(batches(world_size, device, steps)):
        local_optim.zero_grad()
        local(batch.view(-1, 10)).sum().div(world_size).backward()
        local_optim.step()
        for model, optim in sharded:
            optim.zero_grad()
            model(batch[rank]).sum().backward()
            optim.step()
        if after_step is not None:
            after_step(step)
