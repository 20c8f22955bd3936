"""Adapter for torch FSDP1: ``torch.distributed.fsdp.FullyShardedDataParallel`` (wrapper form).

Its composable form (``torch.distributed._composable.fully_shard``) no longer ships with
torch, so only the wrapper form is declared. Introspection reads FSDP1 internals
(``FlatParamHandle``); those capabilities are optional by design.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import (
    CPUOffload,
    FullStateDictConfig,
    MixedPrecision,
    ShardedStateDictConfig,
    StateDictType,
)
from torch.distributed.fsdp import (
    FullyShardedDataParallel as FSDP,
)
from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from conformance.adapters._common import (
    TorchAdapter,
    clean_fqn,
    parent_and_name,
    record_transitions,
)
from conformance.adapters._labels import current_label, label_calls
from conformance.protocol import (
    SEED_REFUSALS,
    ApiForm,
    Capability,
    DeferredInit,
    Misuse,
    Requirement,
    ShardEvent,
    ShardingSpec,
    ShardingStrategy,
    StateDictKind,
    UnshardRequest,
    innermost_first,
    submodule,
)

# summon_full_params(offload_to_cpu=True) on a CPU device frees the storage its views use on
# torch 2.6 and 2.13 (seen; tests/conformance_tests/test_declared_absences.py proves it where declared);
# torch 2.14.1 gives the right values.
OFFLOAD_TO_CPU_BROKEN_ON_CPU = tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 14)

# On a CPU device summon_full_params(offload_to_cpu=True) of a unit it gathers (every strategy
# but NO_SHARD) is broken (proven in tests/conformance_tests/test_declared_absences.py).
_OFFLOAD_BROKEN_REASON = (
    "on a CPU device summon_full_params(offload_to_cpu=True) 'copies' the full parameter to CPU "
    "in place, then frees that storage: the views it exposes point at freed memory (RuntimeError "
    "'setStorage: ... out of bounds', or SIGSEGV)"
)
_OFFLOAD_TO_CPU_ON_CPU: Mapping[frozenset[Requirement], str] = {
    frozenset({Capability.UNSHARD_OFFLOAD_TO_CPU, Capability.for_strategy(strategy)}): _OFFLOAD_BROKEN_REASON
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.HYBRID_SHARD)
}

_STRATEGIES = {
    ShardingStrategy.FULL_SHARD: TorchStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP: TorchStrategy.SHARD_GRAD_OP,
    ShardingStrategy.NO_SHARD: TorchStrategy.NO_SHARD,
    ShardingStrategy.HYBRID_SHARD: TorchStrategy.HYBRID_SHARD,
}

# FlatParamHandle -> FQN prefix of the module it shards, so labels are FQNs from the model root.
_HANDLE_PREFIXES: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def _handle_fqns(handle: Any) -> list[str]:
    prefix = _HANDLE_PREFIXES.get(handle, "")
    return [f"{prefix}.{name}" if prefix else name for name in handle.flat_param._fqns]


def _label_collectives() -> None:
    """Name the parameter FQNs behind FSDP1's all-gathers (handle.unshard) and reduce-scatters."""
    from torch.distributed.fsdp import _flat_param, _runtime_utils

    label_calls(_flat_param.FlatParamHandle, "unshard", lambda handle, *a, **k: _handle_fqns(handle))
    for name in ("_reduce_grad", "_reduce_grad_no_shard"):
        label_calls(_runtime_utils, name, lambda state, handle, *a, **k: _handle_fqns(handle))


def _state_dict_type(kind: StateDictKind) -> tuple[StateDictType, FullStateDictConfig | ShardedStateDictConfig]:
    """A fresh config per call: FSDP1 mutates it (a 2-D model sets `_use_dtensor`), and a shared
    instance would carry that into every later model's state dict."""
    if kind is StateDictKind.FULL:
        return StateDictType.FULL_STATE_DICT, FullStateDictConfig()
    return StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig()


