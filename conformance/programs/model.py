"""The generated model: a stack of square blocks between an input and an output linear.

Deterministic in everything (its initial values come from the program's seed), so the ranks and
the oracle build the same model. Its forward depends on the module's mode (``eval()`` halves each
block's output), so a backend that ignores ``eval()`` computes wrong eval losses, and on the
route (blocks 0 and 1 may swap places), so a forward-order check has something to see. A
checkpointed shape calls its blocks through ``torch.utils.checkpoint`` (non-reentrant), so
backward recomputes each block's forward, hooks included.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from conformance.programs.program import ModelShape


class Block(nn.Module):
    """``tanh(linear(x))``, times ``scale`` (a buffer) when the shape has buffers, halved in eval mode."""

    def __init__(self, width: int, buffers: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        if buffers:
            self.register_buffer("scale", torch.ones(width))
        else:
            self.scale = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.linear(x))
        if self.scale is not None:
            y = y * self.scale.to(y.dtype)
        return y if self.training else y * 0.5


class GeneratedModel(nn.Module):
    BATCH_DIM = 0

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.shape = shape
        self.inp = nn.Linear(shape.in_width, shape.width)
        self.blocks = nn.ModuleList([Block(shape.width, shape.buffers) for _ in range(shape.depth)])
        self.out = nn.Linear(shape.width, shape.out_width)
        self.swapped = False
        for index in shape.frozen:
            self.blocks[index].linear.requires_grad_(False)
        if shape.tied:
            self.blocks[1].linear.weight = self.blocks[0].linear.weight

    def route(self) -> list[int]:
        order = list(range(len(self.blocks)))
        if self.swapped and len(order) >= 2:
            order[0], order[1] = order[1], order[0]
        return order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for index in self.route():
            block = self.blocks[index]
            h = checkpoint(block, h, use_reentrant=False) if self.shape.checkpointed else block(h)
        return self.out(h)

    def example_input(self, generator: torch.Generator, batch_size: int) -> tuple[torch.Tensor]:
        return (torch.randn(batch_size, self.shape.in_width, generator=generator),)

    @staticmethod
    def loss(output: torch.Tensor) -> torch.Tensor:
        # The sum, in the output's dtype, as the scenarios' models have it (fixtures.models): the
        # per-dtype bounds of conformance.programs.tolerances were measured with this loss, and
        # a low-precision loss is what a backend computing in low precision hands to backward.
        return output.sum()


def build_model(shape: ModelShape, seed: int, device: torch.device) -> GeneratedModel:
    """The model of ``shape`` with values drawn from ``seed`` (buffers not all ones: a buffer
    lost in a state dict round trip shows); on the meta device, the model without values."""
    if device.type == "meta":  # built without storage or values (a deferred-init program)
        with torch.device("meta"):
            return GeneratedModel(shape)
    generator = torch.Generator().manual_seed(seed)
    with torch.device("cpu"):
        model = GeneratedModel(shape)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
        for buffer in model.buffers():
            buffer.copy_(torch.rand(buffer.shape, generator=generator) + 0.5)
    return model.to(device)
