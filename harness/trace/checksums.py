"""Replica checksums as data, and their comparison across ranks: pure, no torch, no collective.

A data-parallel strategy keeps some tensors the same on a group of ranks (DDP's parameters, a
DTensor's local tensor along a `Replicate()` mesh dimension, FSDP1 NO_SHARD flat parameters, ...).
Ranks seeded differently before building the model, with no broadcast, keep every collective
matched and every test green while their weights differ: the commonest silent data-parallel bug.
Each rank digests those tensors locally (`harness.rank.replicas`, which decides which tensors
are replicated and over which group) into a `ReplicaSnapshot`; `compare` (or `comparison`) puts
the ranks' snapshots side by side and names every tensor whose replicas differ, each rank's
value and the first optimizer step it differed at, where the snapshots recorded steps.

Who compares: the pytest parent, from the snapshots the ranks return in their `RankOutcome`
(`harness.session.verdict`: no collective after a test body, so a failed rank never leaves its
peers waiting); `harness.check_replicas(model)` on the ranks, after one all-gather of the
snapshots; a file-based caller (a torchrun script's ranks each writing `snapshot.to_dict()` as
JSON, one process comparing them with `compare({rank: ReplicaSnapshot.from_dict(d), ...})`).

A digest is the tensor's dtype, shape and the sum of its bit pattern read as integers (exact,
so independent of the order a reduction adds in, and of the device): replicas are equal when
their bits are, which a correct data-parallel backend gives (its replicas come from the same
all-reduce result and the same update). The float64 sum and sum of squares of the values are
there to show. A digest does not see elements that changed places (a permutation of the same
values) nor, in principle, a difference whose integer sums cancel out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from harness.message_text import group_text, ranks_text

__all__ = [
    "MAX_STEPS",
    "DriftReport",
    "ReplicaDrift",
    "ReplicaReport",
    "ReplicaSnapshot",
    "TensorChecksum",
    "TensorDrift",
    "compare",
    "comparison",
]

MAX_STEPS = 1000
"""How many optimizer steps a snapshot's history keeps (a drift that appeared later is reported
as after the last one kept)."""

_SHOWN_DRIFTS = 5  # tensors listed in a drift's text (the rest are counted)


@dataclass(frozen=True)
class TensorChecksum:
    """One rank's digest of one replicated tensor."""

    key: str
    """The tensor's identity across ranks: its root module (class and position among the test's
    roots of that class) and its FQN, e.g. "Linear#0/weight"."""
    name: str
    """The tensor as messages name it: its FQN (wrapper segments dropped), prefixed by its root's
    class when the snapshot holds several roots."""
    kind: str
    """"parameter", "buffer" or "flat parameter" (FSDP1's, with the FQNs it holds)."""
    rule: str
    """Why the rank takes it as replicated, e.g. "DDP", "DTensor Replicate() on mesh dim 0"."""
    group: tuple[int, ...]
    """The global ranks it is replicated over (this rank among them)."""
    dtype: str
    shape: tuple[int, ...]
    bits: int
    """The sum of the tensor's bit pattern read as integers of its element size (4 bytes for
    8-byte elements): the exact part of the digest."""
    total: float
    """The float64 sum of its values (what messages show)."""
    squares: float
    """The float64 sum of the squares of its values."""
    cause: str = ""
    """What makes this tensor's replicas drift, where its rule knows (a backend that never syncs
    them); empty for the usual causes, which `TensorDrift.hint` names."""

    def same_as(self, other: TensorChecksum) -> bool:
        return (self.bits, self.dtype, self.shape) == (other.bits, other.dtype, other.shape)

    def shown(self, precision: int = 6) -> str:
        return f"sum {self.total:.{precision}g}"


