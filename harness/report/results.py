"""What report plugins receive: one `DistributedTestResult` per distributed test, with every rank's case.

`HarnessSession.publish` builds each once, from pytest's final verdict and the ranks' results
(`rank_cases`: the one place where a rank's own story is reconciled with the verdict), and hands
it to the `pytest_harness_test_result` hook (see `harness.hookspecs`). Report plugins only
serialize it: the per-rank JUnit files (`harness.report.junit`), the trace files
(`harness.report.trace_tables`), the conformance matrix, any other format.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from harness.message_text import first_line, ranks_text
from harness.messages import RankLoss, RankResult, Status
from harness.trace.records import CollectiveRecord

if TYPE_CHECKING:
    import pytest


REASON_CHARS = 300
"""The longest one-line reason (`FailureReason.line`): a FAILED line, a matrix entry."""


@dataclass(frozen=True)
class FailureReason:
    """Why the ranks failed a test, as data: decided once, with the verdict (`decide`), and read by
    every report that explains a failure in one line (pytest's FAILED line, the conformance matrix)."""

    first_rank: int | None = None
    """The rank whose failure is its own while every other failed rank's is a consequence (see
    `first_failed_rank`); None when no one rank can be told apart."""
    cause: str = ""
    """The first failed rank's cause, with where it failed in the test's code: "AssertionError:
    mine at t.py:3", "exited with code 3" (empty without a `first_rank`)."""
    ranks_by_cause: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """Without a `first_rank`: every failed rank's cause (the exception its traceback ended in, or
    how it was lost), ranks with the same cause together, in the order of the verdict's account."""
    divergence: str = ""
    """"ranks issued divergent collectives: ..." when the trace diff failed the test, else empty."""
    outcomes: str = ""
    """Every rank's status ("distributed test failed: rank 0 skipped, rank 1 passed"): the reason
    left when no rank failed and the traces agree (ranks that disagreed on a skip)."""
    first_by: str = ""
    """How the `first_rank` was told: "time" (it failed `first_ahead_s` before `next_rank`, on
    clocks that allow the comparison), "message" (every other failed rank's failure is a
    consequence: a broken or timed-out collective, a stop by the harness); empty without one."""
    first_ahead_s: float = 0.0
    next_rank: int | None = None

    def line(self) -> str:
        """The reason as one line of at most `REASON_CHARS` characters."""
        if self.first_rank is not None and self.first_by == "time":
            ahead = f"{self.first_ahead_s:.3g} s before rank {self.next_rank}"
            text = f"rank {self.first_rank} failed first (by time: {ahead}): {self.cause}"
        elif self.first_rank is not None:
            text = f"rank {self.first_rank} failed first: {self.cause}"
        elif self.ranks_by_cause:
            text = "; ".join(f"{ranks_text(list(ranks))}: {cause}" for cause, ranks in self.ranks_by_cause)
        else:
            text = first_line(self.divergence or self.outcomes)
        return fit_reason(text)


def fit_reason(line: str) -> str:
    """`line` cut to `REASON_CHARS` characters, its end marked."""
    return line if len(line) <= REASON_CHARS else line[: REASON_CHARS - 3] + "..."


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
    """One rank's view of one test, as its per-rank report shows it: the test's verdict as the
    status, what this rank itself did as the message and text ("failed on another rank (this
    rank: passed): ...", its own traceback, how it was lost)."""

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
    """Every rank's case that this process knows of, by rank (each rank of the world at least)."""
    own_ranks: tuple[int, ...]
    """The ranks whose per-rank reports this process writes: every rank of a pool session; under
    torchrun only this process's own rank (each rank's process writes its own files)."""
    traces: Mapping[int, list[CollectiveRecord]] = field(default_factory=dict)
    """Every rank's collective trace, by rank; empty when no rank ran the test (or it was
    interrupted before their traces were read)."""
    divergence: str = ""
    """The first divergent collective across the ranks' traces (`Divergence.describe()`), also
    when the test expected it; empty when the traces agree."""
    diverged_at: Mapping[int, int | None] = field(default_factory=dict)
    """Where that divergence is in `traces` (`Divergence.positions()`): per rank of the divergent
    group or stream, the index (`CollectiveRecord.index`) of the collective it issued there, None
    for a rank that stopped before it; empty when the traces agree."""
    reason: FailureReason | None = None
    """Why the ranks failed the test (`FailureReason.line()`: one line), when pytest's failure is
    the ranks' verdict; None for any other outcome or failure (a setup error, an interrupt, a
    world that could not start, a plugin's verdict: `message` says why)."""
    repro: str = ""
    """The `REPRO:` line that re-runs the test, printed with the ranks' failure: set whenever their
    verdict failed (whatever pytest and its plugins made of it), else empty."""


def rank_cases(
    ranks: Iterable[int],
    outcome: Status,
    message: str,
    results: Mapping[int, RankResult],
    captured: Mapping[int, tuple[str, str]],
    divergence: str,
) -> dict[int, RankCase]:
    """Every rank's case of a test whose verdict pytest reported as `outcome` with `message`.

    `results` are the ranks' own results (empty when the parent decided before or instead of
    them), `captured` their (stdout, stderr), `divergence` the divergence heading of the ranks'
    verdict (empty when the traces agreed or the divergence was expected): a rank that took part
    in a divergence failed, whatever it reported.
    """
    cases = {}
    for rank in sorted({*ranks, *results}):
        result = results.get(rank)
        if result is None:
            cases[rank] = RankCase(outcome, 0.0, first_line(message), message)
            continue
        stdout, stderr = captured.get(rank, ("", ""))
        cases[rank] = _as_filed(_own_case(result, stdout, stderr, divergence), outcome, message)
    return cases


def _own_case(result: RankResult, stdout: str, stderr: str, divergence: str) -> RankCase:
    """What the rank itself did."""
    if isinstance(result, RankLoss):
        return RankCase("failed", result.duration_s, result.summary, result.account(stderr), stdout, stderr)
    if divergence and result.status != "failed":
        return RankCase("failed", result.duration_s, divergence, divergence, stdout, stderr)
    text = "\n".join(filter(None, [result.traceback or result.summary, divergence]))
    return RankCase(result.status, result.duration_s, result.summary, text, stdout, stderr)


def _as_filed(own: RankCase, outcome: Status, message: str) -> RankCase:
    """The rank's own case under the test's verdict: the verdict is the status (a CI reading one
    rank's file sees the run's outcome), the rank's story stays in the message and text."""
    if own.status == outcome:
        return own
    if outcome == "failed":
        summary = f"failed on another rank (this rank: {own.status}): {first_line(message)}"
        return RankCase(outcome, own.time_s, summary, f"{summary}\n\n{message}", own.stdout, own.stderr)
    if outcome == "xfailed":
        # The expected failure may be another rank's: the reason is the verdict's, the text this rank's.
        return RankCase(outcome, own.time_s, message, own.text, own.stdout, own.stderr)
    return RankCase(outcome, own.time_s, first_line(message), own.text, own.stdout, own.stderr)


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
