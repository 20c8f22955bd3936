"""`reports/conformance.html`: the conformance matrix as the page people open first.

One self-contained file (inline CSS and SVG, no script, nothing fetched), top to bottom:
an INCOMPLETE banner when the run stopped early; the run's details (date, command, torch, seed,
device, world sizes, each backend with its version); a legend; the matrix, each cell a bar split
by outcome (its widths proportional to the counts) above the counts in words, a failed cell
linking to its failures; then each failure with its one-line reason, its REPRO line, a link to
its trace file and, where the ranks diverged, a per-rank timeline of collectives
(`conformance.report.timeline_svg`) with the first divergence marked and the trace as readable tables;
the expected failures with their reasons and links; the unsupported capabilities; stale
expectation entries.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from html import escape

from conformance.report.matrix import OUTCOMES, Failure, Matrix, anchor, cell_text, run_rows
from conformance.report.timeline_svg import render_timeline
from conformance.report.trace_view import TraceView
from harness import CollectiveRecord, trace_cells

__all__ = ["OUTCOME_COLOURS", "SHOWN_COLUMNS", "render_html"]

OUTCOME_COLOURS = {
    "pass": "#7fc97f",
    "fail": "#e15759",
    "expected-fail": "#f1ce63",
    "unsupported": "#9ecae9",
    "skip": "#c7c7c7",
    "not run": "repeating-linear-gradient(45deg,#fff 0 4px,#bbb 4px 6px)",
}
MEANINGS = {
    "pass": "the backend met the scenario's contract",
    "fail": "it did not (or passed a scenario its expectations file says it fails): see Failures",
    "expected-fail": "failed as the backend's expectations file records, for the reason given there",
    "unsupported": "the backend declares it lacks a capability the scenario needs",
    "skip": "skipped for another reason (e.g. too few GPUs)",
    "not run": "selected but never ran: the run stopped early",
}
# Trace columns (`harness.trace_cells`) shown in the readable per-rank tables (the text file keeps every column).
SHOWN_COLUMNS = ("#", "group/peer", "op", "label", "numel", "dtypes", "tensors", "site", "status")
_LONG_TRACE = 40

_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;max-width:1400px}
h1{margin-bottom:.2em}h2{margin-top:1.6em;border-bottom:1px solid #ccc}
table{border-collapse:collapse;max-width:100%}
td,th{border:1px solid #bbb;padding:3px 8px;text-align:left;vertical-align:top;overflow-wrap:break-word}
td code{word-break:break-all}td.name{white-space:nowrap}
.banner{background:#e15759;color:#fff;padding:.6em 1em;font-weight:bold;font-size:1.1em}
.details th{background:#f4f4f4;font-weight:normal;color:#555}
.legend{display:flex;flex-wrap:wrap;gap:.4em 1.4em;margin:.6em 0}
.legend span.key{display:inline-block;width:1.1em;height:1.1em;vertical-align:middle;border:1px solid #888;
margin-right:.3em}
.matrix{font-size:.92em}.matrix td{min-width:7em}.matrix td a{color:inherit}
.bar{display:flex;height:.9em;border:1px solid #888;margin-bottom:2px}
.bar span{display:block;height:100%}
.counts{font-size:.85em}
.cellfail{outline:2px solid #e15759}
.failure{border-left:4px solid #e15759;padding-left:1em;margin:1.2em 0}
.reason{font-weight:bold}
pre{background:#f4f4f4;padding:6px;overflow:auto;white-space:pre-wrap;word-break:break-word}
.repro{background:#fff8dc;border:1px solid #e0d090}
table.trace td{font-family:ui-monospace,monospace;font-size:.8em;max-width:28em;word-break:break-word}
table.trace tr.diverged td{background:#fde0e0;font-weight:bold}
svg.timeline{display:block;margin:.5em 0;border:1px solid #ddd;background:#fff;max-width:100%;height:auto}
"""


def render_html(matrix: Matrix, reports_dir: str | None = None) -> str:
    """The page; links to trace files are relative to `reports_dir` (where the page is written)."""
    body = [
        "<h1>Conformance matrix</h1>",
        _banner(matrix),
        _summary_line(matrix),
        _legend(),
        _table(matrix),
        _failures(matrix, reports_dir),
        _expected_failures(matrix, reports_dir),
        _unsupported(matrix),
        _stale(matrix),
        _details(matrix),
    ]
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'><title>Conformance matrix</title>"
        f"<style>{_STYLE}</style></head><body>{''.join(body)}</body></html>\n"
    )


