"""A backend whose layout depends on the spec, for the layout self-test in test_declared_facts.py.

It keeps flat parameters (``use_orig_params=False``) as torch FSDP1 does, one flat buffer per
unit, and original parameters as torch FSDP2 does, in dim-0 rows: it declares ``ROWS``, the
layout of its original parameters, and a flat parameter is one flat buffer under any layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import ClassVar

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from conformance.adapters.torch_fsdp1 import TorchFSDP1Adapter
from conformance.adapters.torch_fsdp2 import TorchFSDP2Adapter
from conformance.protocol import (
    ApiForm,
    BackendEnv,
    Capability,
    Requirement,
    ShardingSpec,
    ShardLayout,
    SpecCondition,
    UnshardRequest,
)


class FlatUnitsOriginalRows(TorchFSDP1Adapter):
    """Flat parameters by torch FSDP1, original parameters by torch FSDP2 (its rows)."""

    name = "flat-units-original-rows"
    SHARD_LAYOUT: ClassVar[ShardLayout] = ShardLayout.ROWS
    # FSDP2's unshard drops what was written inside ("changes to parameters unsharded by
    # FSDPModule.unshard() are dropped at reshard"): writeback is FSDP1's, flat parameters only.
    WRITEBACK_WITH_ROWS: ClassVar[Mapping[frozenset[Requirement], str]] = {
        frozenset({Capability.UNSHARD_WRITEBACK, SpecCondition.ORIGINAL_PARAMETERS}): (
            "original parameters are FSDP2's, whose unshard drops changes at reshard"
        )
    }

    def __init__(self, env: BackendEnv) -> None:
        super().__init__(env)
        self._rows = TorchFSDP2Adapter(env)

    def unsupported_combinations(self) -> Mapping[frozenset[Requirement], str]:
        return {**super().unsupported_combinations(), **self.WRITEBACK_WITH_ROWS}

    def _shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
        if spec.use_orig_params:
            return self._rows._shard(model, spec, ApiForm.COMPOSABLE)
        return super()._shard(model, spec, form)

    def _unshard(self, model: nn.Module, request: UnshardRequest) -> contextlib.AbstractContextManager[None]:
        if _in_rows(model):
            return self._rows._unshard(model, request)
        return super()._unshard(model, request)

    def is_unsharded(self, model: nn.Module, unit: str) -> bool:
        return self._rows.is_unsharded(model, unit) if _in_rows(model) else super().is_unsharded(model, unit)

    def unsharded_storage_numel(self, model: nn.Module, unit: str) -> int:
        if _in_rows(model):
            return self._rows.unsharded_storage_numel(model, unit)
        return super().unsharded_storage_numel(model, unit)


class FlatUnitsOriginalRowsMisdeclared(FlatUnitsOriginalRows):
    """The same backend declaring PER_PARAMETER, which its original parameters do not have."""

    name = "flat-units-original-rows-misdeclared"
    SHARD_LAYOUT: ClassVar[ShardLayout] = ShardLayout.PER_PARAMETER


def _in_rows(model: nn.Module) -> bool:
    """Whether ``model`` was sharded by FSDP2 (original parameters): a unit of it is an FSDPModule."""
    return any(isinstance(module, FSDPModule) for module in model.modules())
