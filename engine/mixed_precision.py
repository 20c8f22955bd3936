"""Mixed precision: low-precision compute over full-precision master shards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map


@dataclass(frozen=True)
class MixedPrecision:
    """Compute in `param_dtype`; master shards and reduced gradients stay in full precision.

    Floating-point forward inputs of every unit are cast to `param_dtype` so that a unit's
    low-precision parameters meet inputs of the same dtype.
    """

    param_dtype: torch.dtype | None = None


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor in a pytree to `dtype`."""
    return tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree)