def _banner(matrix: Matrix) -> str:
    if not matrix.incomplete:
        return ""
    return (
        f'<p class="banner" id="incomplete">INCOMPLETE: {escape(matrix.incomplete)}. Cells count only the '
        'tests that ran; "not run" marks the rest.</p>'
    )


def _summary_line(matrix: Matrix) -> str:
    """The run in one line under the title (every detail at the end of the page)."""
    total: Counter[str] = Counter()
    for backend in matrix.backends:
        total.update(matrix.totals(backend))
    rows = dict(run_rows(matrix))
    context = " · ".join(f"{name} {rows[name]}" for name in ("torch", "device", "world sizes", "seed") if name in rows)
    when = f"{escape(rows['date'])} · {escape(context)} · " if rows else ""
    return (
        f'<p class="total">{when}<b>{sum(total.values())} tests: {escape(cell_text(total))}</b> '
        f'(<a href="#run">run details</a>)</p>'
    )


def _details(matrix: Matrix) -> str:
    rows = run_rows(matrix)
    if not rows:
        return ""
    shown = {name: f"<code>{escape(value)}</code>" if name == "command" else escape(value) for name, value in rows}
    cells = "".join(f"<tr><th>{escape(name)}</th><td>{value}</td></tr>" for name, value in shown.items())
    return f'<h2 id="run">Run details</h2><table class="details">{cells}</table>'


def _legend() -> str:
    keys = "".join(
        f'<div><span class="key" style="background:{colour}"></span><b>{escape(outcome)}</b>: '
        f"{escape(MEANINGS[outcome])}</div>"
        for outcome, colour in OUTCOME_COLOURS.items()
    )
    return f'<div class="legend" id="legend">{keys}</div>'


def _bar(counts: Counter[str]) -> str:
    segments = "".join(
        f'<span class="seg-{outcome.replace(" ", "-")}" style="flex:{counts[outcome]};background:'
        f'{OUTCOME_COLOURS[outcome]}"></span>'
        for outcome in OUTCOMES
        if counts[outcome]
    )
    return f'<div class="bar">{segments}</div>' if segments else ""


def _cell(counts: Counter[str], link: str | None, shown: str | None = None) -> str:
    """A cell's bar and text (`shown`: the text by device kind, `Matrix.cell`, where it differs)."""
    text = escape(shown or cell_text(counts))
    title = escape(shown or cell_text(counts), quote=True)
    content = f'{_bar(counts)}<div class="counts">{text}</div>'
    if link is not None:
        return f'<td class="cellfail" title="{title}"><a href="#{link}">{content}</a></td>'
    return f'<td title="{title}">{content}</td>'


def _table(matrix: Matrix) -> str:
    head = "".join(f"<th>{escape(b)}</th>" for b in matrix.backends)
    rows = []
    for scenario in matrix.scenarios:
        cells = []
        for backend in matrix.backends:
            counts = matrix.counts(scenario, backend)
            link = anchor(scenario, backend) if counts["fail"] else None
            cells.append(_cell(counts, link, matrix.cell(scenario, backend)))
        rows.append(f"<tr><th><code>{escape(scenario)}</code></th>{''.join(cells)}</tr>")
    totals = "".join(_cell(matrix.totals(b), None) for b in matrix.backends)
    return (
        f'<table class="matrix"><tr><th>scenario</th>{head}</tr>{"".join(rows)}<tr><th>total</th>{totals}</tr></table>'
    )


def _failures(matrix: Matrix, reports_dir: str | None) -> str:
    if not matrix.failures:
        return "<h2 id='failures'>Failures</h2><p>none</p>"
    parts = ["<h2 id='failures'>Failures</h2>"]
    number = 0
    for (scenario, backend), failures in sorted(matrix.failures.items()):
        parts.append(f'<h3 id="{anchor(scenario, backend)}">{escape(backend)}: <code>{escape(scenario)}</code></h3>')
        for failure in failures:
            number += 1
            parts.append(_failure(failure, number, matrix.traces.get(failure.test_id), reports_dir, matrix))
    return "".join(parts)


