"""One-sided collectives in seconds: while a test runs, notice a rank waiting in a collective that
can never complete, instead of waiting for the collective timeout (parent side).

Why: one rank runs an extra batch and waits alone in an all-reduce that its peers, already done
with the test, will never issue. gloo and NCCL only give up at the process group's timeout (30 s by
default here, 10 minutes in plain torch); the traces already show it is hopeless.

A wait is hopeless when a rank's last collective has not returned and, for its group, either
  * every other member has finished the test (answered or died) without ever issuing a collective
    at that position on that group ("waits alone"); or
  * every other member also waits at that same position, and the calls disagree on op, dtypes,
    shapes, label or the arguments that must agree ("can never match"), unchanged over
    `settle_s` (a mismatch gloo does not detect hangs; one it detects aborts by itself).
Point-to-point calls, calls on single-member groups and calls a fault skipped are never judged.

The trace files are read incrementally (only what was appended since the last look), so a long
test costs the parent a few small reads per poll.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

from harness.text import group_text
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
        self._mismatch_seen: tuple[tuple, float] | None = None

    def check(self, finished: set[int], waiting: set[int]) -> str | None:
        """Why the waiting ranks can never finish, or None while they still might.

        `finished`: ranks whose result is in (passed, failed, or lost); `waiting`: the others.
        """
        for rank in self.trace_paths:
            self._read(rank)
        stuck = {rank: record for rank in sorted(waiting) if (record := self._stuck(rank)) is not None}
        for rank, record in stuck.items():
            others = [member for member in record.group if member != rank]
            position = self._position(rank, record)
            if others and all(member in finished and self._count(member, record) <= position for member in others):
                issued = ", ".join(f"rank {member} {self._count(member, record)}" for member in others)
                return (
                    f"waited alone in collective #{position + 1} on group {group_text(record.group)} "
                    f"({_short(record)}): the other members finished without issuing it "
                    f"(collectives they issued on that group: {issued})"
                )
        return self._mismatch(stuck)

    # -------------------------------------------------------------------------------- internals

    def _mismatch(self, stuck: dict[int, CollectiveRecord]) -> str | None:
        for rank, record in stuck.items():
            position = self._position(rank, record)
            members = list(record.group)
            peers = {member: stuck.get(member) for member in members}
            if len(members) < 2 or any(peer is None or peer.group != record.group for peer in peers.values()):
                continue
            if any(self._position(member, peer) != position for member, peer in peers.items() if peer):
                continue
            keys = {_agreement_key(peer) for peer in peers.values() if peer}
            if len(keys) < 2:
                continue
            state = (record.group, position, tuple(sorted(keys)))
            now = time.monotonic()
            if self._mismatch_seen is None or self._mismatch_seen[0] != state:
                self._mismatch_seen = (state, now)
                return None
            if now - self._mismatch_seen[1] < self.settle_s:
                return None
            calls = " vs ".join(f"rank {member} {_short(peer)}" for member, peer in peers.items() if peer)
            group = group_text(record.group)
            return f"waited in collective #{position + 1} on group {group}, which can never match: {calls}"
        self._mismatch_seen = None
        return None

    def _stuck(self, rank: int) -> CollectiveRecord | None:
        records = self._traces[rank].by_index
        if not records:
            return None
        last = records[max(records)]
        if last.completed or last.skipped or last.is_p2p:
            return None
        return last

    def _position(self, rank: int, record: CollectiveRecord) -> int:
        """How many calls `rank` issued on `record`'s group before it."""
        return sum(
            1
            for other in self._traces[rank].by_index.values()
            if other.group == record.group and not other.is_p2p and not other.skipped and other.index < record.index
        )

    def _count(self, rank: int, like: CollectiveRecord) -> int:
        return sum(
            1
            for other in self._traces[rank].by_index.values()
            if other.group == like.group and not other.is_p2p and not other.skipped
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


def _agreement_key(record: CollectiveRecord) -> tuple:
    """What must agree for a collective to complete correctly (identity is not: a swap still completes)."""
    return (record.op, record.dtypes, None if record.uneven else record.shapes, record.args)


def _short(record: CollectiveRecord) -> str:
    text = f"{record.op} {record.numel} {','.join(sorted(set(record.dtypes)))}".rstrip()
    if record.args:
        text += " " + " ".join(f"{name}={value}" for name, value in record.args)
    if record.site:
        text += f" at {record.site}"
    return text
