"""Reference flat-parameter sharding engine (FSDP-style) for the conformance suite.

Public API (see README.md): `fully_shard`, `ShardedModule`, `ShardingOptions`, `unshard_params`,
`ShardedOptimizer` (SHARD_OPTIM_STATE, SHARD_GRAD_AND_OPTIM_STATE), `ShardingStrategy`,
`MixedPrecision`, `StateDictKind`, `set_state_dict_type`, `optim_state_dict`,
`load_optim_state_dict`, `clip_grad_norm_` (one total norm over ranks), `no_sync` /
`set_gradient_sync` (gradient accumulation), introspection helpers and
`collectives.current_label`.
"""

from engine import collectives
from engine.api import ShardedModule, fully_shard
from engine.clip import clip_grad_norm_
from engine.config import ShardingOptions, ShardingStrategy, StateDictKind
from engine.grad_sync import no_sync, set_gradient_sync
from engine.introspect import clear_events, events, is_unsharded, partitions_optimizer_state, unit_fqns, units
from engine.mixed_precision import MixedPrecision
from engine.optim_state import load_optim_state_dict, optim_state_dict
from engine.state_dict import set_state_dict_type
from engine.unshard import unshard_params
from engine.zero import ShardedOptimizer

__all__ = [
    "MixedPrecision",
    "ShardedModule",
    "ShardedOptimizer",
    "ShardingOptions",
    "ShardingStrategy",
    "StateDictKind",
    "clear_events",
    "clip_grad_norm_",
    "collectives",
    "events",
    "fully_shard",
    "is_unsharded",
    "load_optim_state_dict",
    "no_sync",
    "optim_state_dict",
    "partitions_optimizer_state",
    "set_gradient_sync",
    "set_state_dict_type",
    "unit_fqns",
    "units",
    "unshard_params",
]
