"""The conformance matrix: scenario x backend with pass / fail / expected-fail / unsupported counts.

Written after a run as `reports/conformance.md` (for a CI job summary, rendered here) and
`reports/conformance.html` (`conformance.report.html`: the page people open first). Both say when
the run was incomplete (interrupted, -x): every test collected but not run is counted as
"not run" in its cell, so an interrupted run never looks complete. Stale expected-failure
entries (see `conformance.suite.expectations`) get a section of their own.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from conformance.report.trace_view import TraceView

OUTCOMES = ("pass", "fail", "expected-fail", "unsupported", "skip", "not run")
_MAX_TEXT = 6000


@dataclass
class Failure:
    test_id: str
    text: str
    """The failure's text as pytest printed it, a distributed test's `REPRO:` line last (its end,
    at most `_MAX_TEXT` characters)."""
    reason: str = ""  # one line that explains it (harness.failure_reason)
    repro: str = ""  # the `REPRO:` line that re-runs it (harness.DistributedTestResult.repro), if any
    trace: TraceView | None = None  # the ranks' collective traces, for a distributed test that had ranks
    device: str | None = None  # the device kind its verdict was reached on


@dataclass(frozen=True)
class ExpectedFailure:
    """A test that failed as its backend's expectations file says, with the entry's reason."""

    backend: str
    test_id: str
    reason: str
    link: str | None = None
    device: str | None = None


@dataclass
class RunDetails:
    """What the run was: shown above the matrix."""

    command: str
    date: str
    seed: str
    torch_version: str
    python_version: str
    backends: dict[str, str]  # name -> where it came from, with its library's version


@dataclass
class Matrix:
    cells: dict[tuple[str, str], Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    failures: dict[tuple[str, str], list[Failure]] = field(default_factory=lambda: defaultdict(list))
    unsupported: Counter[tuple[str, str]] = field(default_factory=Counter)
    backends: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)  # one line per stale expectation entry
    planned: Counter[tuple[str, str]] = field(default_factory=Counter)  # tests selected per cell
    expected_failures: list[ExpectedFailure] = field(default_factory=list)
    devices: set[str] = field(default_factory=set)
    # Per cell, its outcomes by the device kind each was reached on (shown when the run used several).
    cell_devices: dict[tuple[str, str], dict[str, Counter[str]]] = field(default_factory=dict)
    world_sizes: set[int] = field(default_factory=set)
    run: RunDetails | None = None
    incomplete: str | None = None  # why the run stopped early (harness.incomplete_reason)
    traces: dict[str, str] = field(default_factory=dict)  # test id -> the trace file the harness wrote for it

    def plan(self, scenario: str, backend: str) -> None:
        """A selected test of this cell: one not recorded by the end is counted "not run"."""
        if backend not in self.backends:
            self.backends.append(backend)
        self.planned[scenario, backend] += 1

    def record(
        self,
        scenario: str,
        backend: str,
        test_id: str,
        outcome: str,
        text: str,
        *,
        reason: str = "",
        link: str | None = None,
        device: str | None = None,
        world_size: int | None = None,
        repro: str = "",
        trace: TraceView | None = None,
    ) -> None:
        """One test's outcome. `reason`: a failure's one line, an expected failure's entry reason
        (with the entry's `link`); `repro` and `trace`: a failed distributed test's `REPRO:` line
        (printed after `text`) and collective traces."""
        if backend not in self.backends:
            self.backends.append(backend)
        self.cells[scenario, backend][outcome] += 1
        if device is not None:
            self.devices.add(device)
            self.cell_devices.setdefault((scenario, backend), {}).setdefault(device, Counter())[outcome] += 1
        if world_size is not None:
            self.world_sizes.add(world_size)
        if outcome == "fail":
            printed = "\n".join(filter(None, [text, repro]))
            failure = Failure(test_id, printed[-_MAX_TEXT:], reason, repro, trace, device)
            self.failures[scenario, backend].append(failure)
        elif outcome == "expected-fail":
            self.expected_failures.append(ExpectedFailure(backend, test_id, reason, link, device))
        elif outcome == "unsupported":
            self.unsupported[backend, text.split("\n")[0][:200]] += 1

    def counts(self, scenario: str, backend: str) -> Counter[str]:
        """The cell's outcomes, with the selected tests that never reported as "not run"."""
        counts = Counter(self.cells.get((scenario, backend), Counter()))
        missing = self.planned[scenario, backend] - sum(counts.values())
        if missing > 0:
            counts["not run"] = missing
        return counts

    @property
    def scenarios(self) -> list[str]:
        return sorted({scenario for scenario, _ in self.cells} | {scenario for scenario, _ in self.planned})

    def cell(self, scenario: str, backend: str) -> str:
        """The cell's text: its counts, by device kind when the run reached verdicts on several
        (under `--device auto` a scenario may run on CUDA at one world size and on CPU at another)."""
        counts = self.counts(scenario, backend)
        by_device = self.cell_devices.get((scenario, backend), {})
        if len(self.devices) < 2 or not by_device:
            return cell_text(counts)
        recorded = sum(sum(outcomes.values()) for outcomes in by_device.values())
        parts = [f"{device}: {cell_text(outcomes)}" for device, outcomes in sorted(by_device.items())]
        if counts["not run"]:
            parts.append(f"{counts['not run']} not run")
        elif recorded < sum(counts.values()):
            parts.append(f"elsewhere: {sum(counts.values()) - recorded}")
        return "; ".join(parts)

    def on_device(self, device: str | None) -> str:
        """` (on cuda)` after a test's id when the run used several device kinds, else nothing."""
        return f" (on {device})" if device and len(self.devices) > 1 else ""

    def totals(self, backend: str) -> Counter[str]:
        total: Counter[str] = Counter()
        for scenario in self.scenarios:
            total.update(self.counts(scenario, backend))
        return total


def classify(outcome: str, wasxfail: str | None, skip_reason: str) -> str:
    if outcome == "skipped" and wasxfail:
        return "expected-fail"
    if outcome == "skipped":
        return "unsupported" if skip_reason.startswith("unsupported:") else "skip"
    return {"passed": "pass", "failed": "fail"}.get(outcome, outcome)


def classify_status(status: str, skip_reason: str) -> str:
    """A distributed test's outcome as the harness published it (`harness.DistributedTestResult.outcome`)."""
    return "expected-fail" if status == "xfailed" else classify(status, None, skip_reason)


def cell_text(counts: Counter[str]) -> str:
    return " / ".join(f"{counts[o]} {o}" for o in OUTCOMES if counts[o]) or "-"


def anchor(scenario: str, backend: str) -> str:
    return "fail-" + re.sub(r"[^A-Za-z0-9]+", "-", f"{backend}-{scenario}").strip("-")


def render_markdown(matrix: Matrix) -> str:
    lines = ["# Conformance matrix", ""]
    if matrix.incomplete:
        notice = 'cells count only the tests that ran ("not run": the rest)'
        lines += [f"**INCOMPLETE: {matrix.incomplete}**; {notice}.", ""]
    if matrix.run is not None:
        lines += [f"{name}: {value}  " for name, value in run_rows(matrix)] + [""]
    lines += [
        "| scenario | " + " | ".join(matrix.backends) + " |",
        "| --- |" + " --- |" * len(matrix.backends),
    ]
    for scenario in matrix.scenarios:
        cells = []
        for backend in matrix.backends:
            counts = matrix.counts(scenario, backend)
            text = matrix.cell(scenario, backend)
            cells.append(f"**{text}**" if counts["fail"] else text)
        lines.append(f"| `{scenario}` | " + " | ".join(cells) + " |")
    lines.append("| **total** | " + " | ".join(cell_text(matrix.totals(b)) for b in matrix.backends) + " |")
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
                first = failure.reason or next((line for line in failure.text.splitlines() if line.strip()), "")
                lines.append(f"- `{failure.test_id}`{matrix.on_device(failure.device)}: {first[:300]}")
                if failure.repro:
                    lines.append(f"  `{failure.repro}`")
    return "\n".join(lines) + "\n"


def run_rows(matrix: Matrix) -> list[tuple[str, str]]:
    """The run's details as (name, value) rows; none before the plugin set `matrix.run`."""
    run = matrix.run
    if run is None:
        return []
    rows = [
        ("date", run.date),
        ("command", run.command),
        ("torch", run.torch_version),
        ("Python", run.python_version),
        ("seed", run.seed),
        ("device", ", ".join(sorted(matrix.devices)) or "-"),
        ("world sizes", ", ".join(map(str, sorted(matrix.world_sizes))) or "-"),
    ]
    return rows + [(f"backend {name}", origin) for name, origin in run.backends.items()]
