"""harness.session.verdict on fabricated results: the outcome of N ranks and the warm pool's reuse rule;
and one real pool session, where the first failed rank is told by time."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
from test_divergence import rec

from conftest import InnerSession
from harness.messages import RankLoss, RankOutcome
from harness.report.results import rank_cases
from harness.session import verdict
from harness.session.verdict import decide, world_reusable
from harness.trace.records import CollectiveRecord, last_unfinished


def outcome(
    rank: int, status: str = "passed", sync_state: tuple[int, ...] = (3, 1, 0), summary: str = ""
) -> RankOutcome:
    return RankOutcome(rank=rank, status=status, duration_s=0.1, summary=summary, sync_state=sync_state)  # type: ignore[arg-type]


def record(rank: int, index: int, completed: bool = True, skipped: bool = False) -> CollectiveRecord:
    return replace(rec(rank, index, index, op="all_reduce", numel=4), completed=completed, skipped=skipped)


def test_one_outcome_from_n_ranks() -> None:
    assert decide({0: outcome(0), 1: outcome(1)}).outcome == "passed"
    failed = decide({0: outcome(0), 1: RankLoss(1, "was killed by SIGKILL (9)")})
    assert failed.outcome == "failed" and "rank 1 was killed by SIGKILL (9)" in failed.message
    skipped = decide({0: outcome(0, "skipped", summary="no"), 1: outcome(1, "skipped", summary="no")})
    assert (skipped.outcome, skipped.message) == ("skipped", "no")
    assert decide({0: outcome(0, "skipped"), 1: outcome(1)}).outcome == "failed"  # a skip on some ranks only


def test_divergence_fails_a_passing_test_unless_expected() -> None:
    results = {0: outcome(0), 1: outcome(1)}
    assert decide(results, "collective #1 ...").outcome == "failed"
    assert decide(results, "collective #1 ...", divergence_expected=True).outcome == "passed"


def test_the_pool_is_reused_only_when_nothing_can_be_in_flight() -> None:
    clean = {0: [record(0, 0)], 1: [record(1, 0)]}
    assert world_reusable({0: outcome(0), 1: outcome(1)}, clean)
    assert world_reusable({0: outcome(0, "failed"), 1: outcome(1, "failed")}, clean)  # failed cleanly
    assert not world_reusable({0: outcome(0), 1: RankLoss(1, "hung")}, clean)
    assert not world_reusable({0: outcome(0), 1: outcome(1, sync_state=(4, 1, 0))}, clean)
    assert not world_reusable({0: outcome(0), 1: outcome(1, sync_state=(3, 2, 0))}, clean)
    stuck = {0: [record(0, 0), record(0, 1, completed=False)], 1: [record(1, 0)]}
    assert not world_reusable({0: outcome(0, "failed"), 1: outcome(1)}, stuck)


def test_the_rank_that_failed_first_is_singled_out_and_harness_frames_are_dropped() -> None:
    harness_file = str(Path(verdict.__file__).with_name("worker.py"))
    own = (
        "Traceback (most recent call last):\n"
        f'  File "{harness_file}", line 10, in run\n    body()\n'
        '  File "<frozen runpy>", line 88, in _run_code\n'
        '  File "/src/test_train.py", line 12, in test_step\n    assert loss < 1\n'
        "AssertionError: loss 3.0"
    )
    results = {
        0: replace(outcome(0, "failed", summary="RuntimeError: Connection reset by peer"), traceback="..."),
        1: replace(outcome(1, "failed", summary="AssertionError: loss 3.0"), traceback=own),
        2: RankLoss(
            2, "stopped by the harness 0.4 s into the test: waited alone in collective #3", after_peer_failed=True
        ),
    }
    text = decide(results).message
    assert "rank 1 failed first (AssertionError: loss 3.0 at /src/test_train.py:12); ranks 0, 2 failed after it" in text
    assert text.index("rank 1: failed ===") < text.index("rank 0: failed (after rank 1) ===")
    assert "worker.py" not in text and "runpy" not in text and "assert loss < 1" in text
    # Whether the harness stopped a rank because of a peer is data, never read from its cause's text.
    worded_alike = {**results, 2: RankLoss(2, "stopped by the harness 0.4 s into the test: waited alone")}
    assert verdict.first_failed_rank(worded_alike) is None
    alike = {rank: outcome(rank, "failed", summary="AssertionError: same") for rank in (0, 1)}
    assert verdict.first_failed_rank(alike) is None  # each failed on its own


def failed_at(rank: int, summary: str, at: float, clock_error_s: float = 0.0) -> RankOutcome:
    return replace(outcome(rank, "failed", summary=summary), failed_at=at, clock_error_s=clock_error_s)


def test_with_comparable_clocks_the_earliest_own_failure_is_first_by_time() -> None:
    """A pool's ranks share a clock: two ranks failing on their own, the earlier is first (the
    message rule alone finds none), and the verdict and its reason say it was told by time."""
    results = {0: failed_at(0, "ValueError: later", 100.9), 1: failed_at(1, "AssertionError: mine", 100.1)}
    assert verdict.first_failure(results) == verdict.FirstFailure(1, "time", pytest.approx(0.8), 0)
    decided = decide(results)
    assert "rank 1 failed first (AssertionError: mine); rank 0 failed after it (by time: 0.8 s before rank 0)" in (
        decided.message
    )
    assert decided.message.index("rank 1: failed ===") < decided.message.index("rank 0: failed (after rank 1) ===")
    assert decided.reason is not None
    assert (decided.reason.first_rank, decided.reason.first_by, decided.reason.next_rank) == (1, "time", 0)
    assert decided.reason.line() == "rank 1 failed first (by time: 0.8 s before rank 0): AssertionError: mine"
    # Consequences after it: still by time, and they failed in the collectives it left unmatched.
    broken = {**results, 0: failed_at(0, "RuntimeError: Connection closed by peer", 100.3)}
    assert "rank 0 failed after it, in collectives it left unmatched (by time: 0.2 s before rank 0)" in (
        decide(broken).message
    )


def test_times_closer_than_the_clocks_uncertainty_tell_nothing() -> None:
    """Torchrun ranks' times carry their clock offset's uncertainty: a gap within it is no order."""
    close = {
        0: failed_at(0, "ValueError: later", 100.9, clock_error_s=0.5),
        1: failed_at(1, "AssertionError: mine", 100.1, clock_error_s=0.5),
    }
    assert verdict.first_failure(close) is None
    assert decide(close).reason.first_rank is None  # type: ignore[union-attr]
    apart = {rank: replace(result, clock_error_s=0.3) for rank, result in close.items()}
    assert verdict.first_failed_rank(apart) == 1
    # Equal times, or a rank without a time (offset not measured): no order by time.
    assert verdict.first_failure({**close, 0: failed_at(0, "ValueError: later", 100.1)}) is None
    assert verdict.first_failure({**close, 0: replace(close[0], failed_at=None)}) is None


def test_without_comparable_times_the_first_rank_is_told_by_message() -> None:
    """The consequence rule, as before: one own failure, the others broken collectives."""
    results = {
        0: outcome(0, "failed", summary="RuntimeError: Connection reset by peer"),
        1: outcome(1, "failed", summary="AssertionError: mine"),
    }
    assert verdict.first_failure(results) == verdict.FirstFailure(1, "message")
    decided = decide(results)
    assert (
        "rank 1 failed first (AssertionError: mine); rank 0 failed after it, in collectives it left unmatched "
        "(by message: their failures are consequences)"
    ) in decided.message
    assert decided.reason is not None and decided.reason.first_by == "message"
    assert decided.reason.line() == "rank 1 failed first: AssertionError: mine"
    # Times that contradict the consequence rule (a consequence before the own failure) are not
    # trusted: told by message.
    contradicted = {
        0: failed_at(0, "RuntimeError: Connection reset by peer", 100.0),
        1: failed_at(1, "AssertionError: mine", 100.5),
    }
    assert verdict.first_failure(contradicted) == verdict.FirstFailure(1, "message")


def test_a_lost_rank_is_known_to_have_failed_by_when_it_was_noticed_only() -> None:
    """A rank that died was lost some time before the parent noticed: it may be first by time,
    never shown to come after another; a rank the harness stopped was lost when it was stopped."""
    died = RankLoss(1, "exited with code 3", failed_at=100.2)
    raised = failed_at(0, "ValueError: mine too", 100.5)
    assert verdict.first_failure({0: raised, 1: died}) == verdict.FirstFailure(1, "time", pytest.approx(0.3), 0)
    earlier = failed_at(0, "ValueError: mine too", 100.0)
    assert verdict.first_failure({0: earlier, 1: died}) is None  # rank 1 may have died before 100.0
    stopped = RankLoss(1, "stopped by the harness", failed_at=100.8, after_peer_failed=True)
    assert verdict.first_failure({0: earlier, 1: stopped}) == verdict.FirstFailure(0, "time", pytest.approx(0.8), 1)


def test_last_unfinished_names_where_each_rank_stopped_and_ignores_skipped_calls() -> None:
    traces = {
        0: [record(0, 0, completed=False), record(0, 1, completed=False), record(0, 2)],
        1: [record(1, 0), record(1, 1, completed=False, skipped=True)],
    }
    stuck = last_unfinished(traces)
    assert list(stuck) == [0] and stuck[0].index == 1


def test_each_rank_case_has_that_rank_s_own_duration_lost_ranks_included() -> None:
    lost = RankLoss(1, "hung: no result within the 120 s test deadline", stacks="Thread 0x1", duration_s=120.4)
    cases = rank_cases(range(2), "failed", "rank 1 hung", {0: outcome(0), 1: lost}, {}, "")
    assert (cases[0].time_s, cases[1].time_s) == (0.1, 120.4)
    assert RankLoss(0, "exited with code 3").duration_s == 0.0  # never got the task


def test_each_rank_s_case_is_reconciled_with_the_verdict_once() -> None:
    """What every report plugin receives (harness.report.results.rank_cases): the verdict as each rank's
    status, the rank's own story as its message and text; a rank without a result gets the verdict."""
    lost = RankLoss(2, "was killed by SIGKILL (9)", raised="ValueError: boom\nTraceback: here")
    results = {0: outcome(0), 1: outcome(1, "failed", summary="AssertionError: no"), 2: lost}
    stderr = "\n".join(f"line {n}" for n in range(40))
    cases = rank_cases(range(4), "failed", "distributed test failed\nmore", results, {2: ("", stderr)}, "")
    assert cases[0].status == "failed"
    assert cases[0].message == "failed on another rank (this rank: passed): distributed test failed"
    assert (cases[1].status, cases[1].message) == ("failed", "AssertionError: no")
    assert cases[2].message == "rank 2 was killed by SIGKILL (9), after raising ValueError: boom"
    assert "--- rank 2 raised, before it was lost ---\nTraceback: here" in cases[2].text
    assert cases[2].text.endswith(f"--- rank 2 stderr ---\n{stderr}")  # the per-rank file: all of it
    assert (cases[3].status, cases[3].message, cases[3].text) == (
        "failed",
        "distributed test failed",
        "distributed test failed\nmore",
    )
    # A rank that passed took part in a divergence: it failed; an expected failure keeps its story.
    diverged = rank_cases(range(2), "failed", "diverged", {0: outcome(0), 1: outcome(1)}, {}, "ranks issued ...")
    assert diverged[0].message == diverged[0].text == "ranks issued ..."
    expected = rank_cases(range(2), "xfailed", "known bug", results, {}, "")
    assert (expected[1].status, expected[1].message, expected[1].text) == ("xfailed", "known bug", "AssertionError: no")


