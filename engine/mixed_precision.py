"""Mixed precision: low-precision compute over full-precision master shards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map


@dataclass(frozen=True)
class MixedPrecision:
    """Compute in `param_dtype`; reduce gradients in `reduce_dtype`; master shards and the stored
    (reduced, averaged) gradients stay in the parameters' full precision.

    Floating-point forward inputs of every unit are cast to `param_dtype` so that a unit's
    low-precision parameters meet inputs of the same dtype.  `reduce_dtype` None reduces the
    gradients in `param_dtype` (what torch FSDP does by default: half the bytes on the wire, at
    the price of a low-precision sum); e.g. ``torch.float32`` upcasts each unit's gradient before
    its reduction.  Either way the reduced sum is upcast to the master dtype before it is averaged
    and added to the stored gradients, which the optimizer then applies to the fp32 master.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor in a pytree to `dtype`."""
    return tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree)
