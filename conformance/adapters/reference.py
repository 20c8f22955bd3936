"""Adapter for the in-repo reference engine (`engine/`): wrapper and composable forms.

The reference declares every capability: it is the suite's yardstick.  `use_orig_params=False`
maps onto the engine's flat-parameter mode (one `_flat_param` per unit, as torch FSDP1).
SHARD_OPTIM_STATE maps onto the engine's ZeRO-1 strategy: parameters and gradients stay whole on
every rank (what `local_shard` / `local_grad_shard` report, through the protocol's defaults), and
`make_optimizer` builds an `engine.ShardedOptimizer`, which keeps optimizer state only for this
rank's partition.  SHARD_GRAD_AND_OPTIM_STATE maps onto the engine's ZeRO-2 strategy: parameters
whole, each unit's gradient reduce-scattered so that a rank stores only the piece its optimizer
partition steps (stored as that partition's gradient: the replicated parameters carry none).

Storage introspection therefore reads, per parameter of the sharded model: `local_shard` the
parameter itself (the protocol's default); `local_grad_shard` its gradient, or for a ZeRO-2 unit
its piece of this rank's gradient partition; `local_optim_state` the optimizer's state for it, or
for a ZeRO-1 / ZeRO-2 unit the state of its piece of this rank's partition (empty where this rank
owns none of it).  `reduce_dtype` maps onto `engine.MixedPrecision.reduce_dtype` and
`no_gradient_sync` onto `engine.no_sync`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn

import engine
import engine.collectives
import engine.params
from conformance.adapters._common import dcp_load, dcp_save
from conformance.protocol import (
    ApiForm,
    BackendAdapter,
    Capability,
    Misuse,
    OptimizerFactory,
    ParameterGroups,
    Refusal,
    ShardEvent,
    ShardingSpec,
    ShardingStrategy,
    StateDictKind,
    UnshardRequest,
    innermost_first,
    strip_path_components,
    submodule,
)
from engine.unit import ShardedUnit

_WRAPPER_COMPONENTS = frozenset({"_sharded_wrapped_module"})  # engine.ShardedModule's child
_STRATEGIES = {
    ShardingStrategy.FULL_SHARD: engine.ShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP: engine.ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.NO_SHARD: engine.ShardingStrategy.NO_SHARD,
    ShardingStrategy.HYBRID_SHARD: engine.ShardingStrategy.HYBRID_SHARD,
    ShardingStrategy.SHARD_OPTIM_STATE: engine.ShardingStrategy.SHARD_OPTIM_STATE,
    ShardingStrategy.SHARD_GRAD_AND_OPTIM_STATE: engine.ShardingStrategy.SHARD_GRAD_AND_OPTIM_STATE,
}
_KINDS = {StateDictKind.FULL: engine.StateDictKind.FULL, StateDictKind.SHARDED: engine.StateDictKind.SHARDED}


def _clean(fqn: str) -> str:
    return strip_path_components(fqn, _WRAPPER_COMPONENTS)


class ReferenceAdapter(BackendAdapter):
    PROTOCOL_VERSION = 9  # the protocol version this adapter was written for
    name = "reference"
    CAPABILITIES = frozenset(Capability)
    # The engine's ZeRO partitions flat local pieces of whole parameters; a tensor-parallel
    # parameter's local value is already a shard of the tp dimension, and engine.fully_shard
    # refuses it (NotImplementedError, engine/api.py): found by a generated 2-D program.
    UNSUPPORTED_COMBINATIONS = {
        frozenset({Capability.TENSOR_PARALLEL, strategy}): (
            f"the engine's {strategy.name} does not partition tensor-parallel parameters (engine.fully_shard "
            "raises NotImplementedError): shard the data-parallel dimension with FULL_SHARD, SHARD_GRAD_OP or NO_SHARD"
        )
        for strategy in (Capability.SHARD_OPTIM_STATE, Capability.SHARD_GRAD_AND_OPTIM_STATE)
    }
    WRAPPER_COMPONENTS = _WRAPPER_COMPONENTS
    # The engine's own lines (its gathers, its reduce-scatters) are never the user's: collectives
    # it issues are attributed to the scenario line that called into it.
    BACKEND_MODULES = ("engine",)
    FLAT_PARAMETER_NAME = engine.params.FLAT_PARAM_NAME
    NON_TP_2D_STATE_DICT_MESH = "dp"  # engine/state_dict.py; proven in test_declared_facts.py
    # The engine's own refusals (engine/unshard.py, engine/topology.py): a call in the wrong state
    # is Python's RuntimeError where FSDP1 raises AssertionError; the unsupported unshard options
    # are the seeds' NotImplementedError. Proven in tests/conformance_tests/test_declared_facts.py.
    REFUSALS = {
        Misuse.UNSHARD_DURING_FORWARD: Refusal(
            (RuntimeError,), "Cannot manually unshard parameters during forward/backward"
        ),
        Misuse.UNSHARD_DURING_BACKWARD: Refusal(
            (RuntimeError,), "Cannot manually unshard parameters during forward/backward"
        ),
        Misuse.UNSHARD_RANK0_ONLY_WITH_WRITEBACK: Refusal(
            (NotImplementedError,), r"rank0_only=True with writeback=True is not supported"
        ),
        Misuse.UNSHARD_OFFLOAD_TO_CPU_NO_SHARD: Refusal(
            (NotImplementedError,), r"offload_to_cpu=True with NO_SHARD .* is not supported"
        ),
        # The engine's own check, or (torch < 2.7, whose parallelize_module still checks first)
        # torch's refusal, the seed's text.
        Misuse.TENSOR_PARALLEL_OUTER_MESH_DIM: Refusal(
            (RuntimeError,),
            r"is tensor-parallel \(TP\) over mesh dimension .*; TP must be the innermost"
            r"|Found TP device_mesh on the \d dimension of its parent mesh",
        ),
    }

    # -- collective labels (the engine publishes the FQNs of the unit it is gathering) ---------
    def collective_label(self) -> str | None:
        return engine.collectives.current_label()

    # -- training loop: ZeRO-1 / ZeRO-2 units need the partitioning optimizer ----------------
    def make_optimizer(self, model: nn.Module, factory: OptimizerFactory) -> Any:
        if engine.partitions_optimizer_state(model):
            return engine.ShardedOptimizer(model, factory)
        return factory(model.parameters())

    def make_optimizer_with_groups(self, model: nn.Module, factory: OptimizerFactory, groups: ParameterGroups) -> Any:
        # The groups over the exposed parameters; ShardedOptimizer puts each one's partition
        # into its group (ZeRO-1/2), as a torch optimizer would hold the parameter itself.
        named = [(self.original_fqn(name), param) for name, param in model.named_parameters()]
        if engine.partitions_optimizer_state(model):
            return engine.ShardedOptimizer(model, factory, params=groups.split(named))
        return factory(groups.split(named))

    def clip_grad_norm(self, model: nn.Module, optimizer: Any, max_norm: float) -> torch.Tensor:
        return engine.clip_grad_norm_(model, max_norm)

    # -- applying sharding ----------------------------------------------------------------
    def _shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
        ignored = [submodule(model, fqn) for fqn in spec.ignored_modules]
        for fqn in innermost_first(spec.manual_units):
            unit = submodule(model, fqn)
            options = self._options(spec, fqn, unit, ignored)
            if form is ApiForm.WRAPPER:
                parent_fqn, _, attr = fqn.rpartition(".")
                setattr(submodule(model, parent_fqn), attr, engine.ShardedModule(unit, **options))
            else:
                engine.fully_shard(unit, **options)
        if not spec.shard_root:
            return model
        options = self._options(spec, "", model, ignored)
        if spec.auto_wrap_classes:
            options["auto_wrap_classes"] = spec.auto_wrap_classes
        if form is ApiForm.WRAPPER:
            return engine.ShardedModule(model, **options)
        return engine.fully_shard(model, **options)

    def _options(self, spec: ShardingSpec, unit: str, module: nn.Module, ignored: list[nn.Module]) -> dict[str, Any]:
        inside = {id(m) for m in module.modules()}
        owned = [m for m in ignored if id(m) in inside]  # each unit is told only of its own
        return {
            "strategy": _STRATEGIES[spec.strategy_for(unit)],
            "mesh": spec.mesh,
            "mixed_precision": (
                engine.MixedPrecision(param_dtype=spec.param_dtype, reduce_dtype=spec.reduce_dtype)
                if spec.param_dtype
                else None
            ),
            "offload_params": spec.offload_params,
            "ignored_modules": owned or None,
            "use_orig_params": spec.use_orig_params,
            "device": self.env.device,
        }

    # -- storage: ZeRO-2 gradients and ZeRO-1/2 optimizer state live in the partition ----------
    def local_grad_shard(self, model: nn.Module, fqn: str) -> torch.Tensor | None:
        located = _partition_piece(model, self.named_parameter(model, fqn))
        if located is None or not located[0].partitions_grads:
            return super().local_grad_shard(model, fqn)
        grad = located[1].grad
        return None if grad is None else grad.detach().clone()

    def set_local_grad_shard(self, model: nn.Module, fqn: str, value: torch.Tensor) -> None:
        located = _partition_piece(model, self.named_parameter(model, fqn))
        if located is None or not located[0].partitions_grads:
            super().set_local_grad_shard(model, fqn, value)
            return
        grad = located[1].grad
        if grad is None:
            raise ValueError(f"{fqn}: this rank stores no gradient to overwrite (run a backward first)")
        if value.shape != grad.shape:
            raise ValueError(
                f"{fqn} gradient: this rank stores shape {tuple(grad.shape)}, got a value of shape "
                f"{tuple(value.shape)} (write what local_grad_shard returned, modified)"
            )
        with torch.no_grad():
            grad.copy_(value)

    def local_optim_state(self, model: nn.Module, optimizer: Any, fqn: str) -> dict[str, torch.Tensor]:
        located = _partition_piece(model, self.named_parameter(model, fqn))
        if located is None or located[1] not in optimizer.state:
            # Another strategy, or a plain optimizer over the replicated parameters.
            return super().local_optim_state(model, optimizer, fqn)
        piece = located[1]
        if piece.numel() == 0:  # this rank's partition holds none of the parameter
            return {}
        return {
            name: value.detach().clone()
            for name, value in optimizer.state[piece].items()
            if isinstance(value, torch.Tensor) and value.dim() > 0
        }

    # -- gradient accumulation ------------------------------------------------------------
    def no_gradient_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return engine.no_sync(model)

    # -- unshard ------------------------------------------------------------------------
    def _unshard(self, model: nn.Module, request: UnshardRequest) -> contextlib.AbstractContextManager[None]:
        return engine.unshard_params(
            _module_at(model, request.fqn),
            recurse=request.recurse,
            writeback=request.writeback,
            rank0_only=request.rank0_only,
            offload_to_cpu=request.offload_to_cpu,
            with_grads=request.with_grads,
        )

    # -- state dicts ----------------------------------------------------------------------
    def _state_dict(self, model: nn.Module, kind: StateDictKind) -> dict[str, Any]:
        engine.set_state_dict_type(model, _KINDS[kind])
        return model.state_dict()  # raw: the engine keys it by original FQNs itself

    def _load_state_dict(self, model: nn.Module, state_dict: Mapping[str, Any], kind: StateDictKind) -> None:
        engine.set_state_dict_type(model, _KINDS[kind])
        model.load_state_dict(dict(state_dict))

    def _optim_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, kind: StateDictKind) -> dict[str, Any]:
        return engine.optim_state_dict(model, optim, sharded=kind is StateDictKind.SHARDED)

    def _load_optim_state_dict(
        self, model: nn.Module, optim: torch.optim.Optimizer, state_dict: Mapping[str, Any], kind: StateDictKind
    ) -> None:
        engine.load_optim_state_dict(model, optim, dict(state_dict))

    # -- native checkpoint: torch.distributed.checkpoint over the DTensor state dicts ----------
    def _save_checkpoint(self, model: nn.Module, optim: torch.optim.Optimizer, directory: str) -> None:
        dcp_save(self, model, optim, directory)

    def _load_checkpoint(self, model: nn.Module, optim: torch.optim.Optimizer, directory: str) -> None:
        dcp_load(self, model, optim, directory)

    # -- introspection --------------------------------------------------------------------
    def is_unsharded(self, model: nn.Module, unit: str) -> bool:
        return engine.is_unsharded(_module_at(model, unit))

    def unsharded_storage_numel(self, model: nn.Module, unit: str) -> int:
        units = {
            _join(prefix, _clean(found.module_fqn)): found
            for prefix, root in _sharded_roots(model)
            for found in engine.units(root)
        }
        if unit not in units:
            raise ValueError(f"{unit!r} is not a unit; units are {sorted(units)}")
        sharded_unit = units[unit]
        if sharded_unit.topology.shard_group is None:
            raise ValueError(f"unit {unit!r} is not sharded: it has no unsharded buffer to free")
        total = sharded_unit.unsharded_storage_numel
        # The unshard context may show a buffer of its own (full precision under mixed
        # precision, a CPU copy with offload_to_cpu): count it too.
        _state, shown = sharded_unit.exposure.snapshot()
        own = sharded_unit._full.untyped_storage().data_ptr()
        extra = {t.untyped_storage().data_ptr(): t for t in shown if t.untyped_storage().data_ptr() != own}
        if sharded_unit.shown_by_unshard:
            total += sum(t.untyped_storage().nbytes() // t.element_size() for t in extra.values())
        return total

    def unit_fqns(self, model: nn.Module) -> dict[str, list[str]]:
        units = {}
        for prefix, root in _sharded_roots(model):
            for unit, params in engine.unit_fqns(root):
                units[_join(prefix, _clean(unit))] = [_join(prefix, _clean(p)) for p in params]
        return units

    @contextlib.contextmanager
    def record_events(self, model: nn.Module) -> Iterator[list[ShardEvent]]:
        engine.clear_events(model)
        recorded: list[ShardEvent] = []
        try:
            yield recorded
        finally:
            recorded.extend(ShardEvent(kind, _clean(unit)) for kind, unit in engine.events(model))


def _sharded_roots(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(original FQN, module) of each outermost module the engine shards: ``model`` itself, or,
    under a plain root (``shard_root=False``), each top-level sharded submodule."""
    roots: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name == found or name.startswith(f"{found}.") for found, _ in roots if found):
            continue
        try:
            engine.unit_fqns(module)
        except ValueError:  # not managed by the engine: a plain module above the units
            continue
        roots.append((name, module))
        if not name:
            break  # the model itself is the root
    return [(_clean(name), module) for name, module in roots]


def _partition_piece(model: nn.Module, param: torch.Tensor) -> tuple[ShardedUnit, nn.Parameter] | None:
    """For a parameter a ZeRO-1 / ZeRO-2 unit exposes: (the unit, the parameter of this rank's
    optimizer partition standing for it: its piece, or for a flat parameter the whole chunk).
    None for every other parameter."""
    for _prefix, root in _sharded_roots(model):
        for unit in engine.units(root):
            partition = unit.optim_partition
            if partition is None:
                continue
            for index, exposed in enumerate(unit.optimizer_params):
                if exposed is param:
                    return unit, partition.params[index]
    return None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _module_at(model: nn.Module, fqn: str) -> nn.Module:
    """The module at original FQN `fqn`: its wrapper when it has one (named_modules lists it first)."""
    for name, module in model.named_modules():
        if _clean(name) == fqn:
            return module
    return submodule(model, fqn)  # raises with the list of names
