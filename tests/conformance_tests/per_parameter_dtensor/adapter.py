"""The conformance adapter for the per-parameter DTensor backend beside it (a SimpleFSDP-style
design: no units, forward computes with gathered temporaries), and its replicating twin.

Written from docs/writing-an-adapter.md: the storage hooks are the protocol's defaults (a
DTensor parameter's local part), because what the backend stores is exactly that. The twin
declares the same strategies and stores everything on every rank: the storage and singleton
scenarios must fail it (tests/conformance_tests/test_per_parameter_dtensor.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from conformance.protocol import (
    PROTOCOL_VERSION,
    ApiForm,
    BackendAdapter,
    Capability,
    Misuse,
    Permitted,
    Refusal,
    ShardingSpec,
    ShardingStrategy,
    ShardLayout,
    StateDictKind,
    UnshardRequest,
    submodule,
)
from tests.conformance_tests import per_parameter_dtensor


class PerParameterDTensorAdapter(BackendAdapter):
    name = "per-parameter-dtensor"
    PROTOCOL_VERSION = PROTOCOL_VERSION
    CAPABILITIES = frozenset(
        {
            Capability.COMPOSABLE,
            Capability.FULL_SHARD,
            Capability.HYBRID_SHARD,
            Capability.NO_SHARD,
            Capability.UNSHARD,
            Capability.UNSHARD_WRITEBACK,
        }
    )
    UNSUPPORTED_REASONS: ClassVar[Mapping[Capability, str]] = {
        Capability.WRAPPER: "the backend turns parameters into DTensors in place; it has no wrapper",
        Capability.UNITS: "every parameter is gathered on its own when forward reads it: there are no units",
        Capability.FLAT_PARAMETERS: "every parameter stays its own DTensor",
        Capability.SHARD_GRAD_OP: "forward gathers into temporaries that autograd frees after backward",
    }
    # Shard(0) splits each parameter with torch.chunk along dim 0, as FSDP2 does.
    SHARD_LAYOUT = ShardLayout.ROWS
    # gathered() all-gathers each DTensor parameter on its own and tracks no forward or backward
    # it could disturb: unsharding from inside them is allowed and computes the right values.
    REFUSALS: ClassVar[Mapping[Misuse, Refusal | Permitted]] = {
        Misuse.UNSHARD_DURING_FORWARD: Permitted("gathered() holds no state a forward depends on"),
        Misuse.UNSHARD_DURING_BACKWARD: Permitted("gathered() holds no state a backward depends on"),
    }
    REPLICATE_EVERYTHING: ClassVar[bool] = False

    def _shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
        if spec.strategy is ShardingStrategy.HYBRID_SHARD:
            assert spec.mesh is not None, "the scenario builds a (replicate, shard) mesh for HYBRID_SHARD"
            mesh, placements = spec.mesh, (Replicate(), Shard(0))
        else:
            mesh = init_device_mesh(self.env.device.type, (self.env.world_size,))
            placements = (Replicate(),) if spec.strategy is ShardingStrategy.NO_SHARD else (Shard(0),)
        return per_parameter_dtensor.data_parallel(
            model, mesh, placements, replicate_everything=self.REPLICATE_EVERYTHING
        )

    @contextlib.contextmanager
    def _unshard(self, model: nn.Module, request: UnshardRequest) -> Iterator[None]:
        submodule(model, request.fqn)  # a bad FQN fails with the module's names
        with per_parameter_dtensor.gathered(model, writeback=request.writeback):
            yield

    def _state_dict(self, model: nn.Module, kind: StateDictKind) -> dict[str, Any]:
        raise AssertionError("not declared: the protocol refuses before calling this")

    def _load_state_dict(self, model: nn.Module, state_dict: Mapping[str, Any], kind: StateDictKind) -> None:
        raise AssertionError("not declared: the protocol refuses before calling this")

    def _optim_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, kind: StateDictKind) -> dict[str, Any]:
        raise AssertionError("not declared: the protocol refuses before calling this")

    def _load_optim_state_dict(
        self, model: nn.Module, optim: torch.optim.Optimizer, state_dict: Mapping[str, Any], kind: StateDictKind
    ) -> None:
        raise AssertionError("not declared: the protocol refuses before calling this")


class ReplicatingTwin(PerParameterDTensorAdapter):
    """The same backend storing every parameter whole on every rank, declaring the same."""

    name = "per-parameter-dtensor-replicating"
    REPLICATE_EVERYTHING = True


class PermitsButRefuses(PerParameterDTensorAdapter):
    """Declares unsharding inside forward and backward permitted, yet refuses every unshard."""

    name = "per-parameter-dtensor-permits-but-refuses"

    @contextlib.contextmanager
    def _unshard(self, model: nn.Module, request: UnshardRequest) -> Iterator[None]:
        raise RuntimeError("gathered() is not allowed here")
        yield
