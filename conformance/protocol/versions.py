"""Protocol versions: the current one, what each added, and what an older adapter misses.

An adapter states the version it was written for (``BackendAdapter.PROTOCOL_VERSION``; unstated
means 1). An older adapter keeps running: capabilities added since are simply not declared (the
scenarios needing them skip as unsupported), hooks added since run with their defaults, facts
added since are held to the seeds'. The conformance plugin turns :func:`shortfall` into one
warning per backend at the end of the run, with the number of scenarios it cost. A strategy
whose meaning moved in a later version is named there too, for an adapter that declares it.

Also what a user reports when asking for help: the package version, the protocol version and the
torch range CI proves (:func:`version_line`, shown by ``python -m conformance --version`` and in
the suite's session header). docs/changelog.md says, per protocol version, what an adapter
written for the previous one must change.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

from conformance.protocol.adapter import BackendAdapter
from conformance.protocol.vocabulary import Capability, ShardingStrategy

# The protocol's version. An adapter states the one it was written for (``PROTOCOL_VERSION``);
# an older one keeps running, with one warning naming what it does not declare of what came
# later and how many scenarios that costs (:func:`shortfall`).
PROTOCOL_VERSION = 9

# The oldest and the newest torch CI proves (.ci/run hands each to .ci/torch-leg; the main leg's
# pin lies between): a torch outside them may work, but nothing here says it does.
# tests/conformance_tests/test_versions.py holds these to .ci/run.
SUPPORTED_TORCH: tuple[str, str] = ("2.6.0", "2.14.1")

# The distribution name (pyproject.toml), which is not the import name.
_DISTRIBUTION = "fsdp-conformance"


def package_version() -> str:
    """The installed package's version; a checkout imported without being installed has none,
    and says how to get one rather than inventing it."""
    try:
        return metadata.version(_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def version_line() -> str:
    """One line for a bug report: the package, the protocol, the supported torch range and the
    torch this process runs (which may lie outside it)."""
    import torch  # the torch this process runs, read when the line is asked for

    oldest, newest = SUPPORTED_TORCH
    return (
        f"{_DISTRIBUTION} {package_version()}, adapter protocol {PROTOCOL_VERSION}, "
        f"torch {oldest} to {newest} (this one: {torch.__version__})"
    )


@dataclass(frozen=True)
class MovedMeaning:
    """A strategy that kept its name but changed what it means: an adapter written before the
    change that declares it may now be held to something its backend does not do."""

    strategy: ShardingStrategy
    change: str  # what moved and what to declare instead, as the warning says it


@dataclass(frozen=True)
class Additions:
    """What one protocol version added."""

    capabilities: frozenset[Capability] = frozenset()
    hooks: tuple[str, ...] = ()  # optional methods with defaults
    facts: tuple[str, ...] = ()  # declared class attributes with defaults (the seeds')
    signatures: tuple[str, ...] = ()  # implementations whose arguments changed: an older one keeps its form
    moved: tuple[MovedMeaning, ...] = ()  # strategies whose meaning changed (the name stayed)


# Version 1: the first published protocol (forms, the four FSDP strategies, mixed precision,
# offload, ignored modules, flat parameters, unshard options, state dicts, exec order, 2-D,
# introspection).
ADDED: dict[int, Additions] = {
    2: Additions(
        capabilities=frozenset(
            {Capability.UNITS, Capability.UNMANAGED_ROOT, Capability.MIXED_STRATEGIES, Capability.SHARD_OPTIM_STATE}
        ),
        hooks=(
            "make_optimizer",
            "zero_grad",
            "backward",
            "step",
            "local_shard",
            "set_local_shard",
            "local_grad_shard",
            "set_local_grad_shard",
            "mixed_precision_dtypes",
            "collective_label",
            "close",
        ),
    ),
    3: Additions(
        capabilities=frozenset({Capability.NATIVE_CHECKPOINT}),
        facts=("FLAT_PARAMETER_NAME", "REFUSALS", "MIXED_PRECISION_UNSHARD"),
    ),
    # Seed strength (issue 23): exact storage sizes, raw names, the 2-D layout of non-TP values.
    4: Additions(
        capabilities=frozenset({Capability.INTROSPECT_STORAGE}),
        facts=("SHARD_LAYOUT", "UNSHARDED_NAME_PREFIX", "NON_TP_2D_STATE_DICT_MESH"),
    ),
    # Sharding by storage (issue 32): ZeRO-2, what a rank stores of gradients and optimizer
    # state, mixed-precision training, gradient accumulation.
    # Before it, docs/writing-an-adapter.md mapped DeepSpeed's ZeRO stage 2 onto SHARD_GRAD_OP
    # (its parameters stay replicated); from it every strategy is a storage claim
    # (conformance.protocol.storage) checked for every adapter, whatever its version, and
    # SHARD_GRAD_OP claims what torch FSDP's SHARD_GRAD_OP stores.
    5: Additions(
        capabilities=frozenset({Capability.SHARD_GRAD_AND_OPTIM_STATE, Capability.REDUCE_DTYPE, Capability.NO_SYNC}),
        hooks=("local_optim_state",),
        facts=("BACKEND_MODULES",),
        moved=(
            MovedMeaning(
                ShardingStrategy.SHARD_GRAD_OP,
                "before version 5 the adapter guide mapped DeepSpeed ZeRO stage 2 onto SHARD_GRAD_OP; from "
                "version 5 it means what torch FSDP's SHARD_GRAD_OP stores, parameters sharded at rest and "
                "kept whole from forward until backward, gradients and optimizer state sharded, and the "
                "storage checks hold it to that: a ZeRO-2 backend, which keeps its parameters whole on every "
                "rank, must declare SHARD_GRAD_AND_OPTIM_STATE instead",
            ),
        ),
    ),
    # One value per call (issue 42): ``_unshard(model, request)`` takes an UnshardRequest; an
    # adapter written for an earlier version is still called with the options as keywords.
    6: Additions(signatures=("_unshard",)),
    # Real training loops (issue 40): clipping by the total norm over ranks.
    7: Additions(capabilities=frozenset({Capability.GRADIENT_CLIPPING}), hooks=("clip_grad_norm",)),
    # Real training loops (issue 40): optimizer parameter groups by name.
    8: Additions(capabilities=frozenset({Capability.PARAMETER_GROUPS}), hooks=("make_optimizer_with_groups",)),
    # Real training loops (issue 40): a model built on the meta device, materialized where the
    # backend does it (the default materializes it before sharding).
    9: Additions(hooks=("_shard_deferred",)),
}
# What changed in each signature of ``Additions.signatures``, as the warning says it.
_CHANGES = {
    "_unshard": "from version 6 it takes one UnshardRequest: _unshard(self, model, request), the options as "
    "request.fqn, request.writeback, ...",
}
assert max(ADDED) == PROTOCOL_VERSION, "conformance.protocol.versions.ADDED must describe every protocol version"

# The title of each version's section in docs/changelog.md ("### Protocol 5: ..."), which says what
# an adapter written for the previous version must change. A new version cannot be published
# without one (this assert); tests/conformance_tests/test_versions.py holds the file to it.
CHANGELOG: dict[int, str] = {
    1: "the first published protocol",
    2: "structure, ZeRO-1 and the training-loop hooks",
    3: "template methods, native checkpoints and backend facts",
    4: "exact storage and raw names",
    5: "strategies are storage claims; ZeRO-2, reduce dtype, gradient accumulation",
    6: "one UnshardRequest per unshard",
    7: "gradient clipping",
    8: "optimizer parameter groups",
    9: "deferred initialization",
}
assert set(CHANGELOG) == set(range(1, PROTOCOL_VERSION + 1)), (
    "conformance.protocol.versions.CHANGELOG (and docs/changelog.md) must have an entry for every protocol version"
)


@dataclass(frozen=True)
class Shortfall:
    """What an adapter written for ``version`` does not declare of what later versions added.

    ``capabilities`` are those it neither declares nor declares missing: one it lists in
    ``UNSUPPORTED_REASONS`` is a declaration (its author knows of it and says why it is
    missing), not a shortfall, and the scenarios it skips are not counted against the version.
    """

    version: int
    capabilities: frozenset[Capability] = frozenset()
    hooks: tuple[str, ...] = ()
    facts: tuple[str, ...] = ()
    signatures: tuple[str, ...] = ()
    moved: tuple[MovedMeaning, ...] = ()  # those of later versions' moved strategies it declares

    def costs(self, skip_reason: str) -> bool:
        """Whether a test skipped with ``skip_reason`` was lost to an undeclared capability."""
        return skip_reason.startswith("unsupported: ") and any(
            capability.value in skip_reason for capability in self.capabilities
        )

    def describe(self, name: str, cost: int) -> str:
        parts = []
        if self.capabilities:
            listed = ", ".join(sorted(c.name for c in self.capabilities))
            parts.append(
                f"does not declare the capabilities {listed} ({cost} scenarios skipped as unsupported for them)"
            )
        if self.hooks:
            parts.append(f"runs the default {', '.join(self.hooks)}")
        if self.facts:
            parts.append(f"is held to the seeds' {', '.join(self.facts)}")
        for method in self.signatures:
            change = _CHANGES[method]
            parts.append(f"implements {method} in its version-{self.version} form, which still runs ({change})")
        for moved in self.moved:
            parts.append(f"declares {moved.strategy.name}, whose meaning moved ({moved.change})")
        return (
            f"backend {name!r} was written for protocol version {self.version} (current: {PROTOCOL_VERSION}): it "
            + "; it ".join(parts)
            + f". Review docs/writing-an-adapter.md, declare what it has and set PROTOCOL_VERSION = {PROTOCOL_VERSION}"
        )


def shortfall(adapter_cls: type[BackendAdapter]) -> Shortfall | None:
    """None for an adapter written for the current protocol, or for an older one that misses
    nothing later versions added (it declares or declares missing every later capability, and
    sets every later hook and fact itself)."""
    version = adapter_cls.PROTOCOL_VERSION
    if version >= PROTOCOL_VERSION:
        return None
    later = [ADDED[v] for v in range(version + 1, PROTOCOL_VERSION + 1)]
    declared = adapter_cls.CAPABILITIES | set(adapter_cls.UNSUPPORTED_REASONS)
    capabilities = frozenset().union(*(a.capabilities for a in later)) - declared
    hooks = tuple(
        hook for a in later for hook in a.hooks if getattr(adapter_cls, hook) is getattr(BackendAdapter, hook)
    )
    facts = tuple(
        fact for a in later for fact in a.facts if getattr(adapter_cls, fact) is getattr(BackendAdapter, fact)
    )
    signatures = tuple(method for a in later for method in a.signatures)
    # Read from the class, as the capabilities above are: a strategy only some environments
    # declare (capabilities()) is still one its author wrote for the old meaning.
    moved = tuple(
        change
        for a in later
        for change in a.moved
        if Capability.for_strategy(change.strategy) in adapter_cls.CAPABILITIES
    )
    if not (capabilities or hooks or facts or signatures or moved):
        return None
    return Shortfall(version, capabilities, hooks, facts, signatures, moved)
