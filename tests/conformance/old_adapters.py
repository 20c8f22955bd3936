"""Adapters written against older protocols, for the versioning self-tests (test_versions.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from conformance.protocol import ApiForm, BackendAdapter, Capability, ShardingSpec, StateDictKind


class FirstProtocolAdapter(BackendAdapter):
    """Written for protocol 1 (states no version): the public methods are its own, it declares
    none of the structural capabilities version 2 added, nor any later hook or fact."""

    name = "first-protocol"
    CAPABILITIES = frozenset({Capability.COMPOSABLE, Capability.NO_SHARD, Capability.UNSHARD})

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


class Incomplete(BackendAdapter):
    """Current protocol, but two of the abstract methods are missing."""

    name = "incomplete"
    PROTOCOL_VERSION = 3
    CAPABILITIES = frozenset({Capability.COMPOSABLE})

    def _shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
        return model

    def _unshard(self, model: nn.Module, fqn: str = "", **options: Any) -> Any:
        return contextlib.nullcontext()

    def _state_dict(self, model: nn.Module, kind: StateDictKind) -> dict[str, Any]:
        return model.state_dict()

    def _load_state_dict(self, model: nn.Module, state_dict: Mapping[str, Any], kind: StateDictKind) -> None:
        model.load_state_dict(dict(state_dict))
