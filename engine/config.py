"""User-facing configuration types shared by both APIs (`fully_shard` and `ShardedModule`)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from engine.mixed_precision import MixedPrecision


class ShardingStrategy(enum.Enum):
    """How a unit's parameters are laid out across ranks between uses."""

    FULL_SHARD = "full_shard"  # sharded; freed after forward and after backward
    SHARD_GRAD_OP = "shard_grad_op"  # sharded; kept gathered from forward until backward ends
    NO_SHARD = "no_shard"  # replicated; gradients all-reduced (DDP-like)
    HYBRID_SHARD = "hybrid_shard"  # FULL_SHARD inside a shard group, replicated across groups
    # ZeRO-1: parameters and gradients replicated (gradients all-reduced, as NO_SHARD); only the
    # optimizer state is partitioned, by `engine.ShardedOptimizer` (FULL_SHARD's chunk layout).
    SHARD_OPTIM_STATE = "shard_optim_state"
    # ZeRO-2: parameters replicated as ZeRO-1; each unit's gradient is reduce-scattered so that a
    # rank stores only its partition of it (the one its optimizer steps, FULL_SHARD's chunk
    # layout), and the optimizer state is partitioned the same way (`engine.ShardedOptimizer`).
    SHARD_GRAD_AND_OPTIM_STATE = "shard_grad_and_optim_state"

    @property
    def partitions_optimizer_state(self) -> bool:
        """Parameters whole on every rank, optimizer state partitioned (ZeRO-1 and ZeRO-2)."""
        return self in (ShardingStrategy.SHARD_OPTIM_STATE, ShardingStrategy.SHARD_GRAD_AND_OPTIM_STATE)


class StateDictKind(enum.Enum):
    """Which form `module.state_dict()` returns for sharded modules."""

    FULL = "full"
    SHARDED = "sharded"


@dataclass(frozen=True)
class StateDictSettings:
    """What `module.state_dict()` returns for one root's units (`engine.set_state_dict_type`).

    Owned by `state_dict.py`: it alone replaces a root's settings and reads them; they travel to
    the units in their `UnitContext` (`unit.py`), so reading them never reaches up to the root.
    """

    kind: StateDictKind = StateDictKind.FULL
    rank0_only: bool = False  # FULL only: other ranks' state dicts leave the unit's parameters out
    offload_to_cpu: bool = False  # FULL only: copy the gathered tensors to CPU


@dataclass(frozen=True)
class ShardingOptions:
    """Every option of `fully_shard` / `ShardedModule` besides the module itself.

    Pass an instance positionally, keywords, or both (keywords override the instance's fields):
    ``fully_shard(model, ShardingOptions(strategy=...), device=...)``.

    * ``strategy``: see :class:`ShardingStrategy`.
    * ``auto_wrap_classes``: submodules of these classes (innermost first) become their own units.
    * ``ignored_modules``: submodules whose parameters stay plain and unsynchronised.
    * ``mixed_precision``: compute dtype and gradient reduction dtype; master shards and stored
      gradients stay in full precision.
    * ``offload_params``: shards and their gradients live on CPU; compute runs on ``device``.
    * ``use_orig_params``: True exposes one ``nn.Parameter`` per original parameter (a view of
      this rank's piece of the flat shard); False exposes one flat parameter per unit, registered
      as ``_flat_param`` on the unit's module (the wrapped module for the wrapper form), with the
      original parameters as plain tensor views of the unsharded flat buffer (torch FSDP1's
      ``use_orig_params=False``).
    * ``mesh`` / ``process_group`` / ``shard_group_size``: which ranks shard and which replicate
      (HYBRID_SHARD: a 2-D ``(replicate, shard)`` mesh or the shard group size).
    * ``device``: compute device (default: where the parameters are).
    * ``check_exec_order``: validate the forward unit order (first iteration across ranks, later
      iterations against the first).
    * ``forward_prefetch``: during a unit's forward, all-gather the unit that ran next in the
      first training forward. For static graphs only: a rank whose forward later takes another
      path issues an all-gather its peers do not, and the ranks' collectives stop pairing up.
    * ``backward_prefetch``: during a unit's backward, all-gather the unit that ran before it in
      this iteration's forward (what backward needs next). Safe with dynamic graphs: it follows
      the order each rank actually ran.

    Options that describe the whole model (``check_exec_order``, ``forward_prefetch``,
    ``backward_prefetch``) are taken from the outermost application (the root).
    """

    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    auto_wrap_classes: tuple[type, ...] = ()
    ignored_modules: tuple[nn.Module, ...] = ()
    mixed_precision: MixedPrecision | None = None
    offload_params: bool = False
    use_orig_params: bool = True
    mesh: DeviceMesh | None = None
    process_group: dist.ProcessGroup | None = None
    shard_group_size: int | None = None
    device: torch.device | None = None
    check_exec_order: bool = True
    forward_prefetch: bool = False
    backward_prefetch: bool = True

    def __post_init__(self) -> None:
        # Normalise what callers naturally pass (None, sets, lists, "cuda:0") once, here.
        if not isinstance(self.strategy, ShardingStrategy):
            raise TypeError(
                f"strategy must be an engine.ShardingStrategy, got {self.strategy!r}; "
                "e.g. strategy=engine.ShardingStrategy.FULL_SHARD"
            )
        object.__setattr__(self, "auto_wrap_classes", tuple(self.auto_wrap_classes or ()))
        object.__setattr__(self, "ignored_modules", tuple(self.ignored_modules or ()))
        if self.device is not None:
            object.__setattr__(self, "device", torch.device(self.device))

    @property
    def param_dtype(self) -> torch.dtype | None:
        return self.mixed_precision.param_dtype if self.mixed_precision is not None else None

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        return self.mixed_precision.reduce_dtype if self.mixed_precision is not None else None


_OPTION_NAMES = tuple(field.name for field in dataclasses.fields(ShardingOptions))


def resolve_options(options: ShardingOptions | None, overrides: Mapping[str, Any]) -> ShardingOptions:
    """`options` (default: all defaults) with the keyword `overrides` applied."""
    if options is not None and not isinstance(options, ShardingOptions):
        raise TypeError(
            f"the second positional argument must be an engine.ShardingOptions, got "
            f"{type(options).__name__}; pass other options as keywords"
        )
    unknown = sorted(set(overrides) - set(_OPTION_NAMES))
    if unknown:
        raise TypeError(f"unknown engine option(s) {', '.join(unknown)}; valid options: {', '.join(_OPTION_NAMES)}")
    base = options if options is not None else ShardingOptions()
    return dataclasses.replace(base, **overrides) if overrides else base
