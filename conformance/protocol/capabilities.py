"""Capabilities: what a backend declares it supports, and what each call requires of it.

An adapter declares its :class:`~conformance.protocol.vocabulary.Capability` set, why each missing
one is missing, the combinations it lacks although it has each member, and the platforms it runs
on (:class:`BackendCapabilities`). A scenario, or a public method of the adapter, states what it
exercises (:meth:`ShardingSpec.needed_capabilities
<conformance.protocol.vocabulary.ShardingSpec.needed_capabilities>`, :func:`unshard_capabilities`)
and calls :func:`require` / :func:`require_all`, which skip the test as ``unsupported: ...``
rather than let it run half-supported or pass silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import pytest
import torch

from conformance.protocol.vocabulary import ApiForm, Capability, Requirement, SpecCondition


class BackendCapabilities:
    """The capabilities an adapter declares, with the checks that read them.

    A base of :class:`~conformance.protocol.adapter.BackendAdapter`. Subclasses set
    ``CAPABILITIES``; the methods are overridden where support depends on the environment.
    """

    # The backend's name (each adapter sets it): what an unsupported reason names by default.
    name: ClassVar[str]
    CAPABILITIES: ClassVar[frozenset[Capability]]
    # Why a capability is missing; shown in the skip reason. Missing entries read "not provided".
    UNSUPPORTED_REASONS: ClassVar[Mapping[Capability, str]] = {}
    # Capabilities the backend has one by one but not together (DeepSpeed: CPU offload, but not
    # with NO_SHARD, its ZeRO stage 0), each with the reason. require_all() skips a scenario
    # that needs every member of one, as "unsupported: <a> with <b>: <reason>".
    # Members may also be SpecConditions: spec-field values that need no capability (optimizer
    # state dicts only with flat parameters: {OPTIM_STATE_DICT, SpecCondition.ORIGINAL_PARAMETERS}).
    UNSUPPORTED_COMBINATIONS: ClassVar[Mapping[frozenset[Requirement], str]] = {}
    # Where the backend runs (conformance.suite.platforms): device kind ("cpu", "cuda") -> the torch
    # versions it runs on there, as an expectation's `when.torch` (">=2.7"; "" for every torch).
    # A device kind left out is not supported. A session whose devices or torch the backend does
    # not run on refuses it at start, once, with PLATFORM_REASONS[device kind] as the reason.
    SUPPORTED_PLATFORMS: ClassVar[Mapping[str, str]] = {"cpu": "", "cuda": ""}
    PLATFORM_REASONS: ClassVar[Mapping[str, str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        declared = getattr(cls, "CAPABILITIES", None)
        if declared is not None and not declared & {Capability.WRAPPER, Capability.COMPOSABLE}:
            raise TypeError(
                f"{cls.__name__}.CAPABILITIES must include Capability.WRAPPER and/or "
                "Capability.COMPOSABLE: scenarios need at least one way to apply sharding"
            )

    def capabilities(self) -> frozenset[Capability]:
        """Override when support depends on the environment (e.g. the device)."""
        return self.CAPABILITIES

    def supports(self, capability: Capability) -> bool:
        return capability in self.capabilities()

    def unsupported_reason(self, capability: Capability) -> str:
        return self.UNSUPPORTED_REASONS.get(capability, f"the {self.name} adapter does not provide it")

    def forms(self) -> list[ApiForm]:
        return [f for f in ApiForm if self.supports(Capability.for_form(f))]

    def unsupported_combinations(self) -> Mapping[frozenset[Requirement], str]:
        """Override when it depends on the environment, like :meth:`capabilities`."""
        return self.UNSUPPORTED_COMBINATIONS

    def mixed_precision_dtypes(self) -> tuple[torch.dtype, ...]:
        """The low-precision compute dtypes ``ShardingSpec.param_dtype`` may take here,
        preferred first (scenarios with a mixed-precision axis use the first; see
        :func:`mixed_precision_dtype`). Default: float16, then bfloat16. Override when the
        backend computes in only some of them on ``env.device`` (DeepSpeed's CPU accelerator
        has bfloat16, and float16 only on a CPU with AVX512-FP16 or AMX-FP16). Only read where
        ``MIXED_PRECISION`` is declared."""
        return (torch.float16, torch.bfloat16)


def unshard_capabilities(
    *,
    writeback: bool = False,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    recurse: bool = True,
    with_grads: bool = False,
) -> set[Capability]:
    """What an ``unshard()`` call with these options exercises (defaults: a plain read)."""
    needed = {Capability.UNSHARD}
    for wanted, capability in (
        (writeback, Capability.UNSHARD_WRITEBACK),
        (rank0_only, Capability.UNSHARD_RANK0_ONLY),
        (offload_to_cpu, Capability.UNSHARD_OFFLOAD_TO_CPU),
        (not recurse, Capability.UNSHARD_NON_RECURSIVE),
        (with_grads, Capability.UNSHARD_WITH_GRADS),
    ):
        if wanted:
            needed.add(capability)
    return needed


def mixed_precision_dtype(backend: BackendCapabilities) -> torch.dtype:
    """The ``param_dtype`` a mixed-precision scenario asks ``backend`` for: its preferred
    low-precision dtype. The contract is the same for each (compute in it, keep float32 shards
    and show float32 full parameters), so a backend is tested in a dtype it has rather than
    skipped for lack of another. Float16 for a backend that names none (it lacks
    ``MIXED_PRECISION``, which the scenario's ``require`` then reports)."""
    dtypes = backend.mixed_precision_dtypes() if backend.supports(Capability.MIXED_PRECISION) else ()
    return dtypes[0] if dtypes else torch.float16


def require(backend: BackendCapabilities, capability: Capability) -> None:
    """Skip the running test as ``unsupported: <capability>: <reason>`` unless supported.

    Every rank evaluates the same condition, so every rank skips together.
    """
    if not backend.supports(capability):
        pytest.skip(f"unsupported: {capability.value}: {backend.unsupported_reason(capability)}")


def require_all(backend: BackendCapabilities, requirements: set[Requirement]) -> None:
    """:func:`require` each capability (in declaration order), then skip if the requirements
    (capabilities and spec conditions) include a combination the backend declares unsupported
    (``UNSUPPORTED_COMBINATIONS``)."""
    ordered = sorted(requirements, key=_declaration_order)
    for requirement in ordered:
        if isinstance(requirement, Capability):
            require(backend, requirement)
    for combination, reason in backend.unsupported_combinations().items():
        if combination <= set(requirements):
            together = " with ".join(c.value for c in sorted(combination, key=_declaration_order))
            pytest.skip(f"unsupported: {together}: {reason}")


def _declaration_order(requirement: Requirement) -> tuple[int, int]:
    """Capabilities first, each kind in its declaration order."""
    if isinstance(requirement, Capability):
        return (0, list(Capability).index(requirement))
    return (1, list(SpecCondition).index(requirement))
