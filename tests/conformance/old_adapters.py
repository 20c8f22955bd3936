"""Adapters written against older protocols, for the versioning and protocol-hook self-tests
(test_versions.py, test_protocol_hooks.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from conformance.protocol import PROTOCOL_VERSION, ApiForm, BackendAdapter, Capability, ShardingSpec, StateDictKind


class OldStyleAdapter(BackendAdapter):
    """Written against the protocol as it was before the hooks: only the abstract methods.

    One rank, nothing sharded (the model is returned as is), so plain torch is the exact
    expectation for everything the defaults do (tests/conformance/test_protocol_hooks.py).
    """

    name = "old-style"
    CAPABILITIES = frozenset({Capability.COMPOSABLE, Capability.FULL_SHARD, Capability.UNSHARD})

    def shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
        return model

    def unshard(self, model: nn.Module, fqn: str = "", **options: Any) -> Any:
        return contextlib.nullcontext()

    def state_dict(self, model: nn.Module, kind: StateDictKind) -> dict[str, Any]:
        return model.state_dict()

    def load_state_dict(self, model: nn.Module, state_dict: Mapping[str, Any], kind: StateDictKind) -> None:
        model.load_state_dict(dict(state_dict))

    def optim_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, kind: StateDictKind) -> dict[str, Any]:
        return optim.state_dict()

    def load_optim_state_dict(
        self, model: nn.Module, optim: torch.optim.Optimizer, state_dict: Mapping[str, Any], kind: StateDictKind
    ) -> None:
        optim.load_state_dict(dict(state_dict))


class FirstProtocolAdapter(OldStyleAdapter):
    """Written for protocol 1 (states no version): the public methods are its own, it declares
    none of the structural capabilities version 2 added, nor any later hook or fact."""

    name = "first-protocol"
    CAPABILITIES = frozenset({Capability.COMPOSABLE, Capability.NO_SHARD, Capability.UNSHARD})


class Incomplete(BackendAdapter):
    """Current protocol, but two of the abstract methods are missing."""

    name = "incomplete"
    PROTOCOL_VERSION = PROTOCOL_VERSION
    CAPABILITIES = frozenset({Capability.COMPOSABLE})

    def _shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
        return model

    def _unshard(self, model: nn.Module, fqn: str = "", **options: Any) -> Any:
        return contextlib.nullcontext()

    def _state_dict(self, model: nn.Module, kind: StateDictKind) -> dict[str, Any]:
        return model.state_dict()

    def _load_state_dict(self, model: nn.Module, state_dict: Mapping[str, Any], kind: StateDictKind) -> None:
        model.load_state_dict(dict(state_dict))
