"""Gradient accumulation without synchronisation: `no_sync` and `set_gradient_sync`.

Each root's `UnitContext.sync_gradients` says whether backward reduces its units' gradients.
While it is off, a unit whose gradient is complete keeps it unreduced and unsharded on its flat
leaf (`ShardedUnit.flat_leaf.grad`) and autograd adds the next backward's gradient into it; the
first backward with sync on reduces the accumulated sum, once, into the stored gradients. So k
micro-batches give the same stored gradients with or without the switch (the sum of the k
averaged gradients), and only the last one pays for communication.

Only this module switches the flag; `unit.py` reads it through the unit's context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.nn as nn

from engine.state import RootState, resolve_root, root_of


def _roots(module: nn.Module) -> list[RootState]:
    """The root states of `module` and of every sharded root below it (the one it belongs to,
    when it is a unit or a submodule inside one)."""
    roots = {id(r): r for r in (root_of(m) for m in module.modules()) if r is not None}
    if not roots:
        root = resolve_root(module)
        roots = {id(root): root}
    return list(roots.values())


def set_gradient_sync(module: nn.Module, enabled: bool) -> None:
    """Turn gradient reduction in backward on or off for every sharded root in `module`.

    Off: backward accumulates each rank's local gradients unreduced (unsharded, in the compute
    dtype: memory of a full gradient per unit); the first backward after turning it on reduces
    the accumulated sum.  Every rank must run the same backwards with the same setting.
    """
    for root in _roots(module):
        if root.in_compute():
            raise RuntimeError(
                "gradient sync cannot be switched during forward/backward: switch it before the "
                "forward of the micro-batch it applies to, or after its backward"
            )
        root.context.sync_gradients = enabled


@contextlib.contextmanager
def no_sync(module: nn.Module) -> Iterator[None]:
    """Backwards inside the block accumulate local gradients without reducing them (torch FSDP1's
    ``no_sync``); the first backward after the block reduces everything accumulated."""
    previous = {id(root): root.context.sync_gradients for root in _roots(module)}
    set_gradient_sync(module, False)
    try:
        yield
    finally:
        for root in _roots(module):
            root.context.sync_gradients = previous.get(id(root), True)
