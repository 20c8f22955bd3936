"""Deliberately broken adapters for the no-vacuous-verdict self-tests (test_vacuous.py)."""

from __future__ import annotations

import torch.nn as nn

from conformance.adapters.template import TemplateAdapter
from conformance.protocol import ApiForm, Capability, ShardingSpec


class NoFormsHereAdapter(TemplateAdapter):
    """What a CUDA-only backend following the old docs did on a CPU runner: its capabilities()
    drop both API forms at runtime, so every scenario looping over forms() ran nothing."""

    name = "no-forms-here"

    def capabilities(self) -> frozenset[Capability]:
        return self.CAPABILITIES - {Capability.for_form(form) for form in ApiForm}


class BrokenConstructorAdapter(TemplateAdapter):
    """An adapter whose constructor fails: it cannot even say what it supports."""

    name = "broken-constructor"

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("no accelerator runtime found")

    def capabilities(self) -> frozenset[Capability]:
        return self.CAPABILITIES


class ShardsNothingAdapter(TemplateAdapter):
    """A backend that claims the sharding strategies but silently falls back to the plain model
    (what a CUDA-only library may do on a CPU runner): _shard() returns the model unchanged, no
    wrapper, no collective, so gradients are never reduced and nothing is ever sharded."""

    name = "shards-nothing"
    WRAPPER_COMPONENTS = frozenset()
    CAPABILITIES = TemplateAdapter.CAPABILITIES | {
        Capability.COMPOSABLE,
        Capability.FULL_SHARD,
        Capability.SHARD_GRAD_OP,
    }

    def _shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
        return model
