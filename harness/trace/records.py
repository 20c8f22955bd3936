"""Collective trace records and the per-rank trace file that carries them from rank to parent.

This module is what the parent side (session, torchrun mode, divergence) needs to read a trace; it
imports nothing that patches torch.distributed (that is `harness.rank.tracing`, rank side).

File format: one line per event, appended with a single `os.write` each (O_APPEND), so lines
from one rank never interleave and a reader sees only whole lines, except possibly the last one
of a rank killed mid-write:

    {"rank":0,"index":3,"seq":2,"op":"all_reduce",...}   a collective, written BEFORE it is issued
    {"done":3}                                            written when that call's work completed
    {"note":"..."}                                        the trace could not record a call (the
                                                          call itself ran as if untraced)

Completeness rule: because a record is on disk before its collective starts, a rank that hangs,
aborts (gloo's SIGABRT) or is SIGKILLed inside a collective still shows that collective, without
its "done" line. That is how "unfinished collectives" are known; nothing else marks them. "Done"
means completed, observed (`harness.rank.completion`): a synchronous call when it returned, an
async one (async_op=True, a collective issued from C++) when its `Work` completed, a functional
collective when its result was waited for. So a rank that issued an async collective and went on
is not "done" with it until its peers joined, on gloo and NCCL alike; done lines of async calls
may come after later records.
"""

from __future__ import annotations

import json
import json.encoder
from dataclasses import dataclass
from typing import Any

_quote = json.encoder.encode_basestring_ascii  # a JSON string literal, escaped (C implementation)


def _ints(values: tuple[int, ...]) -> str:
    return "[" + ",".join(map(str, values)) + "]"


def _optional_ints(values: list[int] | None) -> tuple[int, ...] | None:
    return None if values is None else tuple(int(value) for value in values)


P2P_SEND_OPS = frozenset({"send", "isend", "send_object_list"})
P2P_RECV_OPS = frozenset({"recv", "irecv", "recv_object_list"})


