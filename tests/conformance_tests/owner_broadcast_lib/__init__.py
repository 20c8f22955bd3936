"""owner_broadcast_lib: a tiny data-parallel library whose ranks reach one collective by different paths.

``replicate_from_owner(module, owner)`` starts every rank from the owner's parameters, as a
backend does when it builds its engine: the owner sends each parameter (:func:`_send`), every
other rank receives it (:func:`_receive`). Both are the same broadcast (same tensor, shape, dtype,
group and source), issued from two different lines of this library: a rank-dependent code path
inside a backend, like a partition owner's, which is never a divergence of the user's code. The
conformance trace must name the line that called into the library, the same on every rank, where
the adapter declares this package in ``BACKEND_MODULES``
(tests/conformance_tests/test_backend_divergence.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn


def replicate_from_owner(module: nn.Module, owner: int = 0) -> nn.Module:
    """Give every rank the owner's parameters, in place; returns ``module``."""
    for param in module.parameters():
        if dist.get_rank() == owner:
            _send(param.data, owner)
        else:
            _receive(param.data, owner)
    return module


def _send(tensor: torch.Tensor, owner: int) -> None:
    dist.broadcast(tensor, src=owner)  # the owner's path


def _receive(tensor: torch.Tensor, owner: int) -> None:
    dist.broadcast(tensor, src=owner)  # every other rank's path: another line, the same collective