def _failure(failure: Failure, number: int, trace_path: str | None, reports_dir: str | None, matrix: Matrix) -> str:
    heading = escape(failure.test_id + matrix.on_device(failure.device))
    parts = [f'<section class="failure" id="failure-{number}"><h4>{heading}</h4>']
    if failure.reason:
        parts.append(f'<p class="reason">{escape(failure.reason)}</p>')
    if failure.repro:
        parts.append(f'<pre class="repro">{escape(failure.repro)}</pre>')
    if trace_path is not None:
        shown = os.path.relpath(trace_path, reports_dir) if reports_dir else trace_path
        link = f'<a class="trace-link" href="{_href(trace_path, reports_dir)}">{escape(shown)}</a>'
        parts.append(f"<p>collective trace: {link}</p>")
    if failure.trace is not None:
        parts.append(_trace_view(failure.trace))
    parts.append(f"<details><summary>failure text</summary><pre>{escape(failure.text)}</pre></details></section>")
    return "".join(parts)


def _trace_view(view: TraceView) -> str:
    """The first divergence with its timeline (when the ranks diverged), and the per-rank tables."""
    parts = [f"<p>{escape(f'first divergence: {view.divergence}')}</p>"] if view.divergence else []
    if view.diverged_at:
        parts.append(render_timeline(view))
    for rank, records in sorted(view.traces.items()):
        opened = " open" if len(records) <= _LONG_TRACE and view.diverged_at else ""
        parts.append(
            f"<details{opened}><summary>rank {rank}: {len(records)} collectives</summary>"
            f"{_trace_table(records, view.diverged_at.get(rank))}</details>"
        )
    return "".join(parts)


def _trace_table(records: Sequence[CollectiveRecord], diverged: int | None) -> str:
    """One rank's trace, the collective at the first divergence (its index, `diverged`) marked."""
    head = "".join(f"<th>{escape(column)}</th>" for column in SHOWN_COLUMNS)
    rows = []
    for record in records:
        marked = ' class="diverged"' if record.index == diverged else ""
        cells = trace_cells(record)
        rows.append(f"<tr{marked}>{''.join(f'<td>{escape(cells[column])}</td>' for column in SHOWN_COLUMNS)}</tr>")
    return f'<table class="trace"><tr>{head}</tr>{"".join(rows)}</table>'


def _expected_failures(matrix: Matrix, reports_dir: str | None) -> str:
    if not matrix.expected_failures:
        return ""
    rows = []
    for entry in matrix.expected_failures:
        link = f'<a href="{escape(entry.link, quote=True)}">{escape(entry.link)}</a>' if entry.link else "-"
        trace = matrix.traces.get(entry.test_id)
        trace_link = f'<a href="{_href(trace, reports_dir)}">trace</a>' if trace else "-"
        rows.append(
            f'<tr><td class="name">{escape(entry.backend)}</td><td><code>{escape(entry.test_id)}</code>'
            f"{escape(matrix.on_device(entry.device))}</td>"
            f'<td>{escape(entry.reason)}</td><td>{link}</td><td class="name">{trace_link}</td></tr>'
        )
    return (
        "<h2 id='expected-failures'>Expected failures</h2><table><tr><th>backend</th><th>test</th>"
        f"<th>reason</th><th>link</th><th>collectives</th></tr>{''.join(rows)}</table>"
    )


def _href(path: str, reports_dir: str | None) -> str:
    """A trace file as a link from the page (relative, so the reports directory can move)."""
    shown = os.path.relpath(path, reports_dir) if reports_dir else path
    return escape(shown.replace(os.sep, "/"), quote=True)


def _unsupported(matrix: Matrix) -> str:
    if not matrix.unsupported:
        return ""
    rows = "".join(
        f'<tr><td class="name">{escape(backend)}</td><td>{escape(reason)}</td><td>{count}</td></tr>'
        for (backend, reason), count in sorted(matrix.unsupported.items())
    )
    return (
        "<h2 id='unsupported'>Unsupported capabilities</h2><table><tr><th>backend</th><th>reason</th>"
        f"<th>tests</th></tr>{rows}</table>"
    )


def _stale(matrix: Matrix) -> str:
    if not matrix.stale:
        return ""
    items = "".join(f"<li>{escape(entry)}</li>" for entry in matrix.stale)
    return f"<h2 id='stale'>Stale expectations</h2><ul>{items}</ul>"
