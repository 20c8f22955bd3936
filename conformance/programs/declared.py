"""What a backend declares, as plain data the parent can draw programs from.

The adapter lives in the ranks (its library may be heavy, or import only where it runs); the
parent asks rank 0 once per test for :class:`Declared` (:func:`declared_axes`) and draws only
programs whose every requirement it admits, by the same rule ``require_all`` applies in a
scenario: each capability declared, and no declared unsupported combination inside the
requirements.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from conformance.protocol import BackendAdapter, BackendEnv, Capability, Requirement, ShardingStrategy

_LOW_PRECISION_NAMES = {"torch.float16": "float16", "torch.bfloat16": "bfloat16"}


@dataclass(frozen=True)
class Declared:
    """One backend's declarations on this device, world size and torch."""

    name: str
    capabilities: frozenset[Capability]
    unsupported_combinations: tuple[frozenset[Requirement], ...]
    low_precision_dtypes: tuple[str, ...]
    """The mixed-precision compute dtypes (names) the backend has here, preferred first."""
    zero_grad_keeps_zeros: bool
    """Its ``zero_grad`` hook takes ``set_to_none`` (so ``set_to_none=False`` can be drawn)."""
    backend_modules: tuple[str, ...]

    def admits(self, requirements: set[Requirement]) -> bool:
        """Whether a scenario needing ``requirements`` would run (not skip as unsupported)."""
        if any(isinstance(r, Capability) and r not in self.capabilities for r in requirements):
            return False
        return not any(combination <= requirements for combination in self.unsupported_combinations)

    def strategies(self) -> list[ShardingStrategy]:
        return [s for s in ShardingStrategy if Capability.for_strategy(s) in self.capabilities]

    def has(self, capability: Capability) -> bool:
        return capability in self.capabilities


def declared_of(adapter: BackendAdapter) -> Declared:
    """``adapter``'s declarations as plain data (rank side: capabilities may depend on the device)."""
    dtypes: tuple[str, ...] = ()
    if adapter.supports(Capability.MIXED_PRECISION):
        dtypes = tuple(
            _LOW_PRECISION_NAMES[str(d)] for d in adapter.mixed_precision_dtypes() if str(d) in _LOW_PRECISION_NAMES
        )
    try:
        keeps_zeros = "set_to_none" in inspect.signature(adapter.zero_grad).parameters
    except (TypeError, ValueError):
        keeps_zeros = False
    combinations = tuple(frozenset(c) for c in adapter.unsupported_combinations())
    return Declared(
        name=adapter.name,
        capabilities=frozenset(adapter.capabilities()),
        unsupported_combinations=combinations,
        low_precision_dtypes=dtypes,
        zero_grad_keeps_zeros=keeps_zeros,
        backend_modules=tuple(type(adapter).BACKEND_MODULES),
    )


def declared_axes(selection: str) -> Declared:
    """Rank side (an SPMD call): the declarations of the ``--backend`` selection on this rank."""
    import harness
    from conformance.suite import registry

    ctx = harness.call_context()
    adapter_cls = registry.adapter_class(selection)
    adapter = adapter_cls(
        BackendEnv(rank=ctx.rank, world_size=ctx.world_size, device=ctx.device, local_rank=ctx.local_rank)
    )
    try:
        return declared_of(adapter)
    finally:
        adapter.close()


__all__ = ["Declared", "declared_axes", "declared_of"]
