"""One failed test's collective traces as the HTML page shows them, from the harness's data.

The harness hands every distributed test's result to its report plugins
(`harness.DistributedTestResult`): the ranks' trace records (`traces`, rank -> its
`harness.CollectiveRecord`s in issue order), the first divergent collective (`divergence`, its
description) and where it is in those traces (`diverged_at`). A `TraceView` keeps the three for
the page (`conformance.report.html`, `conformance.report.timeline_svg`); a record's cells are the
harness's own (`harness.trace_cells`, the columns of its text tables), never read back from a file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from harness import CollectiveRecord, trace_cells

__all__ = ["TOOLTIP_COLUMNS", "TraceView", "describe"]

TOOLTIP_COLUMNS = ("label", "numel", "dtypes", "shapes", "args", "tensors", "site")
"""What a collective's tooltip names besides its number, op and status (where not "-")."""


@dataclass(frozen=True)
class TraceView:
    """A test's traces and their first divergence, as `harness.DistributedTestResult` gave them."""

    nodeid: str
    traces: Mapping[int, Sequence[CollectiveRecord]]
    """rank -> its collectives, in the order it issued them (`CollectiveRecord.index`)."""
    divergence: str = ""
    """The first divergent collective, described; empty when the traces agree."""
    diverged_at: Mapping[int, int | None] = field(default_factory=dict)
    """Per rank of the divergent group or stream, the index of its collective at the first
    divergence, None for a rank that stopped before it; empty when the traces agree."""


def describe(rank: int, record: CollectiveRecord) -> str:
    """One line for a tooltip: what the rank issued there."""
    cells = trace_cells(record)
    parts = [f"rank {rank} #{cells['#']}", record.op]
    for column in TOOLTIP_COLUMNS:
        value = cells[column]
        if value != "-":
            parts.append(f"[{value}]" if column == "label" else f"{column} {value}")
    parts.append(cells["status"])
    return " ".join(parts)
