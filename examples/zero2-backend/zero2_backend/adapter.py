"""The conformance adapter of zero2_lib (``zero2_backend.lib``, a ZeRO stage 2 library), written
from the suite's docs/writing-an-adapter.md and conformance/adapters/template.py alone, as an
out-of-tree backend's author would.

zero2_lib keeps parameters whole on every rank, reduce-scatters gradients to the rank that owns
each slice of the flat parameter space and steps float32 master copies of the owned slices only:
strategy ``SHARD_GRAD_AND_OPTIM_STATE``; its stage 0 (gradients all-reduced and kept whole,
every rank stepping all of it) is ``NO_SHARD``. Composable form (it shards in place), no units. It owns
its training loop (the optimizer is built over its master slices, backward is followed by the
gradient reduction, step by the all-gather), so every training hook and storage accessor is
overridden.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch
import torch.nn as nn

from conformance.protocol import (
    ApiForm,
    BackendAdapter,
    Capability,
    OptimizerFactory,
    ShardingSpec,
    ShardingStrategy,
    StateDictKind,
    UnshardRequest,
)
from zero2_backend import lib as zero2_lib

_ONE_MODE = "zero2_lib has ZeRO stage 2 (SHARD_GRAD_AND_OPTIM_STATE) and stage 0 (NO_SHARD) only"
_NO_UNITS = "zero2_lib partitions the whole model as one flat space; it has no units"


class Zero2Adapter(BackendAdapter):
    PROTOCOL_VERSION = 9
    name = "zero2-from-docs"
    EXPECTATIONS = "expectations.toml"
    CAPABILITIES = frozenset(
        {
            Capability.COMPOSABLE,
            Capability.SHARD_GRAD_AND_OPTIM_STATE,
            Capability.NO_SHARD,
            Capability.UNSHARD,
            Capability.UNSHARD_WRITEBACK,
            Capability.FULL_STATE_DICT,
            Capability.OPTIM_STATE_DICT,
            Capability.NO_SYNC,
        }
    )
    UNSUPPORTED_REASONS: ClassVar[Mapping[Capability, str]] = {
        Capability.WRAPPER: "zero2_lib.wrap shards the model in place and returns it; it has no wrapper module",
        Capability.AUTO_WRAP: _NO_UNITS,
        Capability.UNITS: _NO_UNITS,
        Capability.UNMANAGED_ROOT: _NO_UNITS,
        Capability.MIXED_STRATEGIES: _NO_UNITS,
        Capability.FULL_SHARD: _ONE_MODE,
        Capability.SHARD_GRAD_OP: _ONE_MODE,
        Capability.HYBRID_SHARD: _ONE_MODE,
        Capability.SHARD_OPTIM_STATE: _ONE_MODE,
        Capability.MIXED_PRECISION: "zero2_lib computes, reduces and steps in float32 only",
        Capability.REDUCE_DTYPE: "zero2_lib has no mixed precision, so no reduce dtype",
        Capability.CPU_OFFLOAD: "zero2_lib keeps parameters and master slices on the model's device",
        Capability.IGNORED_MODULES: "zero2_lib.wrap takes every parameter of the model",
        Capability.FLAT_PARAMETERS: "zero2_lib keeps the original parameters; its flat space is internal",
        Capability.UNSHARD_RANK0_ONLY: "zero2_lib.Zero2.full_params has no rank0_only option",
        Capability.UNSHARD_OFFLOAD_TO_CPU: "zero2_lib.Zero2.full_params has no offload_to_cpu option",
        Capability.UNSHARD_NON_RECURSIVE: _NO_UNITS,
        Capability.UNSHARD_WITH_GRADS: "zero2_lib keeps only the owned gradient slice; it cannot gather gradients",
        Capability.SHARDED_STATE_DICT: "zero2_lib has no sharded (DTensor) state dict",
        Capability.EXEC_ORDER_CHECK: "zero2_lib does not track the forward order",
        Capability.TENSOR_PARALLEL: "zero2_lib does not handle DTensor parameters",
        Capability.INTROSPECT_UNSHARDED: "zero2_lib never shards parameters, so nothing is unsharded",
        Capability.INTROSPECT_UNIT_FQNS: _NO_UNITS,
        Capability.INTROSPECT_EVENTS: "zero2_lib never unshards or reshards parameters",
        Capability.INTROSPECT_STORAGE: "zero2_lib never shards parameters, so has no unsharded storage",
        Capability.NATIVE_CHECKPOINT: "zero2_lib has no checkpoint format of its own",
        Capability.PARAMETER_GROUPS: (
            "zero2_lib's full optimizer state dict lists every parameter under every group, so it cannot "
            "say which group a parameter is in: a job resumed from it loses its groups"
        ),
        Capability.GRADIENT_CLIPPING: (
            "zero2_lib has no clipping of its own, and torch's clip over its gradient slices would see "
            "this rank's norm only"
        ),
    }
    # The library's module: collectives it issues on rank-dependent paths are attributed to the
    # scenario line that called into it.
    BACKEND_MODULES = (zero2_lib.__name__,)

    # -- applying sharding ----------------------------------------------------------------
    def _shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
        stage = 0 if spec.strategy is ShardingStrategy.NO_SHARD else 2
        return zero2_lib.wrap(model, stage=stage)

    # -- training loop: zero2_lib owns it ----------------------------------------------------
    def make_optimizer(self, model: nn.Module, factory: OptimizerFactory) -> torch.optim.Optimizer:
        return zero2_lib.engine_of(model).build_optimizer(factory)

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        loss.backward()
        zero2_lib.engine_of(model).reduce_gradients()

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        zero2_lib.engine_of(model).step(optimizer)

    def zero_grad(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        zero2_lib.engine_of(model).zero_grad()

    def no_gradient_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return zero2_lib.engine_of(model).no_sync()

    # -- unshard: parameters are always whole ------------------------------------------------
    @contextlib.contextmanager
    def _unshard(self, model: nn.Module, request: UnshardRequest) -> Iterator[None]:
        with zero2_lib.engine_of(model).full_params(writeback=request.writeback):
            yield

    # -- state dicts ----------------------------------------------------------------------
    def _state_dict(self, model: nn.Module, kind: StateDictKind) -> dict[str, Any]:
        return {name: value.detach().clone() for name, value in model.state_dict().items()}

    def _load_state_dict(self, model: nn.Module, state_dict: Mapping[str, Any], kind: StateDictKind) -> None:
        zero2_lib.engine_of(model).load_model_state_dict(state_dict)

    def _optim_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, kind: StateDictKind) -> dict[str, Any]:
        return zero2_lib.engine_of(model).full_optimizer_state_dict(optim)

    def _load_optim_state_dict(
        self, model: nn.Module, optim: torch.optim.Optimizer, state_dict: Mapping[str, Any], kind: StateDictKind
    ) -> None:
        zero2_lib.engine_of(model).load_full_optimizer_state_dict(optim, state_dict)

    # -- storage: parameters whole in `param`; gradients and optimizer state owned slices -----
    def set_local_shard(self, model: nn.Module, fqn: str, value: torch.Tensor) -> None:
        stored = self.named_parameter(model, fqn)
        if value.shape != stored.shape:
            raise ValueError(f"{fqn}: this rank stores shape {tuple(stored.shape)}, got {tuple(value.shape)}")
        zero2_lib.engine_of(model).write_parameter(fqn, value)

    def local_grad_shard(self, model: nn.Module, fqn: str) -> torch.Tensor | None:
        grad = zero2_lib.engine_of(model).owned_gradient(fqn)
        return None if grad is None else grad.detach().clone()

    def set_local_grad_shard(self, model: nn.Module, fqn: str, value: torch.Tensor) -> None:
        grad = zero2_lib.engine_of(model).owned_gradient(fqn)
        if grad is None:
            raise ValueError(f"{fqn}: this rank stores no gradient to overwrite (run a backward first)")
        if value.shape != grad.shape:
            raise ValueError(f"{fqn} gradient: this rank stores shape {tuple(grad.shape)}, got {tuple(value.shape)}")
        with torch.no_grad():
            grad.copy_(value)

    def local_optim_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, fqn: str
    ) -> dict[str, torch.Tensor]:
        piece = zero2_lib.engine_of(model).pieces.get(fqn)
        if piece is None:  # another rank owns all of this parameter
            return {}
        state = optimizer.state.get(piece, {})
        return {
            name: value.detach().clone()
            for name, value in state.items()
            if isinstance(value, torch.Tensor) and value.dim() > 0
        }
