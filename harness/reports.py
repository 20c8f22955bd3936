"""What report plugins receive: one `DistributedTestResult` per distributed test, with every rank's case.

The harness builds these from the verdict and the ranks' results and hands each to the
`pytest_harness_test_result` hook (see `harness.hookspecs`); the per-rank JUnit files
(`harness.junit`) are one implementer, any other report format is another.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness.messages import RankLoss, RankResult, Status

if TYPE_CHECKING:
    import pytest


@dataclass(frozen=True)
class SuiteKey:
    """Which suite a test belongs to in a report: tests with equal keys are grouped together.

    `properties` come from the `pytest_harness_suite_properties` hook (e.g. the conformance
    plugin's `("backend", "torch-fsdp2")`), in the order the implementations gave them.
    """

    world_size: int
    device: str
    properties: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class RankCase:
    """One rank's view of one test, as its per-rank report shows it."""

    status: Status
    time_s: float
    message: str = ""
    """One line: the failure's summary or the skip reason."""
    text: str = ""
    """The full failure text (traceback, cause and stacks, divergence)."""
    stdout: str = ""
    stderr: str = ""


@dataclass(frozen=True)
class DistributedTestResult:
    """One distributed test's result, as every report hook implementation receives it."""

    nodeid: str
    name: str
    """The test's name within its module or class, with parameters (pytest's `item.name`)."""
    suite: SuiteKey
    outcome: Status
    """The verdict pytest reports."""
    message: str
    """The verdict's text: the failure report or the skip reason (empty for a pass)."""
    cases: dict[int, RankCase]
    """Every rank's case that this process knows of, by rank."""
    own_ranks: tuple[int, ...]
    """The ranks whose per-rank reports this process writes: every rank of a pool session; under
    torchrun only this process's own rank (each rank's process writes its own files)."""


def uniform_cases(ranks: Iterable[int], status: Status, message: str, text: str = "") -> dict[int, RankCase]:
    """The same case for every rank: for verdicts reached before any rank ran (skips, start-up failures)."""
    return {rank: RankCase(status, 0.0, message, text) for rank in ranks}


def rank_case(result: RankResult, stdout: str, stderr: str, divergence: str) -> RankCase:
    """One rank's case: its own status, except that a rank which took part in a divergence fails.

    `divergence` is the verdict's divergence heading, empty when the traces agreed or the
    divergence was expected.
    """
    if isinstance(result, RankLoss):
        raised = f"--- raised, before the rank was lost ---\n{result.raised}\n" if result.raised else ""
        text = f"{result.summary}\n{raised}{result.stacks}\n--- stderr ---\n{stderr}"
        return RankCase("failed", result.duration_s, result.summary, text, stdout, stderr)
    if divergence and result.status != "failed":
        return RankCase("failed", result.duration_s, divergence, divergence, stdout, stderr)
    text = "\n".join(filter(None, [result.traceback or result.summary, divergence]))
    return RankCase(result.status, result.duration_s, result.summary, text, stdout, stderr)


def skip_reason(report: pytest.TestReport) -> str:
    """The reason a skipped pytest report gives, as the test wrote it ("" for a report that is no skip).

    pytest keeps a skip's reason as the third item of its `(path, line, "Skipped: reason")` tuple;
    a report whose longrepr a plugin replaced with text gives that text.
    """
    if not report.skipped:
        return ""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else report.longreprtext
    return str(text).removeprefix("Skipped: ")
