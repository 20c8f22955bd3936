"""The end of a run: what ran where, every report, skips by reason, a reason on each FAILED line,
and a run that stopped early marked incomplete in the summary and in the matrix."""

from __future__ import annotations

from pathlib import Path

import pytest
from adapter_testing import run_inner_session

from harness.messages import RankLoss, RankOutcome
from harness.report.results import FailureReason
from harness.report.run_summary import failure_reason
from harness.session.verdict import decide

TESTS = """
import pytest
import torch.nn as nn
from conformance.protocol import ApiForm, ShardingSpec, ShardingStrategy

def shard(backend, device):
    spec = ShardingSpec(strategy=ShardingStrategy.NO_SHARD)
    return backend.shard(nn.Linear(2, 2).to(device), spec, ApiForm.WRAPPER)

@pytest.mark.world_size(2)
def test_shards(backend, device):
    shard(backend, device)

@pytest.mark.world_size(2)
@pytest.mark.skip(reason="unsupported: nothing of the kind")  # decided in the parent: no rank time
def test_skips(backend):
    pass

@pytest.mark.world_size(2)
def test_listed_but_passes(backend, device):
    shard(backend, device)

@pytest.mark.world_size(2)
def test_fails_on_rank_1(backend, device, rank):
    shard(backend, device)
    assert rank != 1, "rank 1 disagrees"

@pytest.mark.world_size(2)
def test_never_reached(backend, device):
    shard(backend, device)
"""


def test_a_stopped_run_says_what_ran_where_and_that_it_is_incomplete(tmp_path: Path, monkeypatch) -> None:
    """One inner session, one pool (world size 2): --maxfail=2 stops it after the second failure,
    before the last test. The first failure is a plugin's verdict (an expected failure that
    passed), the second the ranks'."""
    monkeypatch.setenv("COLUMNS", "300")  # pytest fits the FAILED line to the terminal's width
    (tmp_path / "expectations").mkdir()
    (tmp_path / "expectations" / "template-ddp.toml").write_text(
        '[[expected_failure]]\nscenario = "test_inner.py::test_listed_but_passes"\nfailure = "x"\nreason = "r"\n'
    )
    adapter = "conformance.adapters.template:TemplateAdapter"
    result = run_inner_session(tmp_path, TESTS, [adapter], "--maxfail=2")
    output = result.stdout + result.stderr
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, output
    reports = tmp_path / "reports"
    shown = "reports"  # relative to the inner session's directory, where it ran
    expected_lines = [
        "backends: template-ddp",
        "harness: 3 distributed tests, 1 pool starts",
        "; device: cpu; world sizes: 2",
        "skipped: 1 test, by reason:",
        "  1  unsupported: nothing of the kind",
        f"reports: {shown}/junit/rank-0.xml, rank-1.xml",
        f"         {shown}/conformance.md, conformance.html",
        f"         {shown}/traces/ (2 files from this run)",  # the failure, and the unexpected pass pytest fails
        "INCOMPLETE: stopped early (stopping after 2 failures) with 4 of 5 tests finished; the reports hold only "
        "the tests that ran",
        "FAILED test_inner.py::test_listed_but_passes[template-ddp] - unexpected pass: test_inner.py::"
        "test_listed_but_passes is listed as an expected failure (r); remove the entry",
        "FAILED test_inner.py::test_fails_on_rank_1[template-ddp] - rank 1: AssertionError: rank 1 disagrees",
    ]
    summary = output[output.index("run summary") :]
    for line in expected_lines:
        assert line in summary, f"{line!r} missing from:\n{summary}"
    markdown = (reports / "conformance.md").read_text()
    assert "**INCOMPLETE: stopped early (stopping after 2 failures) with 4 of 5 tests finished**" in markdown
    assert "| `test_inner.py::test_never_reached` | 1 not run |" in markdown
    page = (reports / "conformance.html").read_text()
    assert 'class="banner" id="incomplete">INCOMPLETE: stopped early' in page
    assert '<p class="reason">rank 1: AssertionError: rank 1 disagrees</p>' in page
    assert 'href="traces/test_inner.py_test_fails_on_rank_1_template-ddp.txt"' in page


def _failed(rank: int, error: str) -> RankOutcome:
    trace = f'Traceback (most recent call last):\n  File "t.py", line 3, in test\n    check()\n{error}\nassert 1 == 2'
    return RankOutcome(rank, "failed", 1.0, error, trace)


