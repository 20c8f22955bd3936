"""The conformance matrix: scenario x backend with pass / fail / expected-fail / unsupported counts.

Written after a run as `reports/conformance.md` (for a CI job summary) and
`reports/conformance.html`, where each failed cell links to its failures' text and repro lines.
Stale expected-failure entries (see `conformance.expectations`) get a section of their own.
"""

from __future__ import annotations

import html
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

OUTCOMES = ("pass", "fail", "expected-fail", "unsupported", "skip")
_REPRO = re.compile(r"^REPRO: .*$", re.M)
_MAX_TEXT = 6000


@dataclass
class Failure:
    test_id: str
    text: str

    @property
    def repro(self) -> str:
        found = _REPRO.findall(self.text)
        return found[-1] if found else ""


@dataclass
class Matrix:
    cells: dict[tuple[str, str], Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    failures: dict[tuple[str, str], list[Failure]] = field(default_factory=lambda: defaultdict(list))
    unsupported: Counter[tuple[str, str]] = field(default_factory=Counter)
    backends: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)  # one line per stale expectation entry

    def record(self, scenario: str, backend: str, test_id: str, outcome: str, text: str) -> None:
        if backend not in self.backends:
            self.backends.append(backend)
        self.cells[scenario, backend][outcome] += 1
        if outcome == "fail":
            self.failures[scenario, backend].append(Failure(test_id, text[-_MAX_TEXT:]))
        elif outcome == "unsupported":
            self.unsupported[backend, text.split("\n")[0][:200]] += 1

    @property
    def scenarios(self) -> list[str]:
        return sorted({scenario for scenario, _ in self.cells})

    def totals(self, backend: str) -> Counter[str]:
        total: Counter[str] = Counter()
        for (_, cell_backend), counts in self.cells.items():
            if cell_backend == backend:
                total.update(counts)
        return total


def classify(outcome: str, wasxfail: str | None, skip_reason: str) -> str:
    if outcome == "skipped" and wasxfail:
        return "expected-fail"
    if outcome == "skipped":
        return "unsupported" if skip_reason.startswith("unsupported:") else "skip"
    return {"passed": "pass", "failed": "fail"}.get(outcome, outcome)


def _cell_text(counts: Counter[str]) -> str:
    return " / ".join(f"{counts[o]} {o}" for o in OUTCOMES if counts[o]) or "-"


def _anchor(scenario: str, backend: str) -> str:
    return "fail-" + re.sub(r"[^A-Za-z0-9]+", "-", f"{backend}-{scenario}").strip("-")


def render_markdown(matrix: Matrix) -> str:
    lines = [
        "# Conformance matrix",
        "",
        "| scenario | " + " | ".join(matrix.backends) + " |",
        "| --- |" + " --- |" * len(matrix.backends),
    ]
    for scenario in matrix.scenarios:
        cells = []
        for backend in matrix.backends:
            counts = matrix.cells.get((scenario, backend), Counter())
            text = _cell_text(counts)
            cells.append(f"**{text}**" if counts["fail"] else text)
        lines.append(f"| `{scenario}` | " + " | ".join(cells) + " |")
    lines.append("| **total** | " + " | ".join(_cell_text(matrix.totals(b)) for b in matrix.backends) + " |")
    if matrix.unsupported:
        lines += ["", "## Unsupported capabilities", "", "| backend | reason | tests |", "| --- | --- | --- |"]
        for (backend, reason), count in sorted(matrix.unsupported.items()):
            lines.append(f"| {backend} | {reason} | {count} |")
    if matrix.stale:
        lines += ["", "## Stale expectations", ""]
        lines += [f"- {entry}" for entry in matrix.stale]
    if matrix.failures:
        lines += ["", "## Failures", ""]
        for (_scenario, _backend), failures in sorted(matrix.failures.items()):
            for failure in failures:
                first = next((line for line in failure.text.splitlines() if line.strip()), "")
                lines.append(f"- `{failure.test_id}`: {first[:300]}")
                if failure.repro:
                    lines.append(f"  `{failure.repro}`")
    return "\n".join(lines) + "\n"


def render_html(matrix: Matrix) -> str:
    esc = html.escape
    head = "".join(f"<th>{esc(b)}</th>" for b in matrix.backends)
    rows = []
    for scenario in matrix.scenarios:
        cells = []
        for backend in matrix.backends:
            counts = matrix.cells.get((scenario, backend), Counter())
            text = esc(_cell_text(counts))
            if counts["fail"]:
                cells.append(f'<td class="fail"><a href="#{_anchor(scenario, backend)}">{text}</a></td>')
            else:
                status = "xfail" if counts["expected-fail"] else "unsup" if counts["unsupported"] else "ok"
                cells.append(f'<td class="{status}">{text}</td>')
        rows.append(f"<tr><th>{esc(scenario)}</th>{''.join(cells)}</tr>")
    totals = "".join(f"<td>{esc(_cell_text(matrix.totals(b)))}</td>" for b in matrix.backends)
    details = []
    for (scenario, backend), failures in sorted(matrix.failures.items()):
        details.append(f'<h3 id="{_anchor(scenario, backend)}">{esc(backend)}: {esc(scenario)}</h3>')
        for failure in failures:
            details.append(f"<h4>{esc(failure.test_id)}</h4>")
            if failure.repro:
                details.append(f"<p><code>{esc(failure.repro)}</code></p>")
            details.append(f"<pre>{esc(failure.text)}</pre>")
    stale = "".join(f"<li>{esc(entry)}</li>" for entry in matrix.stale)
    stale_section = f"<h2>Stale expectations</h2><ul>{stale}</ul>" if stale else ""
    style = (
        "body{font-family:sans-serif}table{border-collapse:collapse}td,th{border:1px solid #999;"
        "padding:3px 8px;text-align:left}.fail{background:#f8c0c0}.xfail{background:#f4e6b0}"
        ".unsup{background:#dde4f0}.ok{background:#c8ecc8}pre{background:#f4f4f4;padding:6px;overflow:auto}"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>Conformance matrix</title>"
        f"<style>{style}</style></head><body><h1>Conformance matrix</h1>"
        f"<table><tr><th>scenario</th>{head}</tr>{''.join(rows)}<tr><th>total</th>{totals}</tr></table>"
        f"{stale_section}<h2>Failures</h2>{''.join(details) or '<p>none</p>'}</body></html>\n"
    )
