"""Read the harness's per-test trace reports (`reports/traces/<test>.txt`) back for the HTML page.

The harness writes, for each failed or divergent distributed test, a text file: the node id, a
line naming the first divergence ("first divergence: collective #9 on group [0, 1] ...: rank 0
... vs rank 1 ...", or "no divergence between ranks"), then one fixed-width table per rank
(`harness.trace.divergence.format_trace_table`). The columns are cut at the positions of the header's
names, so any cell text (labels with spaces, 300-character labels) reads back whole;
tests/conformance/test_report_html.py checks the round trip against the harness's writer.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

__all__ = ["TraceReport", "TraceRow", "index_trace_reports", "read_trace_report"]

COLUMNS = (
    *("#", "group/peer", "group #", "op", "label", "numel"),
    *("dtypes", "shapes", "args", "tensors", "site", "status"),
)
_RANK = re.compile(r"^rank (\d+): \d+ collectives$")
_WHERE = re.compile(
    r"^first divergence: (collective #(\d+) on group (\[[\d, ]*\])|p2p #(\d+) from rank (\d+) to rank (\d+))"
)


@dataclass(frozen=True)
class TraceRow:
    """One collective of one rank's trace, as the table shows it (text cells)."""

    rank: int
    cells: dict[str, str]

    @property
    def number(self) -> int:
        return int(self.cells["#"])

    @property
    def op(self) -> str:
        return self.cells["op"]

    @property
    def where(self) -> str:
        return self.cells["group/peer"]

    @property
    def status(self) -> str:
        return self.cells["status"]

    @property
    def skipped(self) -> bool:
        return self.status.startswith("skipped")

    def describe(self) -> str:
        """One line for a tooltip: what the rank issued there."""
        parts = [f"rank {self.rank} #{self.number}", self.op]
        for column in ("label", "numel", "dtypes", "shapes", "args", "tensors", "site"):
            value = self.cells.get(column, "-")
            if value != "-":
                parts.append(f"{column} {value}" if column not in ("label",) else f"[{value}]")
        parts.append(self.status)
        return " ".join(parts)


@dataclass(frozen=True)
class TraceReport:
    nodeid: str
    heading: str  # "first divergence: ..." or "no divergence between ranks"
    ranks: dict[int, list[TraceRow]]

    def first_divergence(self) -> dict[int, int | None]:
        """Per rank of the divergent group or stream, the number (#, from 1) of its row at the
        first divergence, or None for a rank that stopped before it; empty without a divergence."""
        found = _WHERE.match(self.heading)
        if found is None:
            return {}
        if found.group(2) is not None:
            position, group = int(found.group(2)), found.group(3)
            members = [int(r) for r in group.strip("[]").split(",") if r.strip()]
            streams = {rank: [row for row in self.ranks.get(rank, []) if row.where == group] for rank in members}
        else:
            position, source, target = int(found.group(4)), int(found.group(5)), int(found.group(6))
            streams = {
                source: [row for row in self.ranks.get(source, []) if row.where == f"->{target}"],
                target: [row for row in self.ranks.get(target, []) if row.where == f"<-{source}"],
            }
        marks: dict[int, int | None] = {}
        for rank, rows in streams.items():
            issued = [row for row in rows if not row.skipped]
            marks[rank] = issued[position - 1].number if position <= len(issued) else None
        return marks


def read_trace_report(path: str) -> TraceReport:
    """A trace report file, parsed; ValueError when it is not one."""
    with open(path, encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    if len(lines) < 2:
        raise ValueError(f"{path}: not a trace report (fewer than two lines)")
    ranks: dict[int, list[TraceRow]] = {}
    rank: int | None = None
    starts: list[int] = []
    for line in lines[2:]:
        header = _RANK.match(line)
        if header:
            rank, starts = int(header.group(1)), []
            ranks[rank] = []
        elif rank is not None and not starts and line.strip().startswith("#"):
            starts = _column_starts(line)
        elif rank is not None and starts and line.strip():
            cells = [line[start:end].strip() for start, end in zip(starts, [*starts[1:], None])]
            ranks[rank].append(TraceRow(rank, dict(zip(COLUMNS, cells))))
    return TraceReport(lines[0], lines[1], ranks)


def _column_starts(header: str) -> list[int]:
    """Where each column begins: its name's position in the header line (names in order)."""
    starts, position = [], 0
    for name in COLUMNS:
        found = header.find(name, position)
        if found < 0:
            raise ValueError(f"trace table header {header.strip()!r} lacks the column {name!r}")
        # "group #" contains "#": look for whole names, each after the previous one.
        starts.append(found)
        position = found + len(name)
    return starts


def index_trace_reports(directory: str, since: float) -> dict[str, str]:
    """node id -> trace report path, for the files in `directory` written at or after `since`
    (a reports directory keeps older runs' files)."""
    index: dict[str, str] = {}
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return index
    for name in names:
        path = os.path.join(directory, name)
        if not name.endswith(".txt") or os.path.getmtime(path) < since:
            continue
        with open(path, encoding="utf-8") as handle:
            index[handle.readline().rstrip("\n")] = path
    return index
