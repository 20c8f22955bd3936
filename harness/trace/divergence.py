"""Diff per-rank collective traces and name the first collective where ranks disagree.

Collectives are compared per process group (`CollectiveRecord.group_key`: two groups with the same
members are two streams): the k-th collective each member issued on that group must agree on op,
label, dtypes, (unless the op allows uneven sizes) shapes and the arguments that must agree (root
rank, reduction), and every member must have issued it. Where the members exchange pieces of their
own (all_to_all, scatter, gather, list collectives), what each sends must be what its peer expects
(`harness.trace.exchange`). Outside regions marked `harness.asymmetric()` they must also agree on
the tensors' names and the call site (`harness.rank.tensor_names`, `harness.rank.call_sites`): the
same-shaped collective issued on another tensor or from another line is a mispairing torch cannot
see. Point-to-point ops are matched per direction instead: the k-th send from a to b against the
k-th receive on b from a (element count and dtype). Calls a fault skipped were never issued: they
are left out of the comparison and named in the report. A rank that stopped on one group while it
waits in another group's collective for a member that waits on it is named as a deadlock
(`harness.trace.deadlock`); a rank that called a collective on a group it is not a member of where
it should have issued one is named with that call. Groups are named by their members, and by
identity where several groups share members (`harness.trace.groups`).
Collectives are numbered from 1 in reports (record fields `index`/`seq` are 0-based).
Of all disagreements, the one reached first is reported: the one no other precedes, where A precedes B
when a rank involved in both reached A earlier in its own trace (a rank-local order is all there
is; later disagreements are usually consequences of the first).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from harness.message_text import group_text, ranks_text
from harness.trace.deadlock import Deadlock, find_deadlock
from harness.trace.exchange import ExchangeMismatch, exchange_mismatch
from harness.trace.groups import GroupNames, group_identity
from harness.trace.records import CollectiveRecord, last_unfinished

__all__ = [
    "TRACE_COLUMNS",
    "Divergence",
    "TraceColumn",
    "diagnosis",
    "first_divergence",
    "format_trace_table",
    "trace_cells",
    "unfinished_collectives",
]


@dataclass(frozen=True)
class Divergence:
    """The first disagreement between ranks.

    where: "collective #k on group [..]" or "p2p #k from rank a to rank b"; number: that k (from 1).
    issued: rank -> what it issued at that point; ranks absent from `issued` stopped before it.
    last: for ranks that stopped, their last call on that group/stream (None: never issued one).
    skipped: rank -> a call a fault made it skip just before this point.
    exchange: the members' calls are alike but what they send does not pair up with what they expect.
    non_member: rank that stopped -> the collective it called instead on a group it is not a member of.
    deadlock: the wait cycle the stopped ranks are part of (each waits in another group's collective).
    names: how the groups of these traces are named.
    """

    where: str
    number: int
    issued: dict[int, CollectiveRecord]
    last: dict[int, CollectiveRecord | None]
    skipped: dict[int, CollectiveRecord]
    exchange: ExchangeMismatch | None = None
    non_member: dict[int, CollectiveRecord] = field(default_factory=dict)
    deadlock: Deadlock | None = None
    names: GroupNames = field(default_factory=lambda: GroupNames(()))

    @property
    def reached_at(self) -> dict[int, int]:
        """Per involved rank, its trace position at this disagreement (stopped ranks: one past their last)."""
        positions = {rank: record.index for rank, record in self.issued.items()}
        positions.update({rank: (record.index + 1 if record is not None else 0) for rank, record in self.last.items()})
        return positions

    def positions(self) -> dict[int, int | None]:
        """Per rank of the divergent group or stream, where in its own trace (`CollectiveRecord.index`)
        it issued the collective of this disagreement; None for a rank that stopped before it."""
        positions: dict[int, int | None] = dict.fromkeys(self.last)
        positions.update({rank: record.index for rank, record in self.issued.items()})
        return positions

    def precedes(self, other: Divergence) -> bool:
        """Some rank involved in both reached this one first (it happened earlier on that rank)."""
        mine, theirs = self.reached_at, other.reached_at
        return any(mine[rank] < theirs[rank] for rank in mine.keys() & theirs.keys())

    def describe(self) -> str:
        if self.deadlock is not None:
            return self.deadlock.describe(self.names)
        records = self.issued.values()
        # Shapes are noise unless they are the only difference (e.g. [36] vs [6, 6]).
        show_shapes = len({_describe(r, False) for r in records}) == 1 and len({r.shapes for r in records}) > 1
        # Arguments (op=SUM, root=0) likewise: shown where they differ.
        show_args = len({r.args for r in records}) > 1
        if self.last:
            by_text: dict[str, list[int]] = {}
            for rank, last in sorted(self.last.items()):
                stop = self._describe_stop(last, self.skipped.get(rank), self.non_member.get(rank))
                by_text.setdefault(stop, []).append(rank)
            stopped = "; ".join(f"{ranks_text(ranks)} {text}" for text, ranks in by_text.items())
            issued = ", ".join(
                f"{ranks_text([rank])} issued {self._describe_issued(rank, show_shapes, show_args)}"
                for rank in sorted(self.issued)
            )
            return f"{self.where}: {stopped} ({issued})"
        # One shared call site is said once; different ones are the clue, so each rank shows its own.
        sites = {record.site for record in records}
        where = self.where
        if len(sites) == 1 and "" not in sites:
            where += f" at {sites.pop()}"
        if self.exchange is not None:
            return f"{where}: {self.exchange.describe()}"
        classes: dict[str, list[int]] = {}
        for rank in sorted(self.issued):
            text = self._describe_issued(rank, show_shapes, show_args, where == self.where)
            classes.setdefault(text, []).append(rank)
        return f"{where}: " + " vs ".join(f"{ranks_text(ranks)} {text}" for text, ranks in classes.items())

    def _describe_issued(self, rank: int, show_shapes: bool, show_args: bool, show_site: bool = True) -> str:
        text = _describe(self.issued[rank], show_shapes, show_site, show_args)
        skipped = self.skipped.get(rank)
        if skipped is not None:
            text += f", having skipped {skipped.op} (injected fault: {skipped.fault})"
        return text

    def _describe_stop(
        self, last: CollectiveRecord | None, skipped: CollectiveRecord | None, non_member: CollectiveRecord | None
    ) -> str:
        if skipped is not None:
            return f"did not issue it, {skipped.op} skipped (injected fault: {skipped.fault})"
        instead = f"called {self.names.non_member_call(non_member)}" if non_member is not None else ""
        if last is None:
            return instead or "issued none"
        text = f"stopped early after #{self.number - 1} {_describe(last, False)}"
        if not last.completed:
            text += ", which never completed"
        return f"{text}, then {instead}" if instead else text


def first_divergence(traces: dict[int, list[CollectiveRecord]], world_ranks: list[int]) -> Divergence | None:
    """The earliest disagreement between the ranks in `world_ranks`, or None when all agree.

    A rank of `world_ranks` missing from `traces` counts as having issued nothing.
    """
    members = set(world_ranks)
    recorded = {rank: traces.get(rank, []) for rank in world_ranks}
    names = GroupNames.of(recorded)
    candidates = [*_group_divergences(recorded, members, names), *_p2p_divergences(recorded, members)]
    first = min(
        candidates,
        default=None,
        key=lambda d: (sum(other.precedes(d) for other in candidates), min(d.reached_at.values()), d.where),
    )
    if first is None or not first.last:
        return first
    # Ranks that stopped on this group may be waiting in another group's collective for a rank
    # that waits on them: then that cycle, not the missing call, is the story.
    stuck = {rank: record for rank, record in last_unfinished(recorded).items() if record.on_group}
    deadlock = find_deadlock(recorded, stuck)
    if deadlock is not None and set(deadlock.ranks) & set(first.last):
        return replace(first, deadlock=deadlock)
    return first


def diagnosis(traces: dict[int, list[CollectiveRecord]], world_ranks: list[int], notes: Iterable[str] = ()) -> str:
    """The first divergence (or that there is none) and where ranks were stuck, as lines of text:
    what plain scripts (`harness.tools.trace_script`) and Flight Recorder dumps print.

    `notes`: what the traces say they could not record (their note lines, e.g. collectives a
    torch does not let the tracer see); "no divergence" then says it holds only for what was seen."""
    divergence = first_divergence(traces, world_ranks)
    if divergence is not None:
        lines = [f"ranks issued divergent collectives: {divergence.describe()}"]
    else:
        total = sum(len(records) for records in traces.values())
        lines = [f"no divergence between the collectives of ranks {group_text(world_ranks)} ({total} recorded)"]
        unseen = list(dict.fromkeys(notes))
        if unseen:
            lines[0] += ", among the collectives the trace could see; it says it missed some: " + "; ".join(unseen)
    unfinished = unfinished_collectives(traces)
    if unfinished:
        lines.append(f"unfinished collectives: {unfinished}")
    return "\n".join(lines)


def unfinished_collectives(traces: dict[int, list[CollectiveRecord]]) -> str | None:
    """Where each rank was stuck: its last collective that never completed (a hang or crash
    inside it), e.g. "rank 0 in collective #3 on group [0, 1]: all_reduce 4 float32". None when
    every recorded collective returned."""
    names = GroupNames.of(traces)
    stuck = [
        f"rank {rank} in collective #{record.seq + 1} on group {names.name(record)}: {_describe(record, False)}"
        for rank, record in sorted(last_unfinished(traces).items())
    ]
    return "; ".join(stuck) or None


@dataclass(frozen=True)
class TraceColumn:
    """One column of a trace table: its heading and its cell for a record ("-" for nothing)."""

    name: str
    cell: Callable[[CollectiveRecord], str]


def _where(record: CollectiveRecord) -> str:
    """The group of a collective ("[0, 1]"; "#2 [0, 1]" for the second group the test created; "not
    in [0, 1]" for a call on a group this rank is not a member of), the peer of a point-to-point op
    ("->1" sent to it, "<-1" received)."""
    if record.is_send:
        return f"->{record.peer}"
    if record.is_p2p:
        return f"<-{record.peer}"
    identity = group_identity(record) if record.group_number else ""
    text = f"{identity} {group_text(record.group)}" if identity else group_text(record.group)
    return text if record.member else f"not in {text}"


def _status(record: CollectiveRecord) -> str:
    status = "skipped" if record.skipped else ("done" if record.completed else "NOT COMPLETED")
    return status + (f" (fault: {record.fault})" if record.fault else "")


def _args(record: CollectiveRecord) -> str:
    words = [f"{name}={value}" for name, value in record.args]
    if record.sends is not None:
        words.append(f"sends={_sizes(record.sends)}")
    if record.receives is not None:
        words.append(f"expects={_sizes(record.receives)}")
    return " ".join([*words, *(["async"] * record.async_op)]) or "-"


def _sizes(values: tuple[int, ...]) -> str:
    return "[" + ",".join(map(str, values)) + "]"


TRACE_COLUMNS = (
    TraceColumn("#", lambda record: str(record.index + 1)),
    TraceColumn("group/peer", _where),
    TraceColumn("group #", lambda record: str(record.seq + 1)),
    TraceColumn("op", lambda record: record.op),
    TraceColumn("label", lambda record: record.label or "-"),
    TraceColumn("numel", lambda record: str(record.numel)),
    TraceColumn("dtypes", lambda record: ",".join(record.dtypes) or "-"),
    TraceColumn("shapes", lambda record: " ".join(_shape(s) for s in record.shapes) or "-"),
    TraceColumn("args", _args),
    TraceColumn("tensors", lambda record: ",".join(name or "?" for name in record.tensors) or "-"),
    TraceColumn("site", lambda record: record.site + (" (asymmetric)" if record.asymmetric else "") or "-"),
    TraceColumn("status", _status),
)
"""The columns of every trace table, the text one (`format_trace_table`) and the conformance HTML's."""


def trace_cells(record: CollectiveRecord) -> dict[str, str]:
    """A record's cells in a trace table, by column name (`TRACE_COLUMNS`), numbers from 1."""
    return {column.name: column.cell(record) for column in TRACE_COLUMNS}


def format_trace_table(traces: dict[int, list[CollectiveRecord]]) -> str:
    """A human-readable dump of every rank's trace, one section per rank (numbers from 1)."""
    header = tuple(column.name for column in TRACE_COLUMNS)
    sections = []
    for rank in sorted(traces):
        rows = [header]
        rows += [tuple(column.cell(record) for column in TRACE_COLUMNS) for record in traces[rank]]
        widths = [max(len(row[column]) for row in rows) for column in range(len(header) - 1)]
        lines = [
            "  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1] for row in rows
        ]
        sections.append(f"rank {rank}: {len(traces[rank])} collectives\n" + "\n".join(line.rstrip() for line in lines))
    return "\n\n".join(sections) + "\n"


def _group_divergences(
    recorded: dict[int, list[CollectiveRecord]], members: set[int], names: GroupNames
) -> Iterable[Divergence]:
    per_group: dict[tuple[str, tuple[int, ...]], dict[int, list[CollectiveRecord]]] = {}
    for rank, records in recorded.items():
        for record in records:
            if record.on_group:
                per_group.setdefault(record.group_key, {}).setdefault(rank, []).append(record)
    for by_rank in per_group.values():
        sample = next(record for records in by_rank.values() for record in records)
        ranks = [rank for rank in sample.group if rank in members]
        sequences = {rank: by_rank.get(rank, []) for rank in ranks}
        where = f"collective #{{}} on group {names.name(sample)}"
        divergence = _first_difference(sequences, where, _collective_key, names)
        if divergence is not None:
            non_member = {
                rank: found
                for rank, last in divergence.last.items()
                if (found := _non_member_call_after(recorded.get(rank, []), last)) is not None
            }
            yield replace(divergence, non_member=non_member) if non_member else divergence


def _p2p_divergences(recorded: dict[int, list[CollectiveRecord]], members: set[int]) -> Iterable[Divergence]:
    streams: dict[tuple[int, int], dict[int, list[CollectiveRecord]]] = {}
    for rank, records in recorded.items():
        for record in records:
            if record.is_p2p and record.member and record.peer is not None:
                source, target = (rank, record.peer) if record.is_send else (record.peer, rank)
                if source != target and source in members and target in members:
                    streams.setdefault((source, target), {source: [], target: []})[rank].append(record)
    for (source, target), sequences in streams.items():
        where = f"p2p #{{}} from rank {source} to rank {target}"
        divergence = _first_difference(sequences, where, _p2p_key)
        if divergence is not None:
            yield divergence


def _first_difference(
    recorded: dict[int, list[CollectiveRecord]], where: str, key, names: GroupNames | None = None
) -> Divergence | None:
    """First position where the ranks' issued calls disagree; `recorded` includes skipped calls."""
    names = names or GroupNames(())
    sequences = {rank: [r for r in records if not r.skipped] for rank, records in recorded.items()}
    longest = max((len(records) for records in sequences.values()), default=0)
    for position in range(longest):
        present = {rank: records[position] for rank, records in sequences.items() if position < len(records)}
        stopped = len(present) < len(sequences)
        # The same collective with sizes that do not pair up: said as the pair, not as a shape list.
        if not stopped and key is _collective_key and not _records_differ(present.values(), _sizeless_key):
            exchange = exchange_mismatch(present)
            if exchange is not None:
                return Divergence(where.format(position + 1), position + 1, present, {}, {}, exchange, names=names)
        if stopped or _records_differ(present.values(), key):
            last = {
                rank: (records[-1] if records else None)
                for rank, records in sequences.items()
                if position >= len(records)
            }
            skipped = {
                rank: found
                for rank, records in sequences.items()
                if (found := _skipped_before(recorded[rank], records, position)) is not None
            }
            return Divergence(where.format(position + 1), position + 1, present, last, skipped, names=names)
    return None


def _non_member_call_after(records: list[CollectiveRecord], last: CollectiveRecord | None) -> CollectiveRecord | None:
    """The first call a rank made on a group it is not a member of after `last` (its last call on
    the group it stopped on): likely the one it meant to make there."""
    after = -1 if last is None else last.index
    return next((record for record in records if not record.member and record.index > after), None)


def _skipped_before(
    recorded: list[CollectiveRecord], issued: list[CollectiveRecord], position: int
) -> CollectiveRecord | None:
    """A skipped call between the rank's issued calls number `position` - 1 and `position` (0-based)."""
    after = issued[position - 1].index if 0 < position <= len(issued) else -1
    before = issued[position].index if position < len(issued) else float("inf")
    return next((r for r in recorded if r.skipped and after < r.index < before), None)


def _collective_key(record: CollectiveRecord) -> tuple:
    return (record.op, record.label, record.dtypes, None if record.uneven else record.shapes, record.args)


def _sizeless_key(record: CollectiveRecord) -> tuple:
    return (record.op, record.label, record.dtypes, record.args)


def _records_differ(records: Iterable[CollectiveRecord], key) -> bool:
    records = list(records)
    if len({key(record) for record in records}) > 1:
        return True
    # Identity only where no rank declared the region asymmetric, and never for p2p ops (a send
    # and its receive are different lines by nature).
    if key is _p2p_key or any(record.asymmetric for record in records):
        return False
    if len({record.site for record in records}) > 1:
        return True
    # A tensor one rank could not name (a fresh buffer, an empty shard) is no evidence either way:
    # names differ only where two ranks gave the same position different names.
    width = max(len(record.tensors) for record in records)
    for position in range(width):
        names = {record.tensors[position] for record in records if position < len(record.tensors)} - {""}
        if len(names) > 1:
            return True
    return False


def _p2p_key(record: CollectiveRecord) -> tuple:
    return (record.numel, record.dtypes)


def _describe(record: CollectiveRecord, show_shapes: bool, show_site: bool = True, show_args: bool = False) -> str:
    text = record.op
    if record.label:
        text += f" [{record.label}]"
    if record.dtypes:
        text += f" {record.numel} {','.join(sorted(set(record.dtypes)))}"
    if show_shapes:
        text += " shapes " + " ".join(_shape(s) for s in record.shapes)
    if record.args and show_args:
        text += " " + " ".join(f"{name}={value}" for name, value in record.args)
    if record.async_op:
        text += " async"
    if any(record.tensors):
        text += " of " + ", ".join(name or "?" for name in record.tensors)
    if record.site and show_site:
        text += f" at {record.site}"
    if record.fault:
        text += f" (injected fault: {record.fault})"
    return text


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ",".join(map(str, shape)) + "]"
