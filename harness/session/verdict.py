"""What N per-rank results mean: one pytest outcome with its text, and whether the world can go on."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from harness.message_text import first_line, ranks_text, shown_path
from harness.messages import RankLoss, RankOutcome, RankResult, Status
from harness.report.results import FailureReason
from harness.trace.checksums import DriftReport, compare
from harness.trace.records import CollectiveRecord, last_unfinished


@dataclass(frozen=True)
class Verdict:
    outcome: Status
    message: str
    divergence: str = ""
    """The divergence heading when the trace diff failed the test, else empty."""
    reason: FailureReason | None = None
    """Why the ranks failed the test (`decide`); None for any other outcome, and for a failure the
    parent decided without the ranks' results (a world that could not start, an interrupt)."""
    drift: str = ""
    """The replica drift's heading when the ranks' replica digests differ (`replica_drift`), else empty."""


def decide(
    results: dict[int, RankResult],
    divergence: str | None = None,
    divergence_expected: bool = False,
    unfinished: str | None = None,
    stderr: Mapping[int, str] | None = None,
    flight_recorder: str = "",
) -> Verdict:
    """All ranks must agree: one failing rank fails the test; ranks disagreeing on a skip fail it too.

    A divergence between the ranks' collective traces fails a test that would otherwise pass
    (silent corruption is the bug) unless the test declared it expected; it is added to the
    text of a test that failed anyway, expected or not, since it usually explains the failure,
    and so are the collectives ranks were stuck in (`unfinished`).

    So does a replica drift (`replica_drift`: the ranks' digests of what their models keep
    replicated differ, where the check was on), a failure reason of its own after the divergence:
    a test that failed for another reason, or diverged, keeps that reason first (a drift is often
    its consequence) and gets the drift added to its text. A drift on ranks that all passed is
    the reason's whole text (`FailureReason.outcomes`: what explains a failure where no rank
    failed and the traces agree).
    """
    results = with_watchdog_causes(results, stderr or {})
    distinct = {result.status for result in results.values()}
    drift = replica_drift(results) if distinct <= {"passed", "failed"} else None
    drift_text = f"\n\n{drift.describe()}" if drift is not None else ""
    drift_heading = drift.heading() if drift is not None else ""

    def account(first: FirstFailure | None) -> str:  # built only for a test that fails: not for every pass
        text = failure_text(results, first, stderr)
        if unfinished and "failed" in distinct:
            text = f"{text}\n\nunfinished collectives: {unfinished}"
        return f"{text}\n\n{flight_recorder}" if flight_recorder else text

    if divergence and not (divergence_expected and "failed" not in distinct):
        heading = f"ranks issued divergent collectives: {divergence}"
        if distinct == {"passed"}:
            return Verdict("failed", heading + drift_text, heading, FailureReason(divergence=heading), drift_heading)
        first = first_failure(results)
        message = f"{account(first)}\n\n{heading}{drift_text}"
        return Verdict("failed", message, heading, failure_reason(results, first, heading), drift_heading)
    if distinct == {"passed"}:
        if drift is not None:
            return Verdict("failed", drift.describe(), reason=FailureReason(outcomes=drift.line()), drift=drift_heading)
        return Verdict("passed", "")
    if distinct in ({"skipped"}, {"xfailed"}):
        reasons = sorted({result.summary for result in results.values()})
        return Verdict(distinct.pop(), "; ".join(reasons))  # type: ignore[arg-type]
    first = first_failure(results)
    return Verdict("failed", account(first) + drift_text, reason=failure_reason(results, first), drift=drift_heading)


# What NCCL's watchdog writes to a rank's stderr before it aborts the process (SIGABRT under
# TORCH_NCCL_ASYNC_ERROR_HANDLING): "[rank1]:[E...] [PG ID 0 ...] Watchdog caught collective
# operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, ...) ran for 30012 milliseconds before
# timing out." The work it names is the cause; the signal is only how it ended.
_WATCHDOG_TIMEOUT = re.compile(r"Watchdog caught collective operation timeout: (WorkNCCL\(.*?\)) ran for")


