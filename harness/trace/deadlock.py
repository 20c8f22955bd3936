"""A wait cycle across process groups: each rank of the cycle waits, inside a collective that never
returned, for a member that is itself waiting in another group's collective.

The classic case: two groups with the same members created one after the other, taken in opposite
orders on two ranks. Neither call is a mismatch of its own (each group's stream, compared alone,
only misses a call), and neither rank waits alone; the wait-for relation between the ranks' stuck
calls is what says it can never end. Rank r, stuck in its k-th collective on group G, waits for
every member of G that has issued fewer than k + 1 collectives on G; a cycle of such waits among
ranks stuck in collectives is a deadlock (a rank inside a blocking call issues nothing more).
Read from the ranks' traces, while they run (`harness.trace.one_sided`) or after (`harness.trace.divergence`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from harness.trace.groups import GroupNames
from harness.trace.records import CollectiveRecord

__all__ = ["Deadlock", "find_deadlock"]


@dataclass(frozen=True)
class Wait:
    """One edge of the cycle: `rank`, inside `call`, waits for `waits_for` to issue its part of it."""

    rank: int
    call: CollectiveRecord
    waits_for: int


@dataclass(frozen=True)
class Deadlock:
    waits: tuple[Wait, ...]
    """The cycle, starting at its lowest rank; each wait's `waits_for` is the next wait's rank."""

    @property
    def ranks(self) -> list[int]:
        return [wait.rank for wait in self.waits]

    def describe(self, names: GroupNames) -> str:
        """ "deadlock: rank 0 waits in all_reduce on group #2 [0, 1] (t.py:12) for rank 1, which
        waits in all_reduce on group #1 [0, 1] (t.py:15) for rank 0"."""
        parts = []
        for number, wait in enumerate(self.waits):
            where = f" ({wait.call.site})" if wait.call.site else ""
            text = f"waits in {wait.call.op} on group {names.name(wait.call)}{where} for rank {wait.waits_for}"
            parts.append(f"rank {wait.rank} {text}" if number == 0 else f"which {text}")
        return "deadlock: " + ", ".join(parts)


def find_deadlock(traces: dict[int, Iterable[CollectiveRecord]], stuck: dict[int, CollectiveRecord]) -> Deadlock | None:
    """The wait cycle among the `stuck` ranks (rank -> the group collective it is inside), or None.

    `traces`: every rank's records so far (in any order), for how many collectives each member
    issued on each group."""
    issued: dict[int, dict[tuple, list[int]]] = {}
    for rank, records in traces.items():
        by_group = issued.setdefault(rank, {})
        for record in records:
            if record.on_group and not record.skipped:
                by_group.setdefault(record.group_key, []).append(record.index)
    waits_for: dict[int, list[int]] = {}
    for rank, call in stuck.items():
        if not call.on_group:
            continue
        position = sum(1 for index in issued.get(rank, {}).get(call.group_key, []) if index < call.index)
        waits_for[rank] = [
            member
            for member in call.group
            if member != rank and member in stuck and len(issued.get(member, {}).get(call.group_key, [])) <= position
        ]
    for start in sorted(waits_for):
        cycle = _cycle_from(start, waits_for)
        if cycle:
            lowest = cycle.index(min(cycle))
            cycle = cycle[lowest:] + cycle[:lowest]
            edges = zip(cycle, cycle[1:] + cycle[:1])
            return Deadlock(tuple(Wait(rank, stuck[rank], after) for rank, after in edges))
    return None


def _cycle_from(start: int, waits_for: dict[int, list[int]]) -> list[int]:
    """A cycle of the wait-for graph reachable from `start` (its ranks in order), or []."""
    path: list[int] = []
    on_path: set[int] = set()
    done: set[int] = set()

    def visit(rank: int) -> list[int]:
        if rank in on_path:
            return path[path.index(rank) :]
        if rank in done:
            return []
        path.append(rank)
        on_path.add(rank)
        for member in waits_for.get(rank, []):
            found = visit(member)
            if found:
                return found
        path.pop()
        on_path.discard(rank)
        done.add(rank)
        return []

    return visit(start)
