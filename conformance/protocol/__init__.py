"""The backend adapter protocol: the only way scenarios talk to a sharding backend.

A scenario never imports a backend. It describes *what* to shard with a :class:`ShardingSpec`
and asks the adapter to apply it, to unshard, to produce or load state dicts, and (where the
backend allows it) to report what it is doing. Everything a backend may lack is a
:class:`Capability`; a scenario that needs one calls :func:`require`, which skips the test with
``unsupported: <capability>: <reason>`` instead of letting it pass silently.

Import every name from here (``from conformance.protocol import BackendAdapter, Capability``);
each is defined in the module of its concern:

- ``vocabulary``: the words scenarios and adapters share: strategies, forms, state-dict kinds,
  :class:`Capability`, :class:`SpecCondition`, :class:`ShardingSpec`, :class:`Misuse`,
  :class:`BackendEnv`, :class:`ShardEvent`, ``OptimizerFactory``.
- ``facts``: what a backend declares where backends differ (:class:`BackendFacts`: names,
  :class:`Refusal` per misuse with ``SEED_REFUSALS``, :class:`MixedPrecisionUnshard`,
  :class:`ShardLayout` with the exact sizes it gives) and the functions that read it.
- ``capabilities``: what a backend supports (:class:`BackendCapabilities`: capabilities,
  unsupported reasons and combinations, platforms) and what a call requires (:func:`require`,
  :func:`require_all`, :func:`unshard_capabilities`).
- ``hooks``: optional hooks with plain-torch defaults (:class:`BackendHooks`: training loop,
  per-rank storage, collective label, close).
- ``adapter``: :class:`BackendAdapter`, the public methods that check then call an adapter's
  implementation (``TEMPLATE_METHODS``), and the adoption of older adapters' public methods.
- ``helpers``: functions adapters use (:func:`submodule`, :func:`innermost_first`,
  ``strip_path_components``).
- ``proofs``: what an adapter's own tests use to prove the facts it declares
  (:data:`FACTS_NEEDING_PROOF`, :func:`declared_facts`, :class:`FactProofs`,
  :func:`raises_declared`) and the capabilities it declares missing (:func:`declared_missing`,
  :class:`AbsenceProofs`).
- ``storage``: strategies defined by storage: what a rank holds of parameters, gradients and
  optimizer state at each phase (:data:`STORAGE_CLAIMS`, :class:`Phase`, :class:`Stored`,
  :class:`Holding`), and the bounds a shard group's storage must meet.
- ``versions``: ``PROTOCOL_VERSION``, what each version added, an older adapter's shortfall.

Writing an adapter: see ``docs/writing-an-adapter.md``.
"""

from __future__ import annotations

from conformance.protocol.adapter import TEMPLATE_METHODS, BackendAdapter
from conformance.protocol.capabilities import (
    BackendCapabilities,
    mixed_precision_dtype,
    require,
    require_all,
    unshard_capabilities,
)
from conformance.protocol.facts import (
    SEED_REFUSALS,
    BackendFacts,
    MixedPrecisionUnshard,
    Permitted,
    Refusal,
    ShardLayout,
    declared_fqn,
    declared_refusal,
    expected_local_numel,
    expected_unsharded_numel,
    flat_param_fqn,
    permits,
    refused,
    unsharded_name,
)
from conformance.protocol.helpers import innermost_first, strip_path_components, submodule
from conformance.protocol.hooks import BackendHooks
from conformance.protocol.proofs import (
    FACTS_NEEDING_PROOF,
    AbsenceProofs,
    FactProofs,
    declared_facts,
    declared_missing,
    raises_declared,
)
from conformance.protocol.storage import (
    STORAGE_CLAIMS,
    Holding,
    Phase,
    StorageClaim,
    Stored,
    shard_group_size,
    share_bounds,
    storage_claim,
    stored_elements,
)
from conformance.protocol.versions import PROTOCOL_VERSION
from conformance.protocol.vocabulary import (
    ApiForm,
    BackendEnv,
    Capability,
    DeferredInit,
    Misuse,
    OptimizerFactory,
    ParameterGroups,
    Requirement,
    ShardEvent,
    ShardingSpec,
    ShardingStrategy,
    SpecCondition,
    StateDictKind,
    UnshardRequest,
)

__all__ = [
    "FACTS_NEEDING_PROOF",
    "PROTOCOL_VERSION",
    "SEED_REFUSALS",
    "STORAGE_CLAIMS",
    "TEMPLATE_METHODS",
    "AbsenceProofs",
    "ApiForm",
    "BackendAdapter",
    "BackendCapabilities",
    "BackendEnv",
    "BackendFacts",
    "BackendHooks",
    "Capability",
    "DeferredInit",
    "FactProofs",
    "Holding",
    "Misuse",
    "MixedPrecisionUnshard",
    "OptimizerFactory",
    "ParameterGroups",
    "Permitted",
    "Phase",
    "Refusal",
    "Requirement",
    "ShardEvent",
    "ShardLayout",
    "ShardingSpec",
    "ShardingStrategy",
    "SpecCondition",
    "StateDictKind",
    "StorageClaim",
    "Stored",
    "UnshardRequest",
    "declared_facts",
    "declared_fqn",
    "declared_missing",
    "declared_refusal",
    "expected_local_numel",
    "expected_unsharded_numel",
    "flat_param_fqn",
    "innermost_first",
    "mixed_precision_dtype",
    "permits",
    "raises_declared",
    "refused",
    "require",
    "require_all",
    "shard_group_size",
    "share_bounds",
    "storage_claim",
    "stored_elements",
    "strip_path_components",
    "submodule",
    "unshard_capabilities",
    "unsharded_name",
]
