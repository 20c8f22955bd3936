"""The conformance adapter for tiny_fsdp, written from docs/writing-an-adapter.md as a new user
would (copied from conformance/adapters/template.py, then filled in)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch
import torch.nn as nn

from conformance.protocol import (
    PROTOCOL_VERSION,
    ApiForm,
    BackendAdapter,
    Capability,
    Misuse,
    Refusal,
    ShardingSpec,
    ShardingStrategy,
    StateDictKind,
    UnshardRequest,
    submodule,
)
from tests.conformance_tests import tiny_fsdp

_IN_COMPUTE = Refusal((ValueError,), r"cannot gather parameters while forward or backward runs")


class TinyFSDPAdapter(BackendAdapter):
    name = "tiny-fsdp"
    PROTOCOL_VERSION = PROTOCOL_VERSION
    EXPECTATIONS = "expectations.toml"
    CAPABILITIES = frozenset(
        {
            Capability.COMPOSABLE,
            Capability.FULL_SHARD,
            Capability.NO_SHARD,
            Capability.FLAT_PARAMETERS,
            Capability.UNSHARD,
            Capability.UNSHARD_WRITEBACK,
            Capability.FULL_STATE_DICT,
        }
    )
    UNSUPPORTED_REASONS: ClassVar[Mapping[Capability, str]] = {
        Capability.WRAPPER: "tiny_fsdp shards modules in place",
        Capability.UNITS: "tiny_fsdp shards the whole module as one flat buffer",
        Capability.SHARD_GRAD_OP: "tiny_fsdp gathers for every forward and drops the gather after backward only",
        Capability.OPTIM_STATE_DICT: "tiny_fsdp has no optimizer state dict API",
    }
    FLAT_PARAMETER_NAME = tiny_fsdp.FLAT_NAME
    REFUSALS: ClassVar[Mapping[Misuse, Refusal]] = {
        Misuse.UNSHARD_DURING_FORWARD: _IN_COMPUTE,
        Misuse.UNSHARD_DURING_BACKWARD: _IN_COMPUTE,
    }

    def _shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
        replicate = spec.strategy is ShardingStrategy.NO_SHARD
        return tiny_fsdp.shard_module(model, replicate=replicate, flat=not spec.use_orig_params)

    @contextlib.contextmanager
    def _unshard(self, model: nn.Module, request: UnshardRequest) -> Iterator[None]:
        submodule(model, request.fqn)  # a bad FQN fails with the module's names
        with tiny_fsdp.state_of(model).gathered(writeback=request.writeback):
            yield

    def _state_dict(self, model: nn.Module, kind: StateDictKind) -> dict[str, Any]:
        return tiny_fsdp.full_state_dict(model)

    def _load_state_dict(self, model: nn.Module, state_dict: Mapping[str, Any], kind: StateDictKind) -> None:
        tiny_fsdp.load_full_state_dict(model, dict(state_dict))

    def _optim_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, kind: StateDictKind) -> dict[str, Any]:
        raise AssertionError("not declared: the protocol refuses before calling this")

    def _load_optim_state_dict(
        self, model: nn.Module, optim: torch.optim.Optimizer, state_dict: Mapping[str, Any], kind: StateDictKind
    ) -> None:
        raise AssertionError("not declared: the protocol refuses before calling this")


class TinyHeldToTheSeeds(TinyFSDPAdapter):
    """The same adapter without its declared refusals: held to the seeds' AssertionError, which
    tiny_fsdp does not raise (test_unseen_backend.py shows the scenario then fails, naming both)."""

    name = "tiny-fsdp-undeclared"
    EXPECTATIONS = None
    REFUSALS: ClassVar[Mapping[Misuse, Refusal]] = {}
