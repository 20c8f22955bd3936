"""One-sided collectives in seconds: while a test runs, notice a rank waiting in a collective that
can never complete, instead of waiting for the collective timeout (parent side).

Why: one rank runs an extra batch and waits alone in an all-reduce that its peers, already done
with the test, will never issue. gloo and NCCL only give up at the process group's timeout (30 s by
default here, 10 minutes in plain torch); the traces already show it is hopeless.

A wait is hopeless when a rank's last collective has not returned and, for its process group
(`CollectiveRecord.group_key`: groups with the same members are told apart), either
  * every other member has finished the test (answered or died) without ever issuing a collective
    at that position on that group ("waits alone"); a member that called a collective on a group
    it is not a member of instead is named; or
  * every other member is also inside its call at that same position (still waiting, or it left
    the test from inside it: gloo raised or aborted there), and the calls disagree on op, dtypes,
    shapes or the arguments that must agree, or what they send does not pair up with what they
    expect (`harness.trace.exchange`) ("can never match"); or
  * the rank is part of a wait cycle across groups (`harness.trace.deadlock`): it waits for a
    member that waits, in another group's collective, for it ("deadlock").
The last two must hold unchanged over `settle_s` (a mismatch gloo does not detect hangs; one it
detects aborts a rank, and the other waits). Point-to-point calls, calls on single-member groups and
calls a fault skipped are never judged.

The trace files are read incrementally (only what was appended since the last look), so a long
test costs the parent a few small reads per poll.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

from harness.trace.deadlock import find_deadlock
from harness.trace.exchange import exchange_mismatch
from harness.trace.groups import GroupNames
from harness.trace.records import CollectiveRecord, RankTrace

__all__ = ["OneSidedWatch"]


@dataclass
class _Tail:
    """What has been read of one rank's trace file so far."""

    offset: int = 0
    partial: bytes = b""


