"""Adapters written against older protocols, for the versioning and protocol-hook self-tests
(test_versions.py, test_protocol_hooks.py): they must keep running, with one warning, and fail
nothing for the suite's reasons."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from conformance.protocol import (
    PROTOCOL_VERSION,
    ApiForm,
    BackendAdapter,
    Capability,
    ShardingSpec,
    StateDictKind,
    UnshardRequest,
    submodule,
)


class OldStyleAdapter(BackendAdapter):
    """Written against the protocol as it was before the hooks: only the abstract methods.

    One rank, nothing sharded (the model is returned as is), so plain torch is the exact
    expectation for everything the defaults do (tests/conformance_tests/test_protocol_hooks.py).
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

    def _unshard(self, model: nn.Module, request: UnshardRequest) -> Any:
        return contextlib.nullcontext()

    def _state_dict(self, model: nn.Module, kind: StateDictKind) -> dict[str, Any]:
        return model.state_dict()

    def _load_state_dict(self, model: nn.Module, state_dict: Mapping[str, Any], kind: StateDictKind) -> None:
        model.load_state_dict(dict(state_dict))


class ZeroStyleEngine(nn.Module):
    """What a ZeRO engine looks like to an adapter: it holds the user's model as its child
    ``module``, so every parameter it lists is named ``module.<original FQN>``; every rank starts
    from rank 0's parameters (a broadcast at construction, as DeepSpeed's engine does).
    Replicated (ZeRO stage 0): every rank keeps every parameter."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        if dist.is_initialized() and dist.get_world_size() > 1:
            for param in module.parameters():
                dist.broadcast(param.data, src=0)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class ZeroStyleFirstProtocolAdapter(OldStyleAdapter):
    """A ZeRO-style adapter written for protocol 1 (states no version), as one was written then:
    its engine wrapper names every parameter ``module.<fqn>`` and it declares no
    WRAPPER_COMPONENTS (protocol 1 had none); beside its public ``unshard()`` it keeps a helper
    of its own, ``_unshard(engine, fqn, writeback)``, whose name the protocol later gave to the
    implementation behind its template ``unshard()``. Nothing here is the suite's to fail."""

    name = "zero-style-first-protocol"
    CAPABILITIES = frozenset(
        {Capability.WRAPPER, Capability.NO_SHARD, Capability.UNSHARD, Capability.UNSHARD_WRITEBACK}
    )

    def __init__(self, env: Any) -> None:
        super().__init__(env)
        self.gathered: list[tuple[str, bool]] = []  # what its own helper was asked for

    def shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
        return ZeroStyleEngine(model)

    def unshard(self, model: nn.Module, fqn: str = "", **options: Any) -> Any:
        return self._unshard(model, fqn, options.get("writeback", True))

    def _unshard(self, engine: nn.Module, fqn: str, writeback: bool) -> Any:
        """The adapter's own helper (stage 0 keeps full parameters: nothing to gather)."""
        submodule(engine.module, fqn)  # a bad FQN fails with the model's names
        self.gathered.append((fqn, writeback))
        return contextlib.nullcontext()


class ZeroTwoAsShardGradOpAdapter(OldStyleAdapter):
    """Written for protocol 4, when the adapter guide mapped DeepSpeed's ZeRO stage 2 onto
    SHARD_GRAD_OP: it declares that strategy, whose meaning moved in version 5 (torch FSDP's
    SHARD_GRAD_OP, parameters sharded at rest), so its warning must say so."""

    name = "zero2-as-shard-grad-op"
    PROTOCOL_VERSION = 4
    CAPABILITIES = frozenset({Capability.COMPOSABLE, Capability.SHARD_GRAD_OP, Capability.UNSHARD})