def with_watchdog_causes(results: dict[int, RankResult], stderr: Mapping[int, str]) -> dict[int, RankResult]:
    """`results` with each rank that NCCL's watchdog aborted named so: "was aborted by NCCL's
    watchdog: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, ...) timed out", not only "killed by SIGABRT".
    A timeout is a consequence (a peer did not join), so the rank that went wrong first is still
    told apart from it."""
    changed = {}
    for rank, result in results.items():
        if not isinstance(result, RankLoss) or "SIGABRT" not in result.cause:
            continue
        found = _WATCHDOG_TIMEOUT.search(stderr.get(rank, ""))
        if found is not None:
            cause = f"was aborted by NCCL's watchdog: {found.group(1)} timed out ({result.cause})"
            changed[rank] = dataclasses.replace(result, cause=cause)
    return {**results, **changed} if changed else results


def replica_drift(results: dict[int, RankResult]) -> DriftReport | None:
    """The drift among the replica digests the ranks returned (`RankOutcome.replicas`, taken when
    the test's replica check was on), None when they agree or none were taken. Ranks without
    digests (lost, or failed on CUDA) are left out of the comparison."""
    snapshots = {
        rank: result.replicas
        for rank, result in results.items()
        if isinstance(result, RankOutcome) and result.replicas is not None
    }
    return compare(snapshots) if len(snapshots) > 1 else None


def failure_reason(results: dict[int, RankResult], first: FirstFailure | None, divergence: str = "") -> FailureReason:
    """Why these results fail a test: the rank that failed first (`first_failure`) and its cause
    when one can be told apart, else every failed rank's cause, and the divergence heading; what
    `failure_text` says at length."""
    outcomes = _outcomes_line(results)
    if first is not None:
        cause = _first_cause(results[first.rank]).removeprefix(f"rank {first.rank} ")
        return FailureReason(
            first.rank,
            cause,
            divergence=divergence,
            outcomes=outcomes,
            first_by=first.by,
            first_ahead_s=first.ahead_s,
            next_rank=first.next_rank,
        )
    by_cause: dict[str, list[int]] = {}
    for rank in results:  # the order of the account's sections (`failure_text`)
        if results[rank].status == "failed":
            by_cause.setdefault(_own_cause(rank, results[rank]), []).append(rank)
    ranks_by_cause = tuple((cause, tuple(ranks)) for cause, ranks in by_cause.items())
    return FailureReason(None, "", ranks_by_cause, divergence, outcomes)


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


LOST_STDERR_LINES = 25
"""How much of a lost rank's stderr the verdict shows (its per-rank file has all of it)."""


def failure_text(
    results: dict[int, RankResult], found: FirstFailure | None, stderr: Mapping[int, str] | None = None
) -> str:
    """The per-rank account of a failed test: the rank that failed first (`found`: `first_failure`),
    when one can be told apart, comes first and the others are marked as failing after it; stacks leave out the
    harness's own frames (the JUnit files keep them whole). A lost rank's account ends with the
    last lines of its `stderr` (by rank), often the only trace of why it died."""
    stderr = stderr or {}
    lines = [_outcomes_line(results)]
    first = None if found is None else found.rank
    if found is not None:
        followers = [rank for rank, result in results.items() if result.status == "failed" and rank != found.rank]
        lines.append(
            f"rank {found.rank} failed first ({_first_cause(results[found.rank])}); "
            f"{ranks_text(followers)} failed after it{_how_told(found, results)}"
        )
    order = sorted(results, key=lambda rank: rank != first)
    for rank in order:
        result = results[rank]
        if result.status == "passed":
            continue
        lines.append("")
        after = f" (after rank {first})" if first is not None and rank != first and result.status == "failed" else ""
        lines.append(f"{'=' * 20} rank {rank}: {result.status}{after} {'=' * 20}")
        if isinstance(result, RankLoss):
            lines.append(result.account(stderr.get(rank, ""), without_harness_frames, last_lines=LOST_STDERR_LINES))
        elif result.status == "failed":
            lines.append(without_harness_frames(result.traceback.rstrip()) or result.summary)
        else:
            lines.append(f"{result.status} on this rank only: {result.summary}")
    return "\n".join(lines)