@dataclass(slots=True)
class CollectiveRecord:
    """One collective as issued by one rank.

    index: position in this rank's trace of the current test (0-based).
    seq: position among this rank's collectives on the same process group (`group_key`), 0-based;
         for point-to-point ops, position among this rank's ops in the same direction between the pair.
    group: global ranks of the process group.  peer: the other side of a send/recv (global rank).
    group_name: torch's name of the process group, the same on every member and different for two
         groups with the same members: torch numbers the groups of a world in the order they are
         created, which every rank sees alike ("" where unknown: files written before it was
         recorded, Flight Recorder dumps without it; then the members alone tell groups apart).
    group_number: 0 for the default group, k for the k-th group created during this test, None for
         a group created before the test began (or unknown); how reports name a group (`harness.trace.groups`).
    member: false for a call on a group this rank is not a member of (torch returns at once on
         such a rank without doing anything); `group` is then the members of the group it named.
    shapes/dtypes/numel: the tensors every member must agree on (the op's inputs; see
         `harness.rank.collective_ops`).
    uneven: the op legitimately lets shapes differ across ranks (all_to_all with splits).
    sends/receives: for collectives whose members exchange pieces of their own (all_to_all and
         all_to_all_single, scatter, gather, all_gather and reduce_scatter with lists), the elements
         this rank sends to / expects from each member, in the group's order (the split sizes times
         the row size; a list's tensor sizes); None for other ops. What must agree across ranks is
         their pairing: rank i's sends to j equal rank j's receives from i (`harness.trace.exchange`).
    fault: description of a fault injected on this call; skipped: the call was never issued.
    tensors: the name of each input tensor ("" for an unnamed one; empty when none is named), see
         `harness.rank.tensor_names`.  site: the user's `file:line` that issued it (`harness.rank.call_sites`).
    args: the non-tensor arguments every member must agree on, as (name, value) text pairs
         (root: the global rank of src/dst; op: the reduction).  async_op: issued with async_op=True.
    asymmetric: issued inside `harness.asymmetric()`, where ranks run different code on purpose:
         tensors and sites are not compared.
    completed: the call's work completed (false for the call a rank was stuck in or died in, and
         for an async call whose work had not completed when the test ended).
    """

    rank: int
    index: int
    seq: int
    op: str
    group: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    numel: int
    label: str
    peer: int | None = None
    uneven: bool = False
    fault: str = ""
    skipped: bool = False
    tensors: tuple[str, ...] = ()
    site: str = ""
    args: tuple[tuple[str, str], ...] = ()
    async_op: bool = False
    asymmetric: bool = False
    group_name: str = ""
    group_number: int | None = None
    member: bool = True
    sends: tuple[int, ...] | None = None
    receives: tuple[int, ...] | None = None
    completed: bool = False

    @property
    def group_key(self) -> tuple[str, tuple[int, ...]]:
        """The process group this call was issued on: torch's name of it and its members (two
        groups with the same members are different streams of collectives)."""
        return (self.group_name, self.group)

    @property
    def on_group(self) -> bool:
        """A collective of its group's stream: not point-to-point, and issued by a member."""
        return self.member and not self.is_p2p

    @property
    def is_p2p(self) -> bool:
        return self.op in P2P_SEND_OPS or self.op in P2P_RECV_OPS

    @property
    def is_send(self) -> bool:
        return self.op in P2P_SEND_OPS

    def to_json(self) -> str:
        """The record's line (without newline); `completed` is not part of it (see `done_line`).

        Written out by hand rather than through `json.dumps` of a dict: this runs before every
        collective, and it is twice as fast (strings still go through json's own escaping)."""
        text = _quote
        parts = [
            f'{{"rank":{self.rank:d},"index":{self.index:d},"seq":{self.seq:d},"op":{text(self.op)}',
            f',"group":{_ints(self.group)},"shapes":[{",".join(map(_ints, self.shapes))}]',
            f',"dtypes":[{",".join(map(text, self.dtypes))}],"numel":{self.numel:d},"label":{text(self.label)}',
        ]
        if self.peer is not None:
            parts.append(f',"peer":{self.peer:d}')
        if self.uneven:
            parts.append(',"uneven":true')
        if self.fault:
            parts.append(f',"fault":{text(self.fault)}')
        if self.skipped:
            parts.append(',"skipped":true')
        if self.tensors:
            parts.append(f',"tensors":[{",".join(map(text, self.tensors))}]')
        if self.site:
            parts.append(f',"site":{text(self.site)}')
        if self.args:
            parts.append(f',"args":[{",".join(f"[{text(name)},{text(value)}]" for name, value in self.args)}]')
        if self.async_op:
            parts.append(',"async":true')
        if self.asymmetric:
            parts.append(',"asymmetric":true')
        if self.group_number is not None:  # the tracer knows both, or neither
            parts.append(f',"group_name":{text(self.group_name)},"group_number":{self.group_number:d}')
        elif self.group_name:
            parts.append(f',"group_name":{text(self.group_name)}')
        if not self.member:
            parts.append(',"non_member":true')
        if self.sends is not None:
            parts.append(f',"sends":{_ints(self.sends)}')
        if self.receives is not None:
            parts.append(f',"receives":{_ints(self.receives)}')
        parts.append("}")
        return "".join(parts)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CollectiveRecord:
        return cls(
            rank=data["rank"],
            index=data["index"],
            seq=data["seq"],
            op=data["op"],
            group=tuple(data["group"]),
            shapes=tuple(tuple(s) for s in data["shapes"]),
            dtypes=tuple(data["dtypes"]),
            numel=data["numel"],
            label=data["label"],
            peer=data.get("peer"),
            uneven=data.get("uneven", False),
            fault=data.get("fault", ""),
            skipped=data.get("skipped", False),
            tensors=tuple(data.get("tensors", ())),
            site=data.get("site", ""),
            args=tuple((str(name), str(value)) for name, value in data.get("args", ())),
            async_op=data.get("async", False),
            asymmetric=data.get("asymmetric", False),
            group_name=str(data.get("group_name", "")),
            group_number=data.get("group_number"),
            member=not data.get("non_member", False),
            sends=_optional_ints(data.get("sends")),
            receives=_optional_ints(data.get("receives")),
        )


