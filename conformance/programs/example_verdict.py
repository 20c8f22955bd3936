"""Parent side: what one generated example's SPMD call means, and the text a failure prints.

Every rank ran :func:`conformance.programs.run.run_program`; the harness returns each rank's
:class:`~conformance.programs.run.ProgramReport` or failure, and the trace diff. An example
fails when a rank failed (raised, hung, died), the ranks issued divergent collectives, or a rank
found something wrong, unless every finding is one the backend's expectations record for a
program of this shape (:class:`KnownFinding`, from ``[[generated_finding]]``): then it is set
aside as known. The text names the program, operation by operation, what each rank found at
which operation, and how to replay exactly that program.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from conformance.programs.patterns import PATTERNS
from conformance.programs.program import Program
from conformance.programs.run import ProgramReport


class KnownFinding(Protocol):
    """A recorded generated finding (``conformance.suite.expectations.GeneratedFinding``)."""

    pattern: str
    reason: str

    def explains(self, finding: str) -> bool: ...


class CallResult(Protocol):
    """What the harness returns for one SPMD call (``harness.SpmdResult``)."""

    ok: bool
    values: dict[int, Any]
    failures: dict[int, str]
    results: dict[int, Any]
    divergence: str | None

    def describe(self) -> str: ...


Kind = Literal["passed", "failed", "known", "repeat"]
"""``repeat``: a failure a campaign has already found and shrunk (set by the campaign, not by
:func:`judge`)."""


@dataclass
class ExampleVerdict:
    kind: Kind
    text: str = ""
    known: list[KnownFinding] = field(default_factory=list)
    sharded: bool = False
    """Whether the backend showed it sharded something (vacuity evidence, over the whole run)."""
    root_cause: frozenset[str] = frozenset()
    """What identifies a failure, as data: the ranks' ``ProgramReport.root_cause`` (each rank's
    findings at its first failing operation, by check, no numbers), or what ended it (a
    rank lost, divergent collectives). A campaign sets aside a failure whose root cause it has
    already found (``conformance.suite.generation``)."""


class GeneratedProgramFailed(AssertionError):
    """A generated program that a backend fails; its text is the whole report, and
    ``root_cause`` what a campaign tells its findings apart by (``ExampleVerdict.root_cause``)."""

    def __init__(self, report: str, root_cause: frozenset[str] = frozenset()) -> None:
        super().__init__(report)
        self.root_cause = root_cause


def judge(program: Program, result: CallResult, known: Sequence[KnownFinding]) -> ExampleVerdict:
    """The verdict of one example from its SPMD call's result."""
    applicable = [entry for entry in known if PATTERNS[entry.pattern](program)]
    if not result.ok:
        # A known finding that a rank raised: every rank that returned found only known findings
        # (its exception among them), and every rank that failed raised a known one too or was
        # stopped because of a peer (waiting in a collective the raising rank never issued).
        returned: list[ProgramReport] = [result.values[rank] for rank in sorted(result.values)]
        texts = [finding for report in returned for finding in report.findings]
        texts += [
            text
            for rank, text in result.failures.items()
            if not getattr(result.results.get(rank), "after_peer_failed", False)
        ]
        if texts and all(any(entry.explains(text) for entry in applicable) for text in texts):
            return ExampleVerdict("known", known=_used(applicable, texts))
        lost = {
            f"a rank did not finish: {type(outcome).__name__}"
            for outcome in result.results.values()
            if not getattr(outcome, "after_peer_failed", False) and getattr(outcome, "status", "") == "failed"
        }
        return ExampleVerdict(
            "failed",
            f"the ranks did not all finish the program:\n{result.describe()}",
            root_cause=_root_cause(returned) | lost,
        )
    reports: list[ProgramReport] = [result.values[rank] for rank in sorted(result.values)]
    sharded = any(report.sharded for report in reports)
    unsupported = sorted({report.unsupported for report in reports if report.unsupported})
    if unsupported:
        return ExampleVerdict(
            "failed",
            "the backend refused, as unsupported, a program drawn only from what it declares: "
            + "; ".join(unsupported)
            + "\nits CAPABILITIES / UNSUPPORTED_COMBINATIONS do not say what it refuses: declare it there",
            root_cause=frozenset({"refused as unsupported"}),
        )
    # A first iteration whose forward order differs between ranks, refused by every rank: the
    # backend's order check exchanged each rank's unit (its collectives carry different unit
    # labels by design) and raised before any mismatched all-gather.
    refused_on_purpose = bool(reports) and all(report.refused for report in reports) and program.divergent_order
    findings = [finding for report in reports for finding in report.findings]
    unexplained = [f for f in findings if not any(entry.explains(f) for entry in applicable)]
    # A rank that raised a known finding left the program early; the collectives its peers went
    # on to issue without it, and what they raised then, are that exception's consequence.
    after_known_raise = _first_raise_is_known(reports, applicable)
    if after_known_raise and all(report.raised_at is not None for report in reports):
        return ExampleVerdict("known", known=_used(applicable, findings), sharded=sharded)
    if result.divergence and not refused_on_purpose and not after_known_raise:
        return ExampleVerdict(
            "failed",
            f"the ranks issued divergent collectives:\n{result.divergence}",
            sharded=sharded,
            root_cause=_root_cause(reports) | {"divergent collectives"},
        )
    if not findings:
        return ExampleVerdict("passed", sharded=sharded)
    if not unexplained:
        return ExampleVerdict("known", known=_used(applicable, findings), sharded=sharded)
    return ExampleVerdict("failed", "\n".join(unexplained), sharded=sharded, root_cause=_root_cause(reports))


def _first_raise_is_known(reports: Sequence[ProgramReport], applicable: Sequence[KnownFinding]) -> bool:
    """Whether the rank(s) that raised first found only what ``applicable`` explains."""
    raised = [report for report in reports if report.raised_at is not None]
    if not raised:
        return False
    first = min(report.raised_at for report in raised if report.raised_at is not None)
    causes = [report for report in raised if report.raised_at == first]
    return all(any(entry.explains(f) for entry in applicable) for report in causes for f in report.findings)


def _root_cause(reports: Sequence[ProgramReport]) -> frozenset[str]:
    return frozenset(cause for report in reports for cause in report.root_cause)


def _used(applicable: Sequence[KnownFinding], findings: Sequence[str]) -> list[KnownFinding]:
    return [entry for entry in applicable if any(entry.explains(f) for f in findings)]


def failure_text(backend: str, program: Program, verdict: ExampleVerdict, repro: str) -> str:
    """The report of a failing example: the program, what went wrong, the REPRO command."""
    lines = [f"generated program fails on {backend}:"]
    lines += [f"  {line}" for line in program.lines()]
    lines += ["what went wrong:"]
    lines += [f"  {line}" for line in verdict.text.splitlines()]
    lines += [f"REPRO: {repro}"]
    return "\n".join(lines)
