"""Turn N per-rank results into one pytest outcome and its failure text."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from harness.messages import RankOutcome
from harness.pool import RankLoss, RankResult

Outcome = Literal["passed", "failed", "skipped", "xfailed"]


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    message: str
    pool_reusable: bool
    divergence: str = ""


def rank_status(result: RankResult) -> str:
    return "failed" if isinstance(result, RankLoss) else result.status


def rank_summary(result: RankResult) -> str:
    if isinstance(result, RankLoss):
        return f"rank {result.rank} {result.cause}"
    return result.summary


def decide(results: dict[int, RankResult], divergence: str | None = None,
           divergence_expected: bool = False, unfinished: str | None = None) -> Verdict:
    """All ranks must agree: one failing rank fails the test; ranks disagreeing on a skip fail it too.

    A divergence between the ranks' collective traces fails a test that would otherwise pass
    (silent corruption is the bug) unless the test declared it expected; it is added to the
    text of a test that failed anyway, expected or not, since it usually explains the failure,
    and so are the collectives ranks were stuck in (`unfinished`).

    The pool may be reused only when every rank answered and all report the same sync state
    (collectives issued on the default group, groups created): then nothing is left half-done.
    """
    statuses = {rank: rank_status(result) for rank, result in results.items()}
    answered = [r for r in results.values() if isinstance(r, RankOutcome)]
    reusable = len(answered) == len(results) and len({r.sync_state for r in answered}) == 1
    distinct = set(statuses.values())
    if unfinished and "failed" in distinct:
        results_text = f"{failure_text(results)}\n\nunfinished collectives: {unfinished}"
    else:
        results_text = failure_text(results)
    if divergence and not (divergence_expected and "failed" not in distinct):
        heading = f"ranks issued divergent collectives: {divergence}"
        if distinct == {"passed"}:
            return Verdict("failed", heading, reusable, heading)
        return Verdict("failed", f"{results_text}\n\n{heading}", reusable, heading)
    if distinct == {"passed"}:
        return Verdict("passed", "", reusable)
    if distinct in ({"skipped"}, {"xfailed"}):
        reasons = sorted({rank_summary(r) for r in results.values()})
        return Verdict(distinct.pop(), "; ".join(reasons), reusable)  # type: ignore[arg-type]
    return Verdict("failed", results_text, reusable)


def failure_text(results: dict[int, RankResult]) -> str:
    lines = ["distributed test failed: " + ", ".join(
        f"rank {rank} {rank_status(result)}" for rank, result in results.items())]
    for rank, result in results.items():
        status = rank_status(result)
        if status == "passed":
            continue
        lines.append("")
        lines.append(f"{'=' * 20} rank {rank}: {status} {'=' * 20}")
        if isinstance(result, RankLoss):
            lines.append(f"rank {rank} {result.cause}")
            if result.stacks:
                lines.append(f"--- rank {rank} Python stacks ---")
                lines.append(result.stacks.rstrip())
        elif status == "failed":
            lines.append(result.traceback.rstrip() or result.summary)
        else:
            lines.append(f"{status} on this rank only: {result.summary}")
    return "\n".join(lines)