def test_a_lost_rank_s_account_in_the_verdict_ends_with_its_last_stderr_lines() -> None:
    lost = RankLoss(1, "exited with code 3")
    stderr = "\n".join(f"line {n}" for n in range(40))
    message = decide({0: outcome(0), 1: lost}, stderr={1: stderr}).message
    assert message.endswith(
        "rank 1 exited with code 3\n--- rank 1 stderr (last lines) ---\n"
        + "\n".join(f"line {n}" for n in range(15, 40))
    )


BOTH_FAIL = """
import time
import pytest, torch.distributed as dist

@pytest.mark.world_size(2)
def test_both_fail_on_their_own(rank):
    dist.barrier()
    if rank == 1:
        raise AssertionError("rank 1 is wrong")
    time.sleep(0.5)
    raise ValueError("rank 0 is wrong too")
"""


def test_in_a_pool_the_rank_that_raised_first_is_first_by_time(inner: InnerSession) -> None:
    """Two ranks failing on their own, neither error a consequence: the message rule finds no first
    rank; the pool's ranks share a clock, so the one that raised first is singled out, by time."""
    inner.write("test_both.py", BOTH_FAIL)
    result = inner.run("-q")
    assert "1 failed" in result.stdout, result.stdout
    first = (
        r"rank 1 failed first \(AssertionError: rank 1 is wrong at test_both.py:9\); "
        r"rank 0 failed after it \(by time: ([0-9.]+) s before rank 0\)"
    )
    found = re.search(first, result.stdout)
    assert found is not None, result.stdout
    assert 0.4 < float(found.group(1)) < 5.0  # rank 0 slept 0.5 s after rank 1 raised
    assert "FAILED test_both.py::test_both_fail_on_their_own - rank 1 failed first (by" in result.stdout
