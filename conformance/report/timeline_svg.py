"""A per-rank timeline of collectives as inline SVG, with the first divergence marked.

One lane per rank; each collective a box at its position in that rank's trace (#1 leftmost),
coloured by the kind of op; hovering a box shows what it carried (its `<title>`). The first
divergence (where the harness found it, `TraceView.diverged_at`) is drawn on every rank of the
divergent group: a red frame around the collective each rank issued there, joined by a red line,
or a red cross after the last collective of a rank that stopped before it. A collective that never
returned has a black frame, one a fault skipped a dashed one.
"""

from __future__ import annotations

from html import escape

from conformance.report.trace_view import TraceView, describe
from harness import CollectiveRecord

__all__ = ["OP_COLOURS", "op_family", "render_timeline"]

# Op family -> fill. Families, not ops: all_gather and all_gather_into_tensor look alike.
OP_COLOURS = {
    "all_gather": "#4c78a8",
    "reduce_scatter": "#f58518",
    "all_reduce": "#54a24b",
    "broadcast": "#b279a2",
    "barrier": "#9d9d9d",
    "p2p": "#72b7b2",
    "other": "#bab0ac",
}
_LEFT = 64
_TOP = 42
_LANE = 26
_BOX = 18
_WIDTH = 1000
_DIVERGED = "#d62728"
_MIN_WIDTH = 760  # room for the legend


def op_family(op: str) -> str:
    for family in ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "barrier"):
        if op.startswith((family, f"_{family}")):
            return family
    if op in ("send", "isend", "recv", "irecv", "send_object_list", "recv_object_list"):
        return "p2p"
    return "other"


def render_timeline(view: TraceView) -> str:
    """The SVG element (text) for one test's traces."""
    ranks = sorted(view.traces)
    longest = max((len(records) for records in view.traces.values()), default=0)
    step = max(3.0, min(22.0, _WIDTH / max(longest, 1)))
    box = step - 2 if step >= 6 else step
    marks = view.diverged_at
    width = max(int(_LEFT + step * (longest + 2) + 10), _MIN_WIDTH)
    height = _TOP + _LANE * len(ranks) + 40
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="timeline" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="collective timeline of {len(ranks)} ranks">',
        f"<title>collectives per rank of {escape(view.nodeid)}</title>",
        f'<text x="{_LEFT}" y="14" font-size="11" fill="#444">collective # in each rank\'s trace &#8594;</text>',
    ]
    for tick in range(0, longest + 1, _tick_every(longest)):
        if tick:
            x = _LEFT + step * (tick - 1) + box / 2
            parts.append(
                f'<text x="{x:.1f}" y="{_TOP - 4}" font-size="9" text-anchor="middle" fill="#666">{tick}</text>'
            )
    centres: list[tuple[float, float]] = []
    for lane, rank in enumerate(ranks):
        y = _TOP + lane * _LANE
        parts.append(f'<text x="4" y="{y + _BOX - 5}" font-size="12">rank {rank}</text>')
        records = view.traces[rank]
        for record in records:
            parts.append(_box(rank, record, _LEFT + step * record.index, y, box))
        if rank in marks:
            index = marks[rank]
            if index is not None:
                x = _LEFT + step * index
                parts.append(
                    f'<rect class="divergence" x="{x - 2:.1f}" y="{y - 2}" width="{box + 4:.1f}" '
                    f'height="{_BOX + 4}" fill="none" stroke="{_DIVERGED}" stroke-width="3"/>'
                )
                centres.append((x + box / 2, y + _BOX / 2))
            else:  # stopped before it: a cross after its last collective
                x = _LEFT + step * len(records) + 2
                parts.append(
                    f'<g class="divergence" stroke="{_DIVERGED}" stroke-width="3"><title>rank {rank} issued '
                    f"nothing here: it stopped before the first divergence</title>"
                    f'<line x1="{x}" y1="{y}" x2="{x + 12}" y2="{y + _BOX}"/>'
                    f'<line x1="{x + 12}" y1="{y}" x2="{x}" y2="{y + _BOX}"/></g>'
                )
                centres.append((x + 6, y + _BOX / 2))
    if len(centres) > 1:
        points = " ".join(f"{x:.1f},{y:.1f}" for x, y in centres)
        parts.append(
            f'<polyline points="{points}" fill="none" stroke="{_DIVERGED}" stroke-width="1.5" stroke-dasharray="4 3"/>'
        )
    if centres:
        x, y = centres[0]
        parts.append(
            f'<text x="{x - 4:.1f}" y="{_TOP - 16}" font-size="11" fill="{_DIVERGED}" '
            f'font-weight="bold">first divergence</text>'
        )
    parts.append(_legend(_TOP + _LANE * len(ranks) + 14))
    parts.append("</svg>")
    return "".join(parts)


def _box(rank: int, record: CollectiveRecord, x: float, y: int, box: float) -> str:
    fill = OP_COLOURS[op_family(record.op)]
    stroke = ""
    if record.skipped:
        fill, stroke = "#ffffff", ' stroke="#555" stroke-dasharray="2 2"'
    elif not record.completed:
        stroke = ' stroke="#000" stroke-width="2"'
    return (
        f'<rect x="{x:.1f}" y="{y}" width="{box:.1f}" height="{_BOX}" fill="{fill}"{stroke}>'
        f"<title>{escape(describe(rank, record))}</title></rect>"
    )


def _legend(y: int) -> str:
    parts, x = [], _LEFT
    for family, colour in OP_COLOURS.items():
        parts.append(f'<rect x="{x}" y="{y}" width="10" height="10" fill="{colour}"/>')
        parts.append(f'<text x="{x + 14}" y="{y + 9}" font-size="10">{family.replace("_", " ")}</text>')
        x += 24 + 6 * len(family)
    parts.append(f'<rect x="{x}" y="{y}" width="10" height="10" fill="none" stroke="{_DIVERGED}" stroke-width="2"/>')
    parts.append(f'<text x="{x + 14}" y="{y + 9}" font-size="10">first divergence</text>')
    return "".join(parts)


def _tick_every(longest: int) -> int:
    for every in (1, 2, 5, 10, 20, 50, 100, 200, 500):
        if longest / every <= 25:
            return every
    return 1000