def _reason(results: dict, divergence: str | None = None) -> FailureReason:
    reason = decide(results, divergence).reason
    assert reason is not None, "a failed verdict carries its reason"
    return reason


def test_the_reason_is_the_line_that_explains_the_failure() -> None:
    """Decided with the verdict (harness.session.verdict.decide), as data; one line of it."""
    passed = RankOutcome(0, "passed", 1.0)
    one = _reason({0: passed, 1: _failed(1, "AssertionError: rank 1 disagrees")})
    assert one.first_rank is None and one.ranks_by_cause == (("AssertionError: rank 1 disagrees", (1,)),)
    assert failure_reason(one) == one.line() == "rank 1: AssertionError: rank 1 disagrees"
    same = _reason({0: _failed(0, "ValueError: bad"), 1: _failed(1, "ValueError: bad")})
    assert same.line() == "ranks 0, 1: ValueError: bad"
    first = _reason({0: _failed(0, "AssertionError: mine"), 1: _failed(1, "RuntimeError: Connection closed by peer")})
    assert (first.first_rank, first.cause) == (0, "AssertionError: mine at t.py:3")
    assert first.line() == "rank 0 failed first: AssertionError: mine at t.py:3"
    lost = _reason({0: passed, 1: RankLoss(1, "was killed by SIGKILL (9)")})
    assert lost.line() == "rank 1: was killed by SIGKILL (9)"
    diverged = _reason({0: passed, 1: RankOutcome(1, "passed", 1.0)}, "collective #2 on group [0, 1]: ...")
    assert diverged.divergence == "ranks issued divergent collectives: collective #2 on group [0, 1]: ..."
    assert diverged.line() == diverged.divergence
    # A traceback's exception line as Python wrote it (qualified type), whatever the rank's summary says.
    qualified = _failed(1, "ExercisedNothing: nothing")
    qualified.traceback = qualified.traceback.replace(
        "ExercisedNothing:", "conformance.suite.vacuity.ExercisedNothing:"
    )
    assert _reason({0: passed, 1: qualified}).line() == "rank 1: conformance.suite.vacuity.ExercisedNothing: nothing"
    # Ranks that disagreed on a skip: their statuses; a long reason is cut.
    disagreed = _reason({0: RankOutcome(0, "skipped", 1.0, "no"), 1: passed})
    assert disagreed.line() == "distributed test failed: rank 0 skipped, rank 1 passed"
    long = _reason({0: passed, 1: _failed(1, "ValueError: " + "x" * 400)}).line()
    assert len(long) == 300 and long.endswith("...")
    # No verdict's reason (a failure the ranks did not decide): the first line of its text.
    assert failure_reason(None, "unexpected pass: x is listed as an expected failure\n\nmore") == (
        "unexpected pass: x is listed as an expected failure"
    )
    assert failure_reason(None, "Failed: could not start a world of 2 (cpu): boom") == (
        "could not start a world of 2 (cpu): boom"
    )


def test_the_summary_names_the_device_of_each_world_size_when_a_run_used_several(tmp_path: Path) -> None:
    """--device auto on a 1-GPU runner: world size 1 on CUDA, 2 and 4 on CPU. One device kind keeps
    the short form."""
    from types import SimpleNamespace

    from harness.report.results import SuiteKey
    from harness.report.run_summary import RunSummary

    config = SimpleNamespace(hook=SimpleNamespace(pytest_harness_summary_lines=lambda config: []), stash={})
    summary = RunSummary(config, str(tmp_path), lambda: "5 distributed tests", lambda item, report: None)  # type: ignore[arg-type]
    for world_size, device in [(1, "cuda"), (2, "cpu"), (2, "cpu"), (4, "cpu"), (1, "cuda")]:
        result = SimpleNamespace(suite=SuiteKey(world_size=world_size, device=device))
        summary.pytest_harness_test_result(None, result)  # type: ignore[arg-type]
    line = summary.lines([])[0]
    devices = "devices: cpu (3 tests at world sizes 2, 4), cuda (2 tests at world size 1)"
    assert line == f"harness: 5 distributed tests; {devices}"
    single = RunSummary(config, str(tmp_path), lambda: "1 distributed tests", lambda item, report: None)  # type: ignore[arg-type]
    single.pytest_harness_test_result(None, SimpleNamespace(suite=SuiteKey(world_size=2, device="cpu")))  # type: ignore[arg-type]
    assert single.lines([])[0] == "harness: 1 distributed tests; device: cpu; world sizes: 2"
