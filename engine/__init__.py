"""Reference flat-parameter sharding engine (FSDP-style) for the conformance suite.

Public API (see README.md): `fully_shard`, `ShardedModule`, `ShardingOptions`, `unshard_params`,
`ShardingStrategy`, `MixedPrecision`, `StateDictKind`, `set_state_dict_type`, `optim_state_dict`,
`load_optim_state_dict`, introspection helpers and `collectives.current_label`.
"""
from . import collectives
from .api import ShardedModule, fully_shard
from .config import ShardingOptions, ShardingStrategy, StateDictKind
from .mixed_precision import MixedPrecision
from .introspect import events, is_unsharded, unit_fqns, units, clear_events
from .optim_state import load_optim_state_dict, optim_state_dict
from .state_dict import set_state_dict_type
from .unshard import unshard_params

__all__ = [
    "MixedPrecision",
    "ShardedModule",
    "ShardingOptions",
    "ShardingStrategy",
    "StateDictKind",
    "clear_events",
    "collectives",
    "events",
    "fully_shard",
    "is_unsharded",
    "load_optim_state_dict",
    "optim_state_dict",
    "set_state_dict_type",
    "unit_fqns",
    "units",
    "unshard_params",
]
