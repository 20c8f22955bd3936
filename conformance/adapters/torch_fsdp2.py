"""Adapter for torch FSDP2: ``torch.distributed.fsdp.fully_shard`` (composable form).

Strategy mapping: FULL_SHARD / SHARD_GRAD_OP are ``reshard_after_forward`` True / False on a
1-D mesh; HYBRID_SHARD is the caller's 2-D (replicate, shard) mesh; NO_SHARD is a 2-D mesh
with every rank its own replica group (shard size 1), which is FSDP2's replicate-only mode.
FULL_SHARD leaves ``reshard_after_forward`` to fully_shard's default where it has one (None:
every unit but the root reshards after forward, the root keeps its parameters for backward,
as FSDP1's FULL_SHARD root does); an explicit True would make the root reshard too.
Features FSDP2 does not have are declared missing, never emulated; each declared gap has a test
that tries it on torch (tests/conformance_tests/test_declared_absences.py).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from conformance.adapters._common import (
    TorchAdapter,
    dcp_options,
    record_transitions,
)
from conformance.adapters._labels import current_label, label_calls
from conformance.protocol import (
    ApiForm,
    BackendEnv,
    Capability,
    DeferredInit,
    MixedPrecisionUnshard,
    ShardEvent,
    ShardingSpec,
    ShardingStrategy,
    ShardLayout,
    StateDictKind,
    UnshardRequest,
    innermost_first,
    submodule,
)

_NO_UNSHARD_OPTION = "FSDPModule.unshard() has no such option"
# torch >= 2.7 (roughly): reshard_after_forward=None means "True, except for the root". Older
# fully_shard takes a bool and always keeps the root unsharded after forward.
_RESHARD_DEFAULT_IS_AUTO = inspect.signature(fully_shard).parameters["reshard_after_forward"].default is None
# torch < 2.7: fully_shard has no `ignored_params`, so a module cannot be left out of its unit.
HAS_IGNORED_PARAMS = "ignored_params" in inspect.signature(fully_shard).parameters


def _label_collectives() -> None:
    """Name the parameter FQNs behind FSDP2's all-gathers (unshard) and reduce-scatters (post_backward)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:  # a torch whose internals moved: collectives keep their generic labels
        return

    def group_fqns(group: Any, *args: Any, **kwargs: Any) -> list[str]:
        return [p._param_fqn for p in group.fsdp_params if getattr(p, "_param_fqn", None)]

    label_calls(FSDPParamGroup, "unshard", group_fqns)
    label_calls(FSDPParamGroup, "post_backward", group_fqns)