def record_line(record: CollectiveRecord) -> bytes:
    """The bytes to append, in one write, before the collective is issued."""
    return (record.to_json() + "\n").encode()


def done_line(index: int) -> bytes:
    """The bytes to append, in one write, once the call with this index completed."""
    return b'{"done":%d}\n' % index


def note_line(text: str) -> bytes:
    """The bytes to append for a note: something the trace could not record, and why."""
    return (json.dumps({"note": text}) + "\n").encode()


@dataclass(frozen=True, slots=True)
class Done:
    """A `done_line`: the call with this index returned."""

    index: int


@dataclass(frozen=True, slots=True)
class Note:
    """A `note_line`: something the trace could not record, and why."""

    text: str


def decode_line(line: str | bytes) -> CollectiveRecord | Done | Note:
    """One whole line of a trace file (without its newline), as the event it records.

    Raises ValueError for a line that is not one: cut short by a killed rank, or corrupt."""
    try:
        data = json.loads(line)
        if "done" in data:
            return Done(int(data["done"]))
        if "note" in data:
            return Note(str(data["note"]))
        return CollectiveRecord.from_json(data)
    except (ValueError, TypeError, KeyError) as error:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"not a trace line ({type(error).__name__}: {error})") from None


class RankTrace:
    """One rank's trace as its lines are read: the records by index, each marked completed once
    its done line is read, and the notes. Fed a whole file (`read_trace`) or the lines appended
    since the last look (`harness.trace.one_sided`)."""

    def __init__(self) -> None:
        self.by_index: dict[int, CollectiveRecord] = {}
        self.notes: list[str] = []

    def add(self, line: str | bytes) -> None:
        """Take in one whole line (see `decode_line`; ValueError for one that is not a trace line)."""
        event = decode_line(line)
        if isinstance(event, Done):
            record = self.by_index.get(event.index)
            if record is not None:
                record.completed = True
        elif isinstance(event, Note):
            self.notes.append(event.text)
        else:
            self.by_index[event.index] = event

    def clear(self) -> None:
        self.by_index.clear()
        self.notes.clear()

    @property
    def records(self) -> list[CollectiveRecord]:
        """The records in the order the rank issued them."""
        return sorted(self.by_index.values(), key=lambda r: r.index)


def read_trace(path: str, notes: list[str] | None = None) -> list[CollectiveRecord]:
    """Records of one rank's trace file; a last line cut short by a killed rank is ignored.
    The file's notes are appended to `notes` when given."""
    with open(path, encoding="utf-8") as handle:
        lines = handle.read().split("\n")
    trace = RankTrace()
    for number, line in enumerate(lines, start=1):
        if not line:
            continue
        try:
            trace.add(line)
        except ValueError:
            if number == len(lines):  # no trailing newline: the write was cut short
                continue
            raise ValueError(f"{path}:{number}: corrupt trace line {line[:80]!r}") from None
    if notes is not None:
        notes.extend(trace.notes)
    return trace.records


def read_trace_or_empty(path: str) -> list[CollectiveRecord]:
    """`read_trace`, or no records when the file does not exist (the rank died before its first test)."""
    try:
        return read_trace(path)
    except FileNotFoundError:
        return []


def last_unfinished(traces: dict[int, list[CollectiveRecord]]) -> dict[int, CollectiveRecord]:
    """Per rank, the last collective it issued that never completed: where it hung or died.

    Ranks whose calls all returned are absent, so an empty result means no collective was left
    half-done. Calls a fault skipped were never issued and do not count.
    """
    stuck: dict[int, CollectiveRecord] = {}
    for rank, records in traces.items():
        for record in reversed(records):
            if not record.completed and not record.skipped:
                stuck[rank] = record
                break
    return stuck
