"""Helpers for adapters: small functions every adapter needs and none should write again.

:func:`submodule` finds a unit by FQN with an error that lists what exists; :func:`innermost_first`
orders units for sharding identically on every rank; ``strip_path_components`` (the harness's,
re-exported here because an adapter never imports the harness) removes wrapper components from
a name.
"""

from __future__ import annotations

import torch.nn as nn

from harness import strip_path_components as strip_path_components  # re-exported for adapters


def submodule(model: nn.Module, fqn: str) -> nn.Module:
    """The submodule at ``fqn`` ("" = the model), with an error that lists what exists."""
    try:
        return model.get_submodule(fqn)
    except AttributeError:
        names = [n for n, _ in model.named_modules() if n]
        raise ValueError(f"no submodule {fqn!r}; the model has {names}") from None


def innermost_first(fqns: tuple[str, ...]) -> list[str]:
    """Order unit FQNs so a nested unit is sharded before the unit containing it.

    Stable and free of set ordering, so every rank shards (and issues collectives) in the
    same order.
    """
    return sorted(dict.fromkeys(fqns), key=lambda fqn: -(fqn.count(".") + 1) if fqn else 0)