class TorchFSDP2Adapter(TorchAdapter):
    PROTOCOL_VERSION = 9  # the protocol version this adapter was written for
    name = "torch-fsdp2"
    # Everything but the listed gaps: review this when Capability grows.
    CAPABILITIES = frozenset(Capability) - {
        Capability.SHARD_GRAD_AND_OPTIM_STATE,
        Capability.WRAPPER,
        Capability.FLAT_PARAMETERS,
        Capability.EXEC_ORDER_CHECK,
        Capability.UNSHARD_WRITEBACK,
        Capability.UNSHARD_RANK0_ONLY,
        Capability.UNSHARD_OFFLOAD_TO_CPU,
        Capability.UNSHARD_WITH_GRADS,
        Capability.SHARD_OPTIM_STATE,
    }
    # Backend facts (proven in tests/conformance_tests/test_declared_facts.py): FSDPModule.unshard()
    # all-gathers in mp_policy.param_dtype, so under mixed precision the unsharded parameters are
    # in the compute dtype, and a root gathered by forward stays so (the adapter leaves units it
    # did not gather). It declares no refusals: fully_shard refuses none of the misuses, so it is
    # held to the seeds' (see its expectations).
    MIXED_PRECISION_UNSHARD = MixedPrecisionUnshard(shows_compute_dtype=True, root_stays_unsharded=True)
    # Each parameter is split along dim 0 (Shard(0)): to_local() is this rank's rows, unpadded;
    # the all-gather output a parameter's unsharded view lives in holds ceil(rows / world size)
    # x world size rows (proven in tests/conformance_tests/test_declared_facts.py).
    SHARD_LAYOUT = ShardLayout.ROWS
    NON_TP_2D_STATE_DICT_MESH = "dp"  # fully_shard keeps them on the dp mesh; test_declared_facts.py
    if not HAS_IGNORED_PARAMS:  # torch 2.6; proven in tests/conformance_tests/test_declared_absences.py
        CAPABILITIES -= {Capability.IGNORED_MODULES}
    # On CPU, fully_shard records events on torch.cpu.Stream, which has record_event from torch 2.7.
    SUPPORTED_PLATFORMS = {"cpu": ">=2.7", "cuda": ""}
    PLATFORM_REASONS = {"cpu": "fully_shard calls torch.cpu.Stream.record_event, which torch 2.6 lacks"}
    UNSUPPORTED_COMBINATIONS = {
        frozenset({Capability.GRADIENT_CLIPPING, Capability.MIXED_STRATEGIES, Capability.NO_SHARD}): (
            "torch.nn.utils.clip_grad_norm_ stacks every gradient's norm, and DTensor refuses to stack "
            'norms from different meshes ("All operands in aten.stack.default must have the same mesh"): '
            "a NO_SHARD unit lives on the adapter's (world, 1) replicate mesh, the other units on the "
            "1-D mesh, so a model mixing them cannot be clipped (pytorch/pytorch#180346, open)"
        ),
        frozenset({Capability.TENSOR_PARALLEL, Capability.NO_SHARD}): (
            "fully_shard replicates only over the first dimension of a 2-D (replicate, shard) mesh: "
            "over a 1-D mesh it always shards (DTensor Shard(0)). NO_SHARD of a tensor-parallel "
            "model needs a (dp, 1) mesh over the 2-D mesh's dp dimension, which DeviceMesh builds "
            "from a dp submesh through no public API; the adapter's NO_SHARD is its own "
            "(world, 1) mesh, which would replicate across the tp ranks too"
        ),
    }
    UNSUPPORTED_REASONS = {
        Capability.IGNORED_MODULES: "fully_shard() of this torch has no ignored_params (torch >= 2.7 has)",
        Capability.SHARD_OPTIM_STATE: (
            "FSDP has no optimizer-state-only strategy: every strategy but NO_SHARD shards "
            "parameters, and NO_SHARD replicates optimizer state too"
        ),
        Capability.SHARD_GRAD_AND_OPTIM_STATE: (
            "fully_shard always shards parameters at rest (DTensor Shard(0) over the mesh's shard "
            "dimension; reshard_after_forward only chooses whether they are resharded between "
            "forward and backward), and a replicate-only mesh (NO_SHARD) all-reduces whole "
            "gradients: no layout keeps parameters whole while sharding gradients"
        ),
        Capability.WRAPPER: "fully_shard has no wrapper form; it changes the module in place",
        Capability.FLAT_PARAMETERS: "fully_shard always exposes the original parameters (DTensor)",
        Capability.EXEC_ORDER_CHECK: "fully_shard performs no execution-order validation",
        Capability.UNSHARD_WRITEBACK: (
            "changes to parameters unsharded by FSDPModule.unshard() are dropped at reshard"
        ),
        Capability.UNSHARD_RANK0_ONLY: _NO_UNSHARD_OPTION,
        Capability.UNSHARD_OFFLOAD_TO_CPU: _NO_UNSHARD_OPTION,
        Capability.UNSHARD_WITH_GRADS: _NO_UNSHARD_OPTION,
    }

    def __init__(self, env: BackendEnv) -> None:
        super().__init__(env)
        self._replicate_mesh: DeviceMesh | None = None
        _label_collectives()

    # -- collective labels (the unit FQNs published by the wrappers _label_collectives installs)
    def collective_label(self) -> str | None:
        return current_label()

    # -- applying sharding ----------------------------------------------------------------
    def _shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
        ignored_params = {p for fqn in spec.ignored_modules for p in submodule(model, fqn).parameters()}
        for fqn in self._unit_fqns(model, spec):
            fully_shard(submodule(model, fqn), **self._kwargs(spec, fqn, ignored_params))
        return model

    def _shard_deferred(self, model: nn.Module, spec: ShardingSpec, form: ApiForm, init: DeferredInit) -> nn.Module:
        """FSDP2's deferred initialization, as its documentation gives it: ``fully_shard`` the
        meta model (parameters become meta DTensors of their shards), ``to_empty`` (each rank
        allocates its shard only; on CPU under CPU offload, as fully_shard requires), then
        initialize. ``init`` fills full-shaped values, so each module's are filled into
        temporaries and every DTensor parameter keeps its shard of them (``distribute_tensor``
        with the parameter's own mesh and placements); buffers are plain tensors, filled in
        place."""
        sharded = self._shard(model, spec, form)
        storage = torch.device("cpu") if spec.offload_params else self.env.device
        sharded.to_empty(device=storage)
        with torch.no_grad():
            for module in sharded.modules():
                own = init.own_tensors(module)
                if not own:
                    continue
                if storage != self.env.device:  # buffers are computed with where the ranks compute
                    for name, buffer in module.named_buffers(recurse=False):
                        module._buffers[name] = own[name] = buffer.to(self.env.device)
                full = {
                    name: torch.empty(t.shape, dtype=t.dtype, device=self.env.device) if isinstance(t, DTensor) else t
                    for name, t in own.items()
                }
                init.fill(module, full)
                for name, tensor in own.items():
                    if isinstance(tensor, DTensor):
                        shard = distribute_tensor(full[name], tensor.device_mesh, tensor.placements).to_local()
                        tensor.to_local().copy_(shard)
        return sharded

    def _unit_fqns(self, model: nn.Module, spec: ShardingSpec) -> list[str]:
        if spec.auto_wrap_classes:
            ignored = tuple(f"{fqn}." for fqn in spec.ignored_modules)
            units = [
                fqn
                for fqn, module in model.named_modules()
                if fqn
                and isinstance(module, spec.auto_wrap_classes)
                and fqn not in spec.ignored_modules
                and not fqn.startswith(ignored)
            ]
        else:
            units = list(spec.manual_units)
        ordered = innermost_first(tuple(units))
        return [*ordered, ""] if spec.shard_root else ordered

    def _kwargs(self, spec: ShardingSpec, unit: str, ignored_params: set[nn.Parameter]) -> dict[str, Any]:
        strategy = spec.strategy_for(unit)
        kwargs: dict[str, Any] = {
            "mesh": self._mesh(spec, strategy),
            "reshard_after_forward": self._reshard_after_forward(strategy),
            "offload_policy": self._offload_policy(spec),
        }
        if spec.param_dtype is not None:
            # reduce_dtype None: fully_shard reduces in param_dtype (MixedPrecisionPolicy's
            # documented default), as ShardingSpec.reduce_dtype None means.
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=spec.param_dtype, reduce_dtype=spec.reduce_dtype)
        if ignored_params:
            kwargs["ignored_params"] = ignored_params
        return kwargs

    @staticmethod
    def _reshard_after_forward(strategy: ShardingStrategy) -> bool | None:
        if strategy is ShardingStrategy.SHARD_GRAD_OP:
            return False
        return None if _RESHARD_DEFAULT_IS_AUTO else True

    def _offload_policy(self, spec: ShardingSpec) -> OffloadPolicy:
        if not spec.offload_params:
            return OffloadPolicy()
        # Pinned host memory needs an accelerator; on a CPU device the shards live in plain
        # (pageable) CPU memory, which is all offloading means there.
        return CPUOffloadPolicy(pin_memory=self.env.device.type != "cpu")

    def _mesh(self, spec: ShardingSpec, strategy: ShardingStrategy) -> DeviceMesh | None:
        if strategy is not ShardingStrategy.NO_SHARD:
            return spec.mesh
        if spec.mesh is not None:
            raise ValueError(
                "torch-fsdp2 adapter: NO_SHARD replicates over the whole world on a mesh of "
                "its own; leave ShardingSpec.mesh unset for NO_SHARD units"
            )
        if self._replicate_mesh is None:  # one mesh (one set of groups) for every unit
            self._replicate_mesh = init_device_mesh(
                self.env.device.type,
                (self.env.world_size, 1),
                mesh_dim_names=("replicate", "shard"),
            )
        return self._replicate_mesh

    # -- gradient accumulation (NO_SYNC) -----------------------------------------------------
    @contextlib.contextmanager
    def no_gradient_sync(self, model: nn.Module) -> Iterator[None]:
        """``set_requires_gradient_sync(False)`` on every unit (the root and, under a plain root,
        each sharded submodule) for the duration, then True again: backward accumulates the
        unsharded gradients meanwhile, and the next backward with sync reduces their sum."""
        units = [module for module in model.modules() if isinstance(module, FSDPModule)]
        if not units:
            raise ValueError(f"{type(model).__name__} holds no fully_shard unit: nothing to keep from syncing")
        for unit in units:
            unit.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for unit in units:
                unit.set_requires_gradient_sync(True, recurse=False)

    # -- unshard ------------------------------------------------------------------------
    @contextlib.contextmanager
    def _unshard(self, model: nn.Module, request: UnshardRequest) -> Iterator[None]:
        target = submodule(model, request.fqn)
        if request.recurse:
            units = [m for m in target.modules() if isinstance(m, FSDPModule)]
        else:
            units = [_fsdp_module(target)]
        # A unit already unsharded (the root between forward and backward) stays so afterwards:
        # the context must not change what the strategy keeps gathered.
        gathered = [unit for unit in units if not _holds_unsharded(unit)]
        for unit in gathered:
            unit.unshard()
        try:
            yield
        finally:
            for unit in reversed(gathered):
                unit.reshard()

    # -- state dicts ----------------------------------------------------------------------
    def _state_dict(self, model: nn.Module, kind: StateDictKind) -> dict[str, Any]:
        return get_model_state_dict(model, options=dcp_options(kind))

    def _load_state_dict(self, model: nn.Module, state_dict: Mapping[str, Any], kind: StateDictKind) -> None:
        set_model_state_dict(model, dict(state_dict), options=dcp_options(kind))

    # -- introspection --------------------------------------------------------------------
    def is_unsharded(self, model: nn.Module, unit: str) -> bool:
        groups = _param_groups(_fsdp_module(submodule(model, unit)))
        if not groups:
            raise ValueError(f"unit {unit!r} manages no parameters")
        return all(group.is_unsharded for group in groups)

    def unsharded_storage_numel(self, model: nn.Module, unit: str) -> int:
        return sum(
            _allocated_numel(output)
            for group in _param_groups(_fsdp_module(submodule(model, unit)))
            for fsdp_param in group.fsdp_params
            for output in fsdp_param.all_gather_outputs
        )

    def unit_fqns(self, model: nn.Module) -> dict[str, list[str]]:
        module_names = {id(m): name for name, m in model.named_modules()}
        units = {}
        for name, module in model.named_modules():
            if isinstance(module, FSDPModule):
                units[name] = [
                    _join(module_names[id(p._module_info.module)], p._module_info.param_name)
                    for group in _param_groups(module)
                    for p in group.fsdp_params
                ]
        return units

    def record_events(self, model: nn.Module) -> contextlib.AbstractContextManager[list[ShardEvent]]:
        return record_transitions(
            (name, group, ("wait_for_unshard", "reshard"), functools.partial(_is_unsharded, group))
            for name, module in model.named_modules()
            if isinstance(module, FSDPModule)
            for group in _param_groups(module)
        )


def _fsdp_module(module: nn.Module) -> FSDPModule:
    if not isinstance(module, FSDPModule):
        raise ValueError(f"{type(module).__name__} was not sharded with fully_shard")
    return module


def _holds_unsharded(module: FSDPModule) -> bool:
    groups = _param_groups(module)
    return bool(groups) and all(group.is_unsharded for group in groups)


def _param_groups(module: FSDPModule) -> list[Any]:
    """The module's FSDPParamGroups (a list since torch 2.13, a single optional one before)."""
    state = module._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []


def _allocated_numel(tensor: Any) -> int:
    """Elements the storage behind ``tensor`` holds now (0 once FSDP2 freed it)."""
    return tensor.untyped_storage().nbytes() // tensor.element_size()


def _is_unsharded(group: Any) -> bool:
    return group.is_unsharded


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