def _how_told(first: FirstFailure, results: dict[int, RankResult]) -> str:
    """How the verdict told the first failed rank, as the end of its line."""
    if first.by == "message":
        return ", in collectives it left unmatched (by message: their failures are consequences)"
    consequences = all(
        _is_consequence(result) for rank, result in results.items() if result.status == "failed" and rank != first.rank
    )
    unmatched = ", in collectives it left unmatched" if consequences else ""
    return f"{unmatched} (by time: {first.ahead_s:.3g} s before rank {first.next_rank})"


def _outcomes_line(results: dict[int, RankResult]) -> str:
    return "distributed test failed: " + ", ".join(f"rank {rank} {result.status}" for rank, result in results.items())


def _first_cause(result: RankResult) -> str:
    """What the rank that failed first did, and where in the test's code: its summary's first line
    ("rank 1 exited with code 3" for a lost one), then "at t.py:3" when a frame of the test's code is known."""
    where = _user_line(_failure_stack(result))
    return f"{first_line(result.summary)}{f' at {where}' if where else ''}"


def _own_cause(rank: int, result: RankResult) -> str:
    """A failed rank's cause as its section of the account shows it: a lost rank's account's first
    line (its summary), else the exception line its last traceback ended in (as Python wrote it:
    qualified type names), else that traceback's first line, else "failed"."""
    if isinstance(result, RankLoss):
        return first_line(result.summary).removeprefix(f"rank {rank} ") or "failed"
    shown = without_harness_frames(result.traceback.rstrip()) or result.summary
    content = [line for line in shown.splitlines() if line.strip()]
    if not content:
        return "failed"
    starts = [index for index, line in enumerate(content) if line.startswith("Traceback (most recent call last)")]
    if starts:
        after = content[starts[-1] + 1 :]
        raised = next((line for line in after if not line.startswith((" ", "\t"))), "")
        if raised:
            return raised.rstrip()
    return content[0].rstrip()


# How a rank's own exception reads when a peer failed first: gloo, NCCL or torch report its
# collective broken or timed out. (A rank the harness stopped because of a peer says so as data:
# `RankLoss.after_peer_failed`.) A failure that is neither is the rank's own.
_BROKEN_COLLECTIVE = re.compile(
    r"Connection (reset|closed) by peer|[Tt]imed out|[Tt]imeout|DistBackendError|Broken pipe|"
    r"NCCL (error|communicator was aborted)"
)


def _is_consequence(result: RankResult) -> bool:
    if isinstance(result, RankLoss) and result.after_peer_failed:
        return True
    return bool(_BROKEN_COLLECTIVE.search(result.summary))


@dataclass(frozen=True)
class FirstFailure:
    """The rank that failed first, and how that was told."""

    rank: int
    by: Literal["time", "message"]
    """"time": it failed before every other failed rank, by more than the clocks' uncertainty;
    "message": the times could not tell, but every other failed rank's failure is a consequence."""
    ahead_s: float = 0.0
    """By time: how long before the next failed rank (`next_rank`) it failed; 0.0 by message."""
    next_rank: int | None = None


