"""How far a generated program's sharded run may be from the oracle, per compute dtype.

The bounds of ``conformance/test_training_numerics.py`` (measured there on every shipped
backend: the reduction-order and rounding noise a correct backend adds), applied to the generated
model, with the same loss (the sum of the output) and learning rate, and smaller widths, so no
more rounding noise. Campaigns on the clean shipped
backends (``docs/findings.md``) are the measurement that they hold on generated programs; a
doubled, dropped or overwritten gradient lands far outside them (the family mutants of
``tests/conformance_tests/family_mutants.py``, caught by the generated tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fixtures.compare import Tolerance

CLIP_NORM_RTOL = 1e-5
"""The bound on a gradient norm a backend returns, relative to the oracle's, in float32 (the
fixed clipping scenario's; measured there within 3e-7 on every shipped backend)."""


@dataclass(frozen=True)
class Bounds:
    loss_rtol: float
    loss_atol: float
    params: Tolerance
    grads: Tolerance

    def losses_close(self, actual: float, expected: float) -> bool:
        return abs(actual - expected) <= self.loss_atol + self.loss_rtol * abs(expected)

    def norm_rtol(self, elements: int) -> float:
        """How far, relative to the oracle's, a gradient norm over ``elements`` gradient elements
        may be: each element within ``grads.scaled_atol`` x max|g| of the oracle's gives a norm
        within sqrt(elements) x that of it (the error's norm; max|g| <= |g|), and never tighter
        than the fixed clipping scenario's measured 1e-5. A norm over one rank's shards (the
        classic clipping bug) is off by at least 1 - 1/sqrt(2) on some rank of two."""
        return max(CLIP_NORM_RTOL, math.sqrt(max(elements, 1)) * self.grads.scaled_atol)


FULL_PRECISION = Bounds(
    loss_rtol=2e-6,
    loss_atol=5e-6,
    # Adam divides by the square root of a second moment that starts at zero: an entry whose
    # gradient is rounding noise around zero may move by the learning rate either way, so
    # parameters are compared at a few ulps of their values (entries of order 1), not at 1.2e-7.
    params=Tolerance(rtol=2e-6, atol=2e-7),
    grads=Tolerance(rtol=0.0, atol=1e-7, scaled_atol=2e-6),
)
MIXED_PRECISION = {
    "float16": Bounds(
        loss_rtol=2e-3,
        loss_atol=1.6e-2,
        params=Tolerance(rtol=0.0, atol=1.6e-5),
        grads=Tolerance(rtol=0.0, atol=0.0, scaled_atol=2e-3),
    ),
    "bfloat16": Bounds(
        loss_rtol=1.6e-2,
        loss_atol=0.25,
        params=Tolerance(rtol=0.0, atol=1.2e-4),
        grads=Tolerance(rtol=0.0, atol=0.0, scaled_atol=1.6e-2),
    ),
}


def bounds_for(param_dtype: str | None) -> Bounds:
    return FULL_PRECISION if param_dtype is None else MIXED_PRECISION[param_dtype]


def dtype_named(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)