@dataclass
class ReplicaSnapshot:
    """One rank's digests of the tensors it takes as replicated, and their history by optimizer step."""

    rank: int
    tensors: dict[str, TensorChecksum] = field(default_factory=dict)
    """By `TensorChecksum.key`."""
    steps: list[dict[str, int]] = field(default_factory=list)
    """The `bits` of every candidate tensor (key -> bits) at each optimizer step of the test:
    `steps[0]` just before the first step, `steps[k]` just after the k-th (nested optimizers'
    steps, such as ZeroRedundancyOptimizer's inner one, are one step). At most `MAX_STEPS + 1`."""
    steps_cut: bool = False
    """More steps ran than `steps` kept."""
    note: str = ""
    """What the rank could not check (a tensor it could not read), else empty."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (`from_dict` reads it back)."""
        return {
            "rank": self.rank,
            "tensors": {key: asdict(checksum) for key, checksum in self.tensors.items()},
            "steps": self.steps,
            "steps_cut": self.steps_cut,
            "note": self.note,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplicaSnapshot:
        tensors = {}
        for key, value in data.get("tensors", {}).items():
            fields = dict(value)
            fields["group"] = tuple(fields["group"])
            fields["shape"] = tuple(fields["shape"])
            tensors[key] = TensorChecksum(**fields)
        return cls(
            int(data["rank"]),
            tensors,
            [dict(step) for step in data.get("steps", [])],
            bool(data.get("steps_cut", False)),
            str(data.get("note", "")),
        )


@dataclass(frozen=True)
class TensorDrift:
    """One replicated tensor whose replicas differ across the ranks of its group."""

    name: str
    kind: str
    rule: str
    group: tuple[int, ...]
    checksums: dict[int, TensorChecksum]
    """By rank: every rank of the group that reported it."""
    first_step: int | None
    """The index in the ranks' step history from which on the replicas differed: 0 before the
    first optimizer step, k after the k-th; `steps` when they agreed at every step recorded and
    differed only at the end; None when no step was recorded."""
    steps: int
    """How many step snapshots every rank of the group recorded."""
    steps_cut: bool = False
    watched_from: int = 0
    """The first step snapshot that held the tensor on every rank (a model built after the first
    steps is watched from its first forward on)."""

    def when(self) -> str:
        """When the replicas first differed, as far as the history tells."""
        if self.first_step is None:
            return "first differed: unknown (no optimizer step recorded)"
        if self.first_step == 0:
            return "first differed before the first optimizer step"
        if self.first_step == self.watched_from and self.first_step < self.steps:
            return f"first differed after optimizer step {self.first_step}, when it was first watched"
        if self.first_step < self.steps:
            before = "before the first" if self.first_step == 1 else f"after step {self.first_step - 1}"
            return f"first differed after optimizer step {self.first_step} (equal {before})"
        last = self.steps - 1
        if self.steps_cut:
            return f"first differed after optimizer step {last}, the last one recorded"
        if last == 0:
            return "first differed after the start of the first optimizer step"
        return f"first differed after the last optimizer step ({last}), by the end of the test"

    def values(self) -> str:
        """Each rank's value, ranks with equal replicas together: "rank 0 sum 1.27 vs rank 1 sum -1.18"."""
        classes: list[list[int]] = []
        for rank in sorted(self.checksums):
            for members in classes:
                if self.checksums[members[0]].same_as(self.checksums[rank]):
                    members.append(rank)
                    break
            else:
                classes.append([rank])
        return " vs ".join(f"{ranks_text(members)} {self._shown(members[0], classes)}" for members in classes)

    def _shown(self, rank: int, classes: list[list[int]]) -> str:
        """A value that tells the classes apart: the sum, then the norm, then the bits, as needed."""
        checksums = [self.checksums[members[0]] for members in classes]
        mine = self.checksums[rank]
        if len({(c.dtype, c.shape) for c in checksums}) > 1:
            return f"{mine.dtype} {list(mine.shape)} {mine.shown()}"
        for precision in (4, 8, 17):
            if len({c.shown(precision) for c in checksums}) == len(checksums):
                return mine.shown(precision)
        if len({c.squares for c in checksums}) == len(checksums):
            return f"{mine.shown(17)} norm {math.sqrt(max(mine.squares, 0.0)):.17g}"
        return f"{mine.shown(17)} bits {mine.bits:#x}"

    def hint(self) -> str:
        """Where such a drift usually comes from."""
        cause = next((c.cause for c in self.checksums.values() if c.cause), "")
        if cause:
            return cause
        if self.kind == "buffer":
            return (
                "buffers no one syncs differ once a forward updates them from each rank's batch: "
                "SyncBatchNorm, or DDP's broadcast_buffers=True"
            )
        if self.first_step == 0 or self.first_step == self.watched_from:
            return (
                "replicas that differ before the first step were built differently: seed every rank "
                "alike before building the model, or broadcast its state from one rank (DDP does)"
            )
        return (
            "replicas that agreed and then differed were updated differently by rank: a gradient, a "
            "learning rate or a loss scale that is not the same on every rank"
        )

    def describe(self) -> str:
        first = next(iter(self.checksums.values()))
        return (
            f"{self.name} ({self.kind}, {first.dtype} {list(first.shape)}, replicated over ranks "
            f"{group_text(self.group)}: {self.rule}): {self.values()}; {self.when()}"
        )


@dataclass(frozen=True)
class DriftReport:
    """Every replicated tensor whose replicas differ (`compare`)."""

    drifts: tuple[TensorDrift, ...]
    compared: int
    """How many replicated tensors were compared (a tensor compared in several groups counts once per group)."""

    def heading(self) -> str:
        count = len(self.drifts)
        return (
            f"replicas drifted: {count} of {self.compared} replicated tensor{'s' * (self.compared != 1)} "
            f"differ{'s' * (count == 1)} across ranks"
        )

    def line(self) -> str:
        """One line: the first tensor, its values and when it first differed."""
        first = self.drifts[0]
        more = len(self.drifts) - 1
        rest = f"; and {more} more tensor{'s' * (more != 1)}" if more else ""
        return f"replicas drifted: {first.name}: {first.values()}, {first.when()}{rest}"

    def describe(self) -> str:
        lines = [self.heading()]
        lines += [f"  {drift.describe()}" for drift in self.drifts[:_SHOWN_DRIFTS]]
        if len(self.drifts) > _SHOWN_DRIFTS:
            lines.append(f"  ... and {len(self.drifts) - _SHOWN_DRIFTS} more")
        lines += [f"  ({hint})" for hint in dict.fromkeys(drift.hint() for drift in self.drifts)]
        return "\n".join(lines)


@dataclass(frozen=True)
class ReplicaReport:
    """What a comparison found: the tensors compared, and the drift, if any."""

    compared: int
    names: tuple[str, ...]
    """The replicated tensors compared, by name, in the order found."""
    ranks: tuple[int, ...]
    """The ranks whose snapshots were compared."""
    drift: DriftReport | None = None
    notes: tuple[str, ...] = ()
    """What some rank could not check ("rank 1: ...")."""

    @property
    def ok(self) -> bool:
        return self.drift is None

    def describe(self) -> str:
        if self.drift is not None:
            return self.drift.describe()
        text = (
            f"replicas agree: {self.compared} replicated tensor{'s' * (self.compared != 1)} on {ranks_text(self.ranks)}"
        )
        return "\n".join([text, *self.notes])


class ReplicaDrift(AssertionError):
    """Replicas differ across ranks (`harness.check_replicas`); `report` holds every tensor that drifted."""

    def __init__(self, report: DriftReport) -> None:
        super().__init__(report.describe())
        self.report = report


def compare(snapshots: Mapping[int, ReplicaSnapshot | Mapping[str, Any]]) -> DriftReport | None:
    """The drift among the ranks' snapshots (by rank; a snapshot or its `to_dict()`), None when
    every replicated tensor agrees on every rank of its group that reported it."""
    return comparison(snapshots).drift


def comparison(snapshots: Mapping[int, ReplicaSnapshot | Mapping[str, Any]]) -> ReplicaReport:
    """Compare the ranks' snapshots: each tensor on the ranks that took it as replicated over the
    same group (a rank that did not report it, or named another group for it, is left out of
    that comparison)."""
    snaps = {
        rank: snap if isinstance(snap, ReplicaSnapshot) else ReplicaSnapshot.from_dict(snap)
        for rank, snap in sorted(snapshots.items())
    }
    by_key: dict[str, dict[int, TensorChecksum]] = {}
    for rank, snap in snaps.items():
        for key, checksum in snap.tensors.items():
            by_key.setdefault(key, {})[rank] = checksum
    drifts: list[TensorDrift] = []
    names: list[str] = []
    compared = 0
    for key, per_rank in by_key.items():
        by_group: dict[tuple[int, ...], list[int]] = {}
        for rank, checksum in per_rank.items():
            if rank in checksum.group:
                by_group.setdefault(checksum.group, []).append(rank)
        for group, ranks in by_group.items():
            if len(ranks) < 2:
                continue
            compared += 1
            first = per_rank[ranks[0]]
            if first.name not in names:
                names.append(first.name)
            if all(first.same_as(per_rank[rank]) for rank in ranks[1:]):
                continue
            first_step, steps, cut, watched = _first_step(key, [snaps[rank] for rank in ranks])
            checksums = {rank: per_rank[rank] for rank in ranks}
            drift = TensorDrift(first.name, first.kind, first.rule, group, checksums, first_step, steps, cut, watched)
            drifts.append(drift)
    notes = tuple(f"rank {rank}: {snap.note}" for rank, snap in snaps.items() if snap.note)
    drift = DriftReport(tuple(drifts), compared) if drifts else None
    return ReplicaReport(compared, tuple(names), tuple(snaps), drift, notes)


def _first_step(key: str, snaps: list[ReplicaSnapshot]) -> tuple[int | None, int, bool, int]:
    """(the step index from which on the replicas of `key` differ, the steps every rank recorded,
    whether the history was cut, the first index that held the tensor on every rank); the first
    is None when no step holds the tensor on every rank."""
    steps = min(len(snap.steps) for snap in snaps)
    cut = any(snap.steps_cut for snap in snaps)
    last_agreed: int | None = None
    first_seen: int | None = None
    for index in range(steps):
        values = [snap.steps[index].get(key) for snap in snaps]
        if any(value is None for value in values):
            continue
        if first_seen is None:
            first_seen = index
        if len(set(values)) == 1:
            last_agreed = index
    if first_seen is None:
        return None, steps, cut, 0
    return (first_seen if last_agreed is None else last_agreed + 1), steps, cut, first_seen