def first_failure(results: dict[int, RankResult]) -> FirstFailure | None:
    """The rank that failed first, when one can be told apart; None when fewer than two failed.

    By time where the ranks' failure times can be compared (`RankOutcome.failed_at`, on the
    session's reference clock: a pool's ranks share one; torchrun ranks only with a measured
    offset): the earliest failure whose rank failed on its own (not a broken or timed-out
    collective, not a stop by the harness), ahead of every other failed rank by more than the
    clocks' uncertainty. A lost rank is known to have failed by when it was noticed, not since
    when, so it cannot be shown to have failed after another. The consequence rule is the
    check: a consequence never fails first, and one that came before the earliest own failure
    means the times do not tell the story.

    By message otherwise: the one rank whose failure is its own while every other failed rank's
    is a consequence.
    """
    failed = {rank: result for rank, result in results.items() if result.status == "failed"}
    if len(failed) < 2:
        return None
    own = [rank for rank, result in failed.items() if not _is_consequence(result)]
    timed = _first_by_time(failed, own)
    if timed is not None:
        return timed
    return FirstFailure(own[0], "message") if len(own) == 1 else None


def _failure_window(result: RankResult) -> tuple[float, float] | None:
    """When a failed rank failed, at the earliest and the latest, on the reference clock; None when unknown."""
    if result.failed_at is None:
        return None
    error = result.clock_error_s
    if isinstance(result, RankLoss) and not result.after_peer_failed:
        return (-math.inf, result.failed_at + error)  # died or hung some time before it was noticed
    return (result.failed_at - error, result.failed_at + error)


def _first_by_time(failed: dict[int, RankResult], own: list[int]) -> FirstFailure | None:
    windows = {rank: _failure_window(result) for rank, result in failed.items()}
    if not own or any(window is None for window in windows.values()):
        return None
    known = {rank: window for rank, window in windows.items() if window is not None}
    first = min(own, key=lambda rank: known[rank][1])
    others = [rank for rank in failed if rank != first]
    if not all(known[first][1] < known[rank][0] for rank in others):
        return None  # too close to tell, or a failure that cannot be shown to have come after it
    next_rank = min(others, key=lambda rank: failed[rank].failed_at or 0.0)
    ahead_s = (failed[next_rank].failed_at or 0.0) - (failed[first].failed_at or 0.0)
    return FirstFailure(first, "time", ahead_s, next_rank)


def first_failed_rank(results: dict[int, RankResult]) -> int | None:
    """The rank that failed first (`first_failure`), None when no one rank can be told apart."""
    first = first_failure(results)
    return None if first is None else first.rank


_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+)')
_HARNESS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the harness package
# An injected fault's frames are part of the test's story ("hung in faults._hang"): kept.
_KEPT_HARNESS_FILES = (os.path.join(_HARNESS_DIR, "rank", "faults.py"),)
_TORCH_MARK = f"{os.sep}torch{os.sep}"


def without_harness_frames(text: str) -> str:
    """A traceback or faulthandler dump without the harness's, the zygote's and runpy's frames
    (those of an injected fault, `harness.rank.faults`, stay)."""
    kept: list[str] = []
    skipping = False
    for line in text.splitlines():
        frame = _FRAME.match(line)
        if frame:
            path = frame.group(1)
            skipping = (path.startswith(_HARNESS_DIR) and path not in _KEPT_HARNESS_FILES) or path == "<frozen runpy>"
        elif skipping and line.startswith("    "):  # the skipped frame's source lines
            continue
        else:
            skipping = False
        if not skipping:
            kept.append(line)
    return "\n".join(kept)


def _failure_stack(result: RankResult) -> str:
    if isinstance(result, RankLoss):
        return result.raised or result.stacks
    return result.traceback


def _user_line(stack: str) -> str:
    """`file:line` of the innermost frame outside torch and the harness in a traceback."""
    found = ""
    for line in stack.splitlines():
        frame = _FRAME.match(line)
        path = frame.group(1) if frame else "<"
        if not (path.startswith(("<", _HARNESS_DIR)) or _TORCH_MARK in path):
            found = f"{shown_path(path)}:{frame.group(2)}"  # type: ignore[union-attr]
    return found
