"""User-facing configuration types shared by both APIs."""
from __future__ import annotations

import enum


class ShardingStrategy(enum.Enum):
    """How a unit's parameters are laid out across ranks between uses."""

    FULL_SHARD = "full_shard"  # sharded; freed after forward and after backward
    SHARD_GRAD_OP = "shard_grad_op"  # sharded; kept gathered from forward until backward ends
    NO_SHARD = "no_shard"  # replicated; gradients all-reduced (DDP-like)
    HYBRID_SHARD = "hybrid_shard"  # FULL_SHARD inside a shard group, replicated across groups


class StateDictKind(enum.Enum):
    """Which form `module.state_dict()` returns for sharded modules."""

    FULL = "full"
    SHARDED = "sharded"
