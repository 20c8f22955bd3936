"""The end of every run: what ran where, every report written, why tests were skipped, and whether
the run is complete; and a one-line reason on each failed distributed test's short-summary line.

`RunSummary` is a plugin (registered by `harness.plugin` as `harness-run-summary`). It learns what
ran from the report hooks like any report plugin (`pytest_harness_test_result`: device and world
size of every distributed test), counts skips by reason from pytest's reports, and at the
terminal summary writes one section:

    ============================ run summary ============================
    backends: reference, torch-fsdp2                  (lines of pytest_harness_summary_lines)
    harness: 12 distributed tests, 1 pool starts, 4 rank processes; device: cpu; world sizes: 2, 4
    skipped: 3 tests, by reason:
          2  unsupported: execution order validation: ...
          1  needs 4 GPUs, found 0
    reports: reports/junit/rank-0.xml, rank-1.xml, rank-2.xml, rank-3.xml
             reports/conformance.md, conformance.html
             reports/traces/ (1 file)
    INCOMPLETE: interrupted (KeyboardInterrupt) with 5 of 12 tests finished; the reports hold only the tests that ran

A failed distributed test's text starts with a per-rank account ("distributed test failed: rank 0
failed, rank 1 passed"), which says nothing on its own; pytest's short summary shows only the
first line. The verdict decided why, as data (`harness.report.results.FailureReason`: the rank
that failed first and its exception, a lost rank's cause, the first divergent collective);
`failure_reason` makes it one line, and that line becomes the report's crash message, which
pytest's `FAILED <nodeid> - <reason>` line and its junitxml `message` show (pytest fits the line
to the terminal's width; whole with -vv or on CI).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import Counter
from collections.abc import Callable, Generator
from typing import Any

import pytest

from harness.config import world_sizes
from harness.message_text import describe_exception, first_line, shown_path
from harness.report.results import DistributedTestResult, FailureReason, fit_reason, skip_reason

__all__ = ["RunSummary", "failure_reason", "incomplete_reason"]

TOP_SKIP_REASONS = 5
_INTERRUPT = pytest.StashKey[str]()  # what interrupted the session (pytest_keyboard_interrupt)


def failure_reason(reason: FailureReason | None, text: str = "") -> str:
    """One line that explains a failed test: the ranks' verdict's `reason` (`FailureReason.line()`,
    e.g. `DistributedTestResult.reason`) when their verdict is the failure, else the first line of
    the failure's `text` as whoever decided it wrote it: pytest (a setup error, pytest-timeout),
    the parent (a world that could not start) or a plugin (the conformance expectations).

    Where the ranks diverged and also failed, the divergence comes first and the ranks' failures
    after it, as its consequences: a gloo abort on a size mismatch ("killed by SIGABRT"), the
    timeouts of ranks left waiting, read alone, hide the collective that caused them. pytest
    fits the line to the terminal: the cut falls on the consequences."""
    if reason is None:
        lines = text.removeprefix("Failed: ").strip().splitlines()
        return fit_reason(lines[0].rstrip()) if lines else ""
    if reason.divergence and (reason.first_rank is not None or reason.ranks_by_cause):
        consequences = dataclasses.replace(reason, divergence="").line()
        return fit_reason(f"{first_line(reason.divergence)}; then {consequences}")
    return reason.line()


def incomplete_reason(session: pytest.Session, ran: int | None = None) -> str | None:
    """Why the run stopped before running every selected test (an interrupt, -x / --maxfail),
    None when it ran them all. `ran`: how many tests were reported, when the caller counted."""
    status = session.exitstatus
    if status == pytest.ExitCode.INTERRUPTED:
        why = f"interrupted ({session.config.stash.get(_INTERRUPT, 'KeyboardInterrupt')})"
    elif session.shouldfail:
        why = f"stopped early ({session.shouldfail})"
    elif session.shouldstop:
        why = f"stopped early ({session.shouldstop})"
    else:
        return None
    selected = len(getattr(session, "items", []) or [])
    if ran is not None and selected:
        why += f" with {ran} of {selected} tests finished"
    return why


class RunSummary:
    """Collects what the end-of-run section says; see the module's docstring."""

    def __init__(
        self,
        config: pytest.Config,
        reports_dir: str,
        harness_summary: Any,
        verdict_reason: Callable[[pytest.Item, pytest.TestReport], FailureReason | None],
    ) -> None:
        self.config = config
        self.reports_dir = reports_dir
        self.harness_summary = harness_summary  # () -> "N distributed tests, ..." (the session's)
        # (item, its failed call report) -> the ranks' FailureReason, when the report still shows
        # their verdict: the session's (`HarnessSession` keeps the verdict on the item).
        self.verdict_reason = verdict_reason
        self.started = time.time()
        self.devices: Counter[str] = Counter()
        self.world_sizes: set[int] = set()
        # The world sizes each device kind ran (under --device auto, CUDA for some, CPU for others).
        self.device_world_sizes: dict[str, set[int]] = {}
        self.skips: Counter[str] = Counter()
        self.reported: set[str] = set()
        self.incomplete: str | None = None

    # -- what ran ------------------------------------------------------------------------------
    def pytest_harness_test_result(self, item: pytest.Item, result: DistributedTestResult) -> None:
        self.devices[result.suite.device] += 1
        self.world_sizes.add(result.suite.world_size)
        self.device_world_sizes.setdefault(result.suite.device, set()).add(result.suite.world_size)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" or report.failed or report.skipped:
            self.reported.add(report.nodeid)
        if report.skipped and not hasattr(report, "wasxfail"):
            text = skip_reason(report)
            self.skips[text.splitlines()[0] if text else "skipped"] += 1

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
        report = yield
        # The call phase: the ranks' verdict (or the text a plugin made of it); a fixture's
        # error in setup or teardown keeps pytest's own message, its exception.
        if report.failed and report.when == "call" and world_sizes.is_distributed(item):
            give_reason(report, failure_reason(self.verdict_reason(item, report), report.longreprtext))
        return report

    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        """Ctrl-C, SIGTERM (`harness.config.signals`), or pytest's own stop ("1 error during collection")."""
        self.config.stash[_INTERRUPT] = describe_exception(excinfo.value)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.incomplete = incomplete_reason(session, len(self.reported))

    # -- the section ---------------------------------------------------------------------------
    def lines(self, report_paths: list[str]) -> list[str]:
        hook = self.config.hook.pytest_harness_summary_lines
        contributed = [line for lines in hook(config=self.config) for line in lines]
        harness = f"harness: {self.harness_summary()}"
        if len(self.devices) == 1:
            harness += f"; device: {', '.join(sorted(self.devices))}"
            harness += f"; world sizes: {', '.join(map(str, sorted(self.world_sizes)))}"
        elif self.devices:
            # Each verdict's device: which tests ran where is not the same for every world size.
            harness += "; devices: " + ", ".join(
                f"{device} ({count} test{'s' * (count != 1)} at world size"
                f"{'s' * (len(self.device_world_sizes[device]) != 1)} "
                f"{', '.join(map(str, sorted(self.device_world_sizes[device])))})"
                for device, count in sorted(self.devices.items())
            )
        lines = [*contributed, harness]
        if self.skips:
            total = sum(self.skips.values())
            lines.append(f"skipped: {total} test{'s' * (total != 1)}, by reason:")
            width = len(str(max(self.skips.values())))
            for text, count in self.skips.most_common(TOP_SKIP_REASONS):
                lines.append(f"  {count:>{width}}  {text}")
            if len(self.skips) > TOP_SKIP_REASONS:
                rest = len(self.skips) - TOP_SKIP_REASONS
                lines.append(f"  ({rest} more reason{'s' * (rest != 1)}: -rs lists every skip)")
        files = [path for path in report_paths if not os.path.isdir(path)]
        folders = [line for path in report_paths if os.path.isdir(path) and (line := self._folder(path))]
        for index, entry in enumerate(_grouped(files) + folders):
            lines.append(("reports: " if index == 0 else "         ") + entry)
        if self.incomplete:
            lines.append(f"INCOMPLETE: {self.incomplete}; the reports hold only the tests that ran")
        return lines

    def _folder(self, directory: str) -> str:
        """A report plugin's directory (reports/traces/), with the files this run wrote in it (it may
        hold older ones); "" when it wrote none."""
        try:
            names = os.listdir(directory)
        except OSError:
            return ""
        fresh = [n for n in names if os.path.getmtime(os.path.join(directory, n)) >= self.started - 1]
        if not fresh:
            return ""
        return f"{shown_path(directory)}{os.sep} ({len(fresh)} file{'s' * (len(fresh) != 1)} from this run)"

    def write(self, terminalreporter: Any, report_paths: list[str]) -> None:
        terminalreporter.section("run summary", sep="=", red=bool(self.incomplete))
        for line in self.lines(report_paths):
            terminalreporter.write_line(line, red=line.startswith("INCOMPLETE"))


