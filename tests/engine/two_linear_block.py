"""The two-layer block the ZeRO and gradient-accumulation engine tests shard as a unit."""

from __future__ import annotations

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 10)
        self.out = nn.Linear(10, 10, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc(x)))
