"""Proving declared facts: what an adapter's own tests need to back every fact it declares.

A backend fact an adapter declares (:class:`~conformance.protocol.facts.BackendFacts`;
docs/writing-an-adapter.md, "Backend facts") changes what the scenarios accept, so each one is
a claim about the backend, to be proven by a test that calls the real library, not the adapter.
tests/conformance_tests/test_declared_facts.py proves the built-ins' facts with these helpers; an
adapter package outside this repository proves its own with them too:

- :data:`FACTS_NEEDING_PROOF`: the facts that need a proof;
- :func:`declared_facts`: which of them an adapter class sets itself (a refusal counts per
  misuse, ``REFUSALS.<MISUSE>``): what a meta-test compares with the proofs it has;
- :class:`FactProofs`: a registry of proofs by backend and fact, with the world size each runs
  at, that says which declared facts lack a proof and which proofs outlived their declaration;
- :func:`raises_declared`: ``pytest.raises`` for exactly the refusal an adapter declares;
- :func:`declared_missing` and :class:`AbsenceProofs`: the same for the capabilities an adapter
  declares missing ("unsupported" is a claim too: each gap is proven on the real library).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import pytest
import torch

from conformance.protocol.adapter import BackendAdapter
from conformance.protocol.capabilities import Capability
from conformance.protocol.facts import BackendFacts, Refusal, declared_refusal
from conformance.protocol.vocabulary import BackendEnv, Misuse

# One proof: it runs on every rank of a world (``rank``, ``world_size``, the rank's ``device``)
# and fails unless the real library behaves as the adapter declares.
Proof = Callable[[int, int, torch.device], None]

# The declared facts that need a proof: each changes what the scenarios accept.
FACTS_NEEDING_PROOF = (
    "FLAT_PARAMETER_NAME",
    "MIXED_PRECISION_UNSHARD",
    "REFUSALS",
    "SHARD_LAYOUT",
    "UNSHARDED_NAME_PREFIX",
    "NON_TP_2D_STATE_DICT_MESH",
)


def declared_facts(adapter_cls: type[BackendFacts]) -> set[str]:
    """The facts of :data:`FACTS_NEEDING_PROOF` an adapter class (or a base of it other than the protocol's
    classes, whose defaults are the seeds') sets itself. A refusal counts per misuse
    (``REFUSALS.<MISUSE>``): the misuses it leaves out are held to the seeds' refusals and need
    no proof."""
    owners = [klass for klass in adapter_cls.__mro__ if klass not in BackendAdapter.__mro__]
    declared = {fact for fact in FACTS_NEEDING_PROOF if any(fact in vars(klass) for klass in owners)}
    facts = declared - {"REFUSALS"}
    if "REFUSALS" in declared:
        facts |= {f"REFUSALS.{misuse.name}" for misuse in adapter_cls.REFUSALS}
    return facts


ClaimT = TypeVar("ClaimT", str, Capability)


def _claim_name(claim: str | Capability) -> str:
    return claim.name if isinstance(claim, Capability) else claim


@dataclass
class _ProofRegistry(Generic[ClaimT]):
    """Proofs by (backend name, claim), each with the world size it runs at: what fact and
    absence proofs share."""

    proofs: dict[tuple[str, ClaimT], Proof] = field(default_factory=dict)
    world_sizes: dict[tuple[str, ClaimT], int] = field(default_factory=dict)

    def _register(self, backend: str, claims: tuple[ClaimT, ...], world_size: int) -> Callable[[Proof], Proof]:
        def register(proof: Proof) -> Proof:
            for claim in claims:
                if (backend, claim) in self.proofs:
                    held = self.proofs[backend, claim].__name__
                    raise ValueError(f"{backend}: {_claim_name(claim)} already has a proof ({held})")
                self.proofs[backend, claim] = proof
                self.world_sizes[backend, claim] = world_size
            return proof

        return register

    def _proven(self, backend: str) -> set[ClaimT]:
        return {claim for name, claim in self.proofs if name == backend}

    def at(self, world_size: int) -> list[tuple[str, ClaimT]]:
        """The (backend, claim) pairs whose proofs run at ``world_size``, sorted by name (stable
        test ids)."""
        return sorted(
            (key for key, size in self.world_sizes.items() if size == world_size),
            key=lambda key: (key[0], _claim_name(key[1])),
        )


@dataclass
class FactProofs(_ProofRegistry[str]):
    """Proofs of declared facts, by (backend name, fact), each with the world size it runs at.

    Register with the :meth:`proves` decorator; run :meth:`at` a world size from a distributed
    test; in a meta-test, :meth:`unproven` and :meth:`stale` must both be empty for every
    backend the package declares facts for.
    """

    def proves(self, backend: str, fact: str, world_size: int = 2) -> Callable[[Proof], Proof]:
        """Decorator: the proof that ``backend`` really has ``fact`` (``"SHARD_LAYOUT"``, or
        ``"REFUSALS.<MISUSE>"`` per refusal), run at ``world_size`` ranks."""
        return self._register(backend, (fact,), world_size)

    def unproven(self, backend: str, adapter_cls: type[BackendFacts]) -> set[str]:
        """Facts ``adapter_cls`` declares that no proof registered for ``backend`` backs."""
        return declared_facts(adapter_cls) - self._proven(backend)

    def stale(self, backend: str, adapter_cls: type[BackendFacts]) -> set[str]:
        """Proofs registered for ``backend`` of facts ``adapter_cls`` no longer declares: delete them."""
        return self._proven(backend) - declared_facts(adapter_cls)


def raises_declared(backend: BackendFacts | type[BackendFacts], misuse: Misuse) -> AbstractContextManager[Any]:
    """``pytest.raises`` for exactly what ``backend`` (an adapter or its class) declares for
    ``misuse``: one of the declared exception types, its message matching the declared pattern
    (the seeds' refusal where it declares none)."""
    refusal = declared_refusal(backend, misuse)
    if not isinstance(refusal, Refusal):
        raise TypeError(
            f"{misuse.value}: the backend declares it {refusal}, not a refusal: prove it by running the "
            "call on the library and checking the values it gives"
        )
    return pytest.raises(refusal.types, match=refusal.pattern)


# The device kinds an adapter may be asked about: a gap declared on either needs its proof.
DEVICE_KINDS = ("cpu", "cuda")


def declared_missing(adapter_cls: type[BackendAdapter], device: str, world_size: int = 2) -> frozenset[Capability]:
    """The capabilities ``adapter_cls`` declares missing on ``device`` (``"cpu"``, ``"cuda"``), read
    from its ``capabilities()`` without running its constructor (which may need a process group
    or the library's device): the adapter is given its :class:`BackendEnv` only, as rank 0 of a
    world of ``world_size``."""
    adapter = adapter_cls.__new__(adapter_cls)
    BackendAdapter.__init__(adapter, BackendEnv(rank=0, world_size=world_size, device=torch.device(device)))
    return frozenset(Capability) - adapter.capabilities()


@dataclass
class AbsenceProofs(_ProofRegistry[Capability]):
    """Proofs that declared gaps are real, by (backend name, capability), each with the world size
    it runs at: a test that tries the feature on the real library and shows it absent, refused or
    broken (docs/writing-an-adapter.md, "Proving a declared gap").

    Register with :meth:`proves` (one proof may back several capabilities that share a cause,
    say every unit-scoped one of a backend without units); run :meth:`at` a world size from a
    distributed test; in a meta-test, :meth:`unproven` and :meth:`stale` must both be empty.
    """

    def proves(self, backend: str, *capabilities: Capability, world_size: int = 2) -> Callable[[Proof], Proof]:
        """Decorator: the proof that ``backend`` really lacks each of ``capabilities``."""
        if not capabilities:
            raise ValueError(f"{backend}: name the capabilities the proof shows missing")
        return self._register(backend, capabilities, world_size)

    def unproven(
        self, backend: str, adapter_cls: type[BackendAdapter], devices: tuple[str, ...] = DEVICE_KINDS
    ) -> set[Capability]:
        """Capabilities ``adapter_cls`` declares missing on any of ``devices`` that no proof
        registered for ``backend`` backs."""
        return _missing_on_any(adapter_cls, devices) - self._proven(backend)

    def stale(
        self, backend: str, adapter_cls: type[BackendAdapter], devices: tuple[str, ...] = DEVICE_KINDS
    ) -> set[Capability]:
        """Proofs registered for ``backend`` of capabilities ``adapter_cls`` declares missing on none
        of ``devices``: the gap was closed, delete the proof."""
        return self._proven(backend) - _missing_on_any(adapter_cls, devices)


def _missing_on_any(adapter_cls: type[BackendAdapter], devices: tuple[str, ...]) -> set[Capability]:
    return set().union(*(declared_missing(adapter_cls, device) for device in devices))