def give_reason(report: pytest.TestReport, line: str) -> None:
    """Make `line` the failed report's crash message (what the short summary and junitxml show)."""
    if not line:
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None and dataclasses.is_dataclass(crash):
        report.longrepr.reprcrash = dataclasses.replace(crash, message=line)  # type: ignore[union-attr]
    elif isinstance(report.longrepr, str):
        report.longrepr = ReasonedText(report.longrepr, line)


@dataclasses.dataclass
class _Crash:
    message: str
    path: str = ""
    lineno: int = 0


class ReasonedText:
    """A failure text with a crash message: pytest reads `reprcrash.message` for the short summary
    line. A plugin's plain-text verdict (the conformance expectations') has none; pytest 9 shows a
    text's first line itself, older pytest 8 releases showed nothing, so the text gets one."""

    def __init__(self, text: str, line: str) -> None:
        self.text = text
        self.reprcrash = _Crash(line)

    def toterminal(self, out: Any) -> None:
        out.line(self.text)

    def __str__(self) -> str:
        return self.text


def _grouped(paths: list[str]) -> list[str]:
    """Paths one directory a line: "reports/junit/rank-0.xml, rank-1.xml"."""
    by_directory: dict[str, list[str]] = {}
    for path in paths:
        directory, name = os.path.split(shown_path(path))
        by_directory.setdefault(directory, []).append(name)
    return [os.path.join(folder, ", ".join(names)) for folder, names in by_directory.items()]
