"""What N per-rank results mean: one pytest outcome with its text, and whether the world can go on."""

from __future__ import annotations

from dataclasses import dataclass

from harness.messages import RankLoss, RankOutcome, RankResult, Status
from harness.tracefile import CollectiveRecord, last_unfinished


@dataclass(frozen=True)
class Verdict:
    outcome: Status
    message: str
    divergence: str = ""
    """The divergence heading when the trace diff failed the test, else empty."""


def decide(
    results: dict[int, RankResult],
    divergence: str | None = None,
    divergence_expected: bool = False,
    unfinished: str | None = None,
) -> Verdict:
    """All ranks must agree: one failing rank fails the test; ranks disagreeing on a skip fail it too.

    A divergence between the ranks' collective traces fails a test that would otherwise pass
    (silent corruption is the bug) unless the test declared it expected; it is added to the
    text of a test that failed anyway, expected or not, since it usually explains the failure,
    and so are the collectives ranks were stuck in (`unfinished`).
    """
    distinct = {result.status for result in results.values()}
    if unfinished and "failed" in distinct:
        results_text = f"{failure_text(results)}\n\nunfinished collectives: {unfinished}"
    else:
        results_text = failure_text(results)
    if divergence and not (divergence_expected and "failed" not in distinct):
        heading = f"ranks issued divergent collectives: {divergence}"
        if distinct == {"passed"}:
            return Verdict("failed", heading, heading)
        return Verdict("failed", f"{results_text}\n\n{heading}", heading)
    if distinct == {"passed"}:
        return Verdict("passed", "")
    if distinct in ({"skipped"}, {"xfailed"}):
        reasons = sorted({result.summary for result in results.values()})
        return Verdict(distinct.pop(), "; ".join(reasons))  # type: ignore[arg-type]
    return Verdict("failed", results_text)


def world_reusable(results: dict[int, RankResult], traces: dict[int, list[CollectiveRecord]]) -> bool:
    """Whether the ranks that ran this test may run the next one (the warm pool's reuse rule).

    Only when nothing the test started can still be in flight, i.e. all of:
      * every rank answered (a rank that died or hung is gone or must be killed);
      * all report the same sync state (default-group collective sequence number, groups
        created): a rank that issued a collective its peers never matched, or created a group
        they did not, would pair the next test's collectives with the wrong ones;
      * no traced collective was left unfinished: a collective that raised or timed out leaves
        gloo pairs closed (and an NCCL communicator possibly aborted), unusable for later ones;
      * no rank asked to be replaced (`RankOutcome.replace_reason`: it could not put its own
        state back, e.g. the test destroyed the default process group).
    A failed test whose ranks all failed cleanly (an assertion, an exception outside any
    collective) keeps its pool; that is what makes a red suite still fast.
    """
    if not all(isinstance(result, RankOutcome) for result in results.values()):
        return False
    if any(isinstance(result, RankOutcome) and result.replace_reason for result in results.values()):
        return False
    sync_states = {result.sync_state for result in results.values() if isinstance(result, RankOutcome)}
    return len(sync_states) == 1 and not last_unfinished(traces)


def failure_text(results: dict[int, RankResult]) -> str:
    lines = [
        "distributed test failed: " + ", ".join(f"rank {rank} {result.status}" for rank, result in results.items())
    ]
    for rank, result in results.items():
        if result.status == "passed":
            continue
        lines.append("")
        lines.append(f"{'=' * 20} rank {rank}: {result.status} {'=' * 20}")
        if isinstance(result, RankLoss):
            lines.append(result.summary)
            if result.raised:
                lines.append(f"--- rank {rank} raised, before it was lost ---")
                lines.append(result.raised.partition("\n")[2].rstrip() or result.raised_summary)
            if result.stacks:
                lines.append(f"--- rank {rank} Python stacks ---")
                lines.append(result.stacks.rstrip())
        elif result.status == "failed":
            lines.append(result.traceback.rstrip() or result.summary)
        else:
            lines.append(f"{result.status} on this rank only: {result.summary}")
    return "\n".join(lines)