class TorchFSDP1Adapter(TorchAdapter):
    PROTOCOL_VERSION = 9  # the protocol version this adapter was written for
    name = "torch-fsdp1"
    # Everything but the listed gaps: review this when Capability grows. Each gap has a test that
    # tries the feature on torch and shows it missing (tests/conformance_tests/test_declared_absences.py).
    CAPABILITIES = frozenset(Capability) - {
        Capability.COMPOSABLE,
        Capability.SHARD_OPTIM_STATE,
        Capability.SHARD_GRAD_AND_OPTIM_STATE,
    }
    WRAPPER_COMPONENTS = frozenset({"_fsdp_wrapped_module"})
    # Backend facts (proven in tests/conformance_tests/test_declared_facts.py): FSDP1 is what the seeds
    # test; it refuses the unshard misuses exactly as they require (it has no check of the TP mesh
    # dimension: held to the seeds' refusal, see its expectations). Its mixed-precision unshard is
    # the protocol's default (the seeds').
    FLAT_PARAMETER_NAME = "_flat_param"
    REFUSALS = {misuse: SEED_REFUSALS[misuse] for misuse in Misuse if misuse.name.startswith("UNSHARD_")}
    NON_TP_2D_STATE_DICT_MESH = "2-D"  # the seed's: its DTensorExtensions put them on the 2-D mesh
    UNSUPPORTED_COMBINATIONS = {
        frozenset({Capability.UNSHARD_WITH_GRADS, Capability.UNSHARD_OFFLOAD_TO_CPU}): (
            "summon_full_params refuses with_grads together with offload_to_cpu (NotImplementedError "
            "'... is not supported yet')"
        ),
        frozenset({Capability.TENSOR_PARALLEL, Capability.NO_SHARD}): (
            "FSDP1's NO_SHARD of a tensor-parallel model fails at the first forward: its flat parameter "
            "handle compares the DTensor parameters' local shapes with their global ones and raises "
            "'Cannot writeback when the parameter shape changes' (FlatParamHandle._writeback_tensor in "
            "pre_unshard); FULL_SHARD and SHARD_GRAD_OP over the dp mesh work"
        ),
        frozenset({Capability.PARAMETER_GROUPS, Capability.FLAT_PARAMETERS}): (
            "with use_orig_params=False a unit's parameters are one FlatParameter, which the optimizer "
            "steps whole: its weights and biases cannot sit in different parameter groups (FSDP1 keeps "
            "per-parameter options only with use_orig_params=True)"
        ),
        frozenset({Capability.UNSHARD_WITH_GRADS, Capability.FLAT_PARAMETERS}): (
            "summon_full_params refuses with_grads for a model wrapped with use_orig_params=False "
            "(_validate_unshard_params_args: NotImplementedError '... use_orig_params=False ... is not "
            "supported yet')"
        ),
    }
    UNSUPPORTED_REASONS = {
        Capability.SHARD_OPTIM_STATE: (
            "FSDP has no optimizer-state-only strategy: every strategy but NO_SHARD shards "
            "parameters, and NO_SHARD replicates optimizer state too"
        ),
        Capability.SHARD_GRAD_AND_OPTIM_STATE: (
            "FSDP1 has no strategy that keeps parameters whole and shards only gradients and "
            "optimizer state: SHARD_GRAD_OP and _HYBRID_SHARD_ZERO2 reshard parameters after "
            "backward (FlatParamHandle keeps only this rank's flat shard at rest; they skip the "
            "reshard after forward only), FULL_SHARD and HYBRID_SHARD shard them throughout, and "
            "NO_SHARD all-reduces whole gradients"
        ),
        Capability.CPU_OFFLOAD: (
            "FSDP1 pins every offloaded shard (FlatParamHandle.init_flat_param_attributes calls "
            "pin_memory(); CPUOffload has no switch for it), which on a CPU device raises "
            "'Cannot access accelerator device when none is available' at the first forward"
        ),
        Capability.COMPOSABLE: (
            "torch.distributed._composable.fully_shard (FSDP1's composable form) was removed "
            "from torch; use the torch-fsdp2 backend for fully_shard"
        ),
    }

    def capabilities(self) -> frozenset[Capability]:
        if self.env.device.type == "cpu":
            return self.CAPABILITIES - {Capability.CPU_OFFLOAD}
        return self.CAPABILITIES

    def unsupported_combinations(self) -> Mapping[frozenset[Requirement], str]:
        # offload_to_cpu is broken on a CPU device (torch < 2.14) only where it gathers: a
        # NO_SHARD unit refuses it before touching memory, which the refusal scenario checks.
        if self.env.device.type == "cpu" and OFFLOAD_TO_CPU_BROKEN_ON_CPU:
            return {**self.UNSUPPORTED_COMBINATIONS, **_OFFLOAD_TO_CPU_ON_CPU}
        return self.UNSUPPORTED_COMBINATIONS

    # -- collective labels (the unit FQNs published by the wrappers _label_collectives installs)
    def collective_label(self) -> str | None:
        return current_label()

    # -- applying sharding ----------------------------------------------------------------
    def _shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
        if spec.check_exec_order:
            # FSDP1 decides at construction whether to validate the forward order.
            dist.set_debug_level(dist.DebugLevel.DETAIL)
        ignored = [submodule(model, fqn) for fqn in spec.ignored_modules]
        for fqn in innermost_first(spec.manual_units):
            parent, attr = parent_and_name(model, fqn)
            setattr(parent, attr, FSDP(submodule(model, fqn), **self._kwargs(spec, fqn, ignored)))
        if spec.shard_root:
            kwargs = self._kwargs(spec, "", ignored)
            if spec.auto_wrap_classes:
                kwargs["auto_wrap_policy"] = ModuleWrapPolicy(set(spec.auto_wrap_classes))
            model = FSDP(model, **kwargs)
        _label_collectives()
        for fqn, module in model.named_modules():
            if isinstance(module, FSDP) and module._handle is not None:
                _HANDLE_PREFIXES[module._handle] = clean_fqn(fqn)
        return model

    def _shard_deferred(self, model: nn.Module, spec: ShardingSpec, form: ApiForm, init: DeferredInit) -> nn.Module:
        """FSDP1's own deferred initialization: each FullyShardedDataParallel constructor calls
        ``param_init_fn`` on every module of its subtree not already wrapped (outside ignored
        modules), before it flattens and shards; ours gives the module's own tensors storage
        (``to_empty(recurse=False)``) and fills them. What no FSDP instance manages (ignored
        modules, an unmanaged root's own tensors) FSDP1 leaves to its user, so the adapter
        materializes it, as a training script must."""
        self._param_init_fn = functools.partial(init.materialize_module, device=self.env.device)
        try:
            sharded = self._shard(model, spec, form)
        finally:
            self._param_init_fn = None
        ignored = {m for fqn in spec.ignored_modules for m in submodule(model, fqn).modules()}
        managed = {m for unit in FSDP.fsdp_modules(sharded) for m in unit.modules()} - ignored
        for module in sharded.modules():
            if module not in managed:
                init.materialize_module(module, self.env.device)
        return sharded

    def clip_grad_norm(self, model: nn.Module, optimizer: Any, max_norm: float) -> torch.Tensor:
        # FSDP1's own: each rank's flat-parameter shard holds plain-tensor pieces, so torch's
        # clip over model.parameters() would see the local norm only.
        if not isinstance(model, FSDP):
            raise ValueError(
                "torch-fsdp1 adapter: FullyShardedDataParallel.clip_grad_norm_ is the root FSDP "
                "instance's; a model with an unmanaged root (shard_root=False) has several roots "
                "and no total norm (shard the root to clip)"
            )
        return model.clip_grad_norm_(max_norm)

    def _kwargs(self, spec: ShardingSpec, unit: str, ignored: list[nn.Module]) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "sharding_strategy": _STRATEGIES[spec.strategy_for(unit)],
            "use_orig_params": spec.use_orig_params,
            "cpu_offload": CPUOffload(offload_params=spec.offload_params),
            # On CPU FSDP1 must be told explicitly; on CUDA this pins the unit to our GPU.
            "device_id": self.env.device,
        }
        if spec.mesh is not None:
            kwargs["device_mesh"] = spec.mesh
        if spec.param_dtype is not None:
            # reduce_dtype None: FSDP1 reduces in param_dtype (MixedPrecision's documented
            # default), as ShardingSpec.reduce_dtype None means.
            kwargs["mixed_precision"] = MixedPrecision(param_dtype=spec.param_dtype, reduce_dtype=spec.reduce_dtype)
        if ignored:
            kwargs["ignored_modules"] = ignored
        if getattr(self, "_param_init_fn", None) is not None:  # set by _shard_deferred for its _shard
            kwargs["param_init_fn"] = self._param_init_fn
        return kwargs

    # -- gradient accumulation (NO_SYNC) -----------------------------------------------------
    @contextlib.contextmanager
    def no_gradient_sync(self, model: nn.Module) -> Iterator[None]:
        """FSDP1's ``no_sync()``, entered on every root FSDP instance: the module itself, or
        under a plain root (shard_root=False) each outermost unit, since ``no_sync()`` refuses an
        inner instance and reaches the units below the one it is called on."""
        roots = FSDP.fsdp_modules(model, root_only=True)
        if not roots:
            raise ValueError(f"{type(model).__name__} holds no FSDP unit: nothing to keep from syncing")
        with contextlib.ExitStack() as stack:
            for root in roots:
                stack.enter_context(root.no_sync())
            yield

    # -- unshard ------------------------------------------------------------------------
    def _unshard(self, model: nn.Module, request: UnshardRequest) -> contextlib.AbstractContextManager[None]:
        return FSDP.summon_full_params(
            _wrapped_submodule(model, request.fqn),
            recurse=request.recurse,
            writeback=request.writeback,
            rank0_only=request.rank0_only,
            offload_to_cpu=request.offload_to_cpu,
            with_grads=request.with_grads,
        )

    # -- state dicts ----------------------------------------------------------------------
    def _state_dict(self, model: nn.Module, kind: StateDictKind) -> dict[str, Any]:
        state_dict_type, config = _state_dict_type(kind)
        with FSDP.state_dict_type(model, state_dict_type, config):
            return model.state_dict()

    def _load_state_dict(self, model: nn.Module, state_dict: Mapping[str, Any], kind: StateDictKind) -> None:
        state_dict_type, config = _state_dict_type(kind)
        with FSDP.state_dict_type(model, state_dict_type, config):
            model.load_state_dict(state_dict)

    # -- introspection --------------------------------------------------------------------
    def is_unsharded(self, model: nn.Module, unit: str) -> bool:
        return _holds_unsharded(_handle(_wrapped_submodule(model, unit)))

    def unsharded_storage_numel(self, model: nn.Module, unit: str) -> int:
        return _unsharded_storage_numel(_handle(_wrapped_submodule(model, unit)))

    def unit_fqns(self, model: nn.Module) -> dict[str, list[str]]:
        units = {}
        for fqn, module in model.named_modules():
            if isinstance(module, FSDP) and module._handle is not None:
                prefix = clean_fqn(fqn)
                units[prefix] = [f"{prefix}.{name}" if prefix else name for name in module._handle.flat_param._fqns]
        return units

    def record_events(self, model: nn.Module) -> contextlib.AbstractContextManager[list[ShardEvent]]:
        handles = {
            clean_fqn(fqn): module._handle
            for fqn, module in model.named_modules()
            if isinstance(module, FSDP) and module._handle is not None
        }
        return record_transitions(
            (unit, handle, ("unshard", "reshard"), functools.partial(_holds_unsharded, handle))
            for unit, handle in handles.items()
        )