class OneSidedWatch:
    """Reads the ranks' trace files during a test; `check` says when a wait is hopeless."""

    def __init__(self, trace_paths: dict[int, str], settle_s: float = 1.0, truncate: bool = True) -> None:
        """Create before the test is dispatched: unless `truncate` is false (the files are being
        written already), it empties the files, so that nothing of the previous test is read as
        this one's (the ranks truncate them again when they begin)."""
        for path in trace_paths.values() if truncate else ():
            with contextlib.suppress(FileNotFoundError):
                os.truncate(path, 0)
        self.trace_paths = trace_paths
        self.settle_s = settle_s
        self._tails = {rank: _Tail() for rank in trace_paths}
        self._traces = {rank: RankTrace() for rank in trace_paths}
        self._first_seen: dict[str, tuple[object, float]] = {}
        """Per kind of judgement that must settle ("mismatch", "deadlock"): what it found, and since when."""

    def check(self, finished: set[int], waiting: set[int]) -> str | None:
        """Why the waiting ranks can never finish, or None while they still might.

        `finished`: ranks whose result is in (passed, failed, or lost); `waiting`: the others.
        """
        for rank in self.trace_paths:
            self._read(rank)
        names = GroupNames(record for trace in self._traces.values() for record in trace.by_index.values())
        stuck = {rank: record for rank in sorted(waiting) if (record := self._stuck(rank)) is not None}
        for rank, record in stuck.items():
            others = [member for member in record.group if member != rank]
            position = self._position(rank, record)
            if others and all(member in finished and self._count(member, record) <= position for member in others):
                issued = ", ".join(f"rank {member} {self._count(member, record)}" for member in others)
                instead = "".join(
                    f"; rank {member} called {names.non_member_call(call)}"
                    for member in others
                    if (call := self._non_member_call(member, record)) is not None
                )
                return (
                    f"waited alone in collective #{position + 1} on group {names.name(record)} "
                    f"({_short(record)}): the other members finished without issuing it "
                    f"(collectives they issued on that group: {issued}){instead}"
                )
        return self._mismatch(stuck, finished, names) or self._deadlock(stuck, names)

    # -------------------------------------------------------------------------------- internals

    def _mismatch(self, stuck: dict[int, CollectiveRecord], finished: set[int], names: GroupNames) -> str | None:
        for rank, record in stuck.items():
            position = self._position(rank, record)
            members = list(record.group)
            peers = {member: stuck.get(member) or self._left_inside(member, finished, record) for member in members}
            if len(members) < 2 or any(peer is None or peer.group_key != record.group_key for peer in peers.values()):
                continue
            calls = {member: peer for member, peer in peers.items() if peer is not None}
            if any(self._position(member, peer) != position for member, peer in calls.items()):
                continue
            keys = {_agreement_key(peer) for peer in calls.values()}
            # The same collective with sizes that do not pair up: said as the pair.
            alike = len({_agreement_key(peer, sizes=False) for peer in calls.values()}) == 1
            exchange = exchange_mismatch(calls) if alike else None
            if len(keys) < 2 and exchange is None:
                continue
            if not self._settled("mismatch", (record.group_key, position, frozenset(keys), exchange)):
                return None
            where = f"collective #{position + 1} on group {names.name(record)}"
            if exchange is not None:
                where += f" at {record.site}" if record.site else ""
                mismatch = exchange.describe()
            else:
                mismatch = " vs ".join(f"rank {member} {_short(peer)}" for member, peer in calls.items())
            return f"waited in {where}, which can never match: {mismatch}"
        self._first_seen.pop("mismatch", None)
        return None

    def _deadlock(self, stuck: dict[int, CollectiveRecord], names: GroupNames) -> str | None:
        traces = {rank: trace.by_index.values() for rank, trace in self._traces.items()}
        deadlock = find_deadlock(traces, stuck)
        if deadlock is None:
            self._first_seen.pop("deadlock", None)
            return None
        state = tuple((wait.rank, wait.call.index) for wait in deadlock.waits)
        return deadlock.describe(names) if self._settled("deadlock", state) else None

    def _settled(self, kind: str, state: object) -> bool:
        """Whether `kind` found the same `state` for `settle_s` (the first sighting starts the clock)."""
        now = time.monotonic()
        seen = self._first_seen.get(kind)
        if seen is None or seen[0] != state:
            self._first_seen[kind] = (state, now)
            return False
        return now - seen[1] >= self.settle_s

    def _stuck(self, rank: int) -> CollectiveRecord | None:
        records = self._traces[rank].by_index
        if not records:
            return None
        last = records[max(records)]
        if last.completed or last.skipped or not last.on_group:
            return None
        return last

    def _left_inside(self, rank: int, finished: set[int], like: CollectiveRecord) -> CollectiveRecord | None:
        """The call on `like`'s group a finished rank never returned from (gloo raised or aborted
        inside it), if that was its last one."""
        if rank not in finished:
            return None
        last = self._stuck(rank)
        return last if last is not None and last.group_key == like.group_key else None

    def _non_member_call(self, rank: int, like: CollectiveRecord) -> CollectiveRecord | None:
        """The first call `rank` made on a group it is not a member of after its last call on
        `like`'s group (where it should have issued `like`'s collective)."""
        records = self._traces[rank].records
        after = max((r.index for r in records if r.on_group and r.group_key == like.group_key), default=-1)
        return next((r for r in records if not r.member and r.index > after), None)

    def _position(self, rank: int, record: CollectiveRecord) -> int:
        """How many calls `rank` issued on `record`'s group before it."""
        key = record.group_key
        return sum(
            1
            for other in self._traces[rank].by_index.values()
            if other.on_group and other.group_key == key and not other.skipped and other.index < record.index
        )

    def _count(self, rank: int, like: CollectiveRecord) -> int:
        key = like.group_key
        return sum(
            1
            for other in self._traces[rank].by_index.values()
            if other.on_group and other.group_key == key and not other.skipped
        )

    def _read(self, rank: int) -> None:
        tail = self._tails[rank]
        try:
            with open(self.trace_paths[rank], "rb") as handle:
                if os.fstat(handle.fileno()).st_size < tail.offset:  # a new test truncated it
                    tail.offset, tail.partial = 0, b""
                    self._traces[rank].clear()
                handle.seek(tail.offset)
                data = handle.read()
        except FileNotFoundError:
            return
        tail.offset += len(data)
        lines = (tail.partial + data).split(b"\n")
        tail.partial = lines.pop()
        for line in lines:
            if line:
                with contextlib.suppress(ValueError):  # a corrupt line: the verdict reads the file again
                    self._traces[rank].add(line)


def _agreement_key(record: CollectiveRecord, sizes: bool = True) -> tuple:
    """What must agree for a collective to complete correctly (identity is not: a swap still completes)."""
    return (record.op, record.dtypes, None if record.uneven or not sizes else record.shapes, record.args)


def _short(record: CollectiveRecord) -> str:
    text = f"{record.op} {record.numel} {','.join(sorted(set(record.dtypes)))}".rstrip()
    if record.args:
        text += " " + " ".join(f"{name}={value}" for name, value in record.args)
    if record.site:
        text += f" at {record.site}"
    return text
