"""Deliberately broken adapters for the no-vacuous-verdict self-tests (test_vacuous.py)."""

from __future__ import annotations

from conformance.adapters.template import TemplateAdapter
from conformance.protocol import ApiForm, Capability


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