def _wrapped_submodule(model: nn.Module, fqn: str) -> nn.Module:
    """The module at original FQN ``fqn``, looked up through FSDP wrappers."""
    for name, module in model.named_modules():
        if clean_fqn(name) == fqn:
            return module
    return submodule(model, fqn)  # raises with the list of names


def _holds_unsharded(handle: Any) -> bool:
    if not handle.uses_sharded_strategy:
        return True  # NO_SHARD keeps the full parameter at all times
    # Allocated lazily at the first forward: absent means never unsharded. Under mixed precision
    # summon_full_params gathers into a separate full-precision buffer instead.
    buffers = ("_full_param_padded", "_full_prec_full_param_padded")
    return any(
        padded is not None and padded.untyped_storage().size() > 0
        for padded in (getattr(handle.flat_param, name, None) for name in buffers)
    )


def _unsharded_storage_numel(handle: Any) -> int:
    """Elements allocated in the handle's unsharded buffers: the compute one (low precision
    under mixed precision) and summon_full_params' full-precision one, both counted (the seed
    reads ``_full_param_padded``; an unfreed full-precision copy must show too)."""
    if not handle.uses_sharded_strategy:
        raise ValueError("a NO_SHARD unit keeps its parameters unsharded: it has no unsharded buffer to free")
    total = 0
    for name in ("_full_param_padded", "_full_prec_full_param_padded"):
        padded = getattr(handle.flat_param, name, None)
        if padded is not None:
            total += padded.untyped_storage().nbytes() // padded.element_size()
    return total


def _handle(module: nn.Module) -> Any:
    if not isinstance(module, FSDP) or module._handle is None:
        raise ValueError(f"{type(module).__name__} is not an FSDP1 unit with parameters")
    return module._handle
