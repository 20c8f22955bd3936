"""What one pytest session does with a distributed test: build the task, get every rank's result,
diff the traces, decide, report. Two ways to get results: a warm pool the parent owns
(`harness.session.pool_session`) or, under torchrun, this process being one rank of the world
(`harness.session.torchrun_session`); both subclass `HarnessSession`.

Every verdict leaves through `HarnessSession.publish`, which hands it to the report hooks
(`pytest_harness_test_result`) once per distributed test that pytest reports, when pytest's own
report of it is final (`finish_test`). So the reports hold what pytest says, whoever decided it:
the ranks' results (`propose`d by `run_item`, with every rank's case), the parent before or
instead of the ranks (an argument that cannot be pickled, a world that cannot start or is
unusable, a fixture error, a skip marker), an interrupt (Ctrl-C, SIGTERM, pytest-timeout under torchrun), and
what other plugins made of the outcome (xfail markers, the conformance expectations).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from harness.config import repro
from harness.config.devices import DevicePlan, plan_world
from harness.config.rank_modules import RankModules
from harness.config.torchrun import TorchrunWorld
from harness.message_text import describe_exception
from harness.messages import RankOutcome, RankResult, Status, TestTask, picklable
from harness.rank import rank_fixtures
from harness.report.results import DistributedTestResult, FailureReason, SuiteKey, rank_cases, skip_reason
from harness.session.verdict import Verdict, decide, failure_text, first_failure
from harness.trace.divergence import Divergence, first_divergence, format_trace_table, unfinished_collectives
from harness.trace.records import CollectiveRecord

_PICKLABLE_OPTION_TYPES = (str, int, float, bool, type(None))


@dataclass(frozen=True)
class Proposal:
    """What the harness made of a test, before pytest and its plugins have the last word: its
    verdict, and the ranks' execution it came from (None when the parent decided without them)."""

    suite: SuiteKey
    verdict: Verdict
    execution: Execution | None = None
    divergence: Divergence | None = None
    """The first divergent collective, expected or not; None when the traces agree."""
    repro: str = ""
    """The `REPRO:` line of a test the ranks' verdict failed (`harness.config.repro`), else empty."""


_PROPOSAL = pytest.StashKey[Proposal]()
_PHASES = pytest.StashKey[list[pytest.TestReport]]()


class WorldStartError(RuntimeError):
    """The ranks for a test could not be started or reached (raised by `HarnessSession.execute`)."""


class WorldUnusable(WorldStartError):
    """The world exists but cannot run another test (torchrun: an earlier test wedged it); the
    message is the whole explanation."""


@dataclass
class Execution:
    """Every rank's result of one test, with its captured output and collective trace."""

    results: dict[int, RankResult]
    captured: dict[int, tuple[str, str]]
    traces: dict[int, list[CollectiveRecord]]
    flight_recorder: str = ""
    """What the Flight Recorder dumps the ranks wrote during the test say (NCCL's watchdog writes
    them when a collective times out: `harness.trace.flight_recorder.dump_report`), else empty."""


def session_properties(config: pytest.Config) -> dict[str, str]:
    """Properties of the whole run that every report carries."""
    return {
        "seed": str(config.option.seed),
        "torch_version": torch.__version__,
        "python_version": sys.version.split()[0],
    }


class HarnessSession:
    """Task building, verdicts and reporting shared by both ways of running ranks."""

    torchrun: TorchrunWorld | None = None
    """The torchrun world this process is a rank of (the torchrun session), else None."""

    def __init__(self, config: pytest.Config, rank_modules: RankModules, reports_dir: str) -> None:
        self.config = config
        self.options = config.option
        self.rank_modules = rank_modules
        self.rank_fixture_modules = rank_modules.fixtures
        self.label_providers = rank_modules.label_providers
        self.dispatched = 0
        self.reports_dir = reports_dir
        self.forwarded_options = {
            name: value
            for name, value in vars(config.option).items()
            if isinstance(value, _PICKLABLE_OPTION_TYPES)
            or (isinstance(value, list) and all(isinstance(v, str) for v in value))
        }
        self._reports: list[str] | None = None
        self.published = 0

    # -- what differs between the two modes ------------------------------------------------
    def execute(self, item: pytest.Function, world_size: int, device_kind: str, task: TestTask) -> Execution:
        """Run the task on every rank of a world of this size; `WorldStartError` if there is none."""
        raise NotImplementedError

    def after_test(self, item: pytest.Function, execution: Execution) -> None:
        """Called once every rank's result is in (the pool session decides there whether to restart)."""

    def own_ranks(self, world_size: int) -> range:
        """The ranks whose per-rank reports this process writes (see `DistributedTestResult.own_ranks`)."""
        return range(world_size)

    def plan(self, world_size: int) -> DevicePlan:
        """The device for a world of this size, or a skip reason when it cannot be had (the one
        device decision: `harness.plugin` asks it once per test and keeps the answer)."""
        return plan_world(self.options.device, world_size, self.torchrun)

    def summary(self) -> str:
        return f"{self.dispatched} distributed tests"

    def collected(self, nodeids: list[str]) -> None:
        """Collection is over; these tests may run (torchrun mode checks every rank has the same)."""

    def finish(self) -> list[str]:
        """Have every report plugin write its files, once; return the paths written."""
        if self._reports is None:
            written = self.config.hook.pytest_harness_write_reports(config=self.config)
            self._reports = [path for paths in written for path in paths]
        return self._reports

    def kill_all(self) -> None:
        """Nothing to kill unless this session owns processes."""

    def interrupted_results(self) -> dict[int, RankResult] | None:
        """What each rank had done when the last `execute` was interrupted, if this mode knows."""
        return None

    # -- one test ------------------------------------------------------------------------
    def run_item(self, item: pytest.Function, world_size: int, plan: DevicePlan) -> None:
        self.dispatched += 1
        params = dict(item.callspec.params) if hasattr(item, "callspec") else {}
        suite = self.suite_key(item, world_size, plan)
        if plan.kind is None:
            self.propose(item, Proposal(suite, Verdict("skipped", plan.skip_reason)))
            pytest.skip(plan.skip_reason)
        task = self._task(item, params)
        started = time.monotonic()
        try:
            execution = self.execute(item, world_size, plan.kind, task)
        except WorldStartError as error:
            text = str(error)
            if not isinstance(error, WorldUnusable):
                text = f"could not start a world of {world_size} ({plan.kind}): {text}"
            self.propose(item, Proposal(suite, Verdict("failed", text)))
            pytest.fail(text, pytrace=False)
        except BaseException as error:  # interrupted in the parent: Ctrl-C, SIGTERM, pytest-timeout under torchrun
            self._propose_interrupted(item, suite, error, time.monotonic() - started)
            raise
        divergence = first_divergence(execution.traces, list(execution.results))
        expected = item.get_closest_marker("expect_divergence") is not None or any(
            isinstance(result, RankOutcome) and result.injected_faults for result in execution.results.values()
        )
        verdict = decide(
            execution.results,
            divergence.describe() if divergence else None,
            expected,
            unfinished_collectives(execution.traces),
            {rank: stderr for rank, (_, stderr) in execution.captured.items()},
            execution.flight_recorder,
        )
        # Ranks first, reports second: `_report` ends in pytest's outcome exception, and the
        # next test must find its pool already kept or discarded.
        self.after_test(item, execution)
        if self.options.show_traces:
            sys.stdout.write(f"--- collective traces ---\n{format_trace_table(execution.traces)}\n")
        reproduction = ""
        if verdict.outcome == "failed":
            repro.remember_failure(item)
            reproduction = repro.repro_line(item)
        self.propose(item, Proposal(suite, verdict, execution, divergence, reproduction))
        self._report(item, execution, verdict, reproduction)

    def suite_key(self, item: pytest.Item, world_size: int, plan: DevicePlan | None = None) -> SuiteKey:
        plan = plan or self.plan(world_size)
        return SuiteKey(world_size, plan.kind or self.options.device, _suite_properties(item))

    def propose(self, item: pytest.Item, proposal: Proposal) -> None:
        """Record what the ranks (or the parent for them) made of the test; `finish_test` publishes it."""
        item.stash[_PROPOSAL] = proposal

    def record_phase(self, item: pytest.Item, report: pytest.TestReport) -> None:
        """pytest's final report of one phase (setup, call, teardown) of a distributed test."""
        item.stash.setdefault(_PHASES, []).append(report)

    def finish_test(self, item: pytest.Item, world_size: int, interrupted: BaseException | None = None) -> None:
        """The test is over (or was interrupted): publish its verdict as pytest reported it, once."""
        phases = item.stash.get(_PHASES, [])
        proposal = item.stash.get(_PROPOSAL, None)
        if not phases and proposal is None:
            return  # never started (interrupted before its setup): pytest does not report it either
        outcome, message, reason = final_verdict(phases, proposal, interrupted)
        proposal = proposal or Proposal(self.suite_key(item, world_size), Verdict(outcome, message))
        self.publish(item, proposal, outcome, message, reason)
        del item.stash[_PHASES]
        if _PROPOSAL in item.stash:
            del item.stash[_PROPOSAL]

    def publish(
        self, item: pytest.Item, proposal: Proposal, outcome: Status, message: str, reason: FailureReason | None
    ) -> None:
        """Hand one test's verdict, as pytest reported it (`outcome`, `message`, `reason`), to every
        report plugin: the single way out for results, and the one place each rank's case is built."""
        self.published += 1
        world_size = proposal.suite.world_size
        own_ranks = tuple(self.own_ranks(world_size))
        execution = proposal.execution or Execution({}, {}, {})
        result = DistributedTestResult(
            nodeid=item.nodeid,
            name=item.name,
            suite=proposal.suite,
            outcome=outcome,
            message=message,
            cases=rank_cases(
                [*range(world_size), *own_ranks],
                outcome,
                message,
                execution.results,
                execution.captured,
                # A rank that took part in a divergence, or whose replicas drifted, failed.
                proposal.verdict.divergence or proposal.verdict.drift,
            ),
            own_ranks=own_ranks,
            traces=execution.traces,
            divergence=proposal.divergence.describe() if proposal.divergence else "",
            diverged_at=proposal.divergence.positions() if proposal.divergence else {},
            reason=reason,
            repro=proposal.repro,
        )
        item.config.hook.pytest_harness_test_result(item=item, result=result)

    def _propose_interrupted(self, item: pytest.Item, suite: SuiteKey, error: BaseException, elapsed_s: float) -> None:
        reason = f"stopped by the pytest process {elapsed_s:.1f} s into the test: {describe_exception(error)}"
        results = self.interrupted_results()
        if not results:
            self.propose(item, Proposal(suite, Verdict("failed", reason)))
            return
        # Each rank's own case (those that had answered keep their outcome); every rank's file
        # still gets the verdict, the parent's reason, when the test is published.
        verdict = Verdict("failed", f"{reason}\n\n{failure_text(results, first_failure(results))}")
        self.propose(item, Proposal(suite, verdict, Execution(results, {}, {})))

    def _task(self, item: pytest.Function, params: dict[str, Any]) -> TestTask:
        rank_side = set(rank_fixtures.registered_names())
        argnames = item._fixtureinfo.argnames
        call_kwargs = {
            name: params[name] if name in params else item.funcargs[name] for name in argnames if name not in rank_side
        }
        if not picklable(call_kwargs):  # one pickling on the hot path; per argument only to explain
            name = next(n for n, value in call_kwargs.items() if not picklable(value))
            pytest.fail(
                f"argument {name!r} of {item.nodeid} cannot be sent to the ranks; "
                "use picklable parametrize values or register it with harness.rank_fixture",
                pytrace=False,
            )
        return TestTask(
            nodeid=item.nodeid,
            module_name=item.module.__name__,
            module_file=str(item.module.__file__),
            qualname=item.obj.__qualname__,
            call_kwargs=call_kwargs,
            rank_fixture_names=tuple(name for name in argnames if name in rank_side),
            params=params if picklable(params) else {k: v for k, v in params.items() if picklable(v)},
            seed=self.options.seed,
            options=self.forwarded_options,
            sys_path=list(sys.path),
            check_replicas=check_replicas(item),
            reuse_groups=reuse_groups(item),
            known_failures=known_failures(item),
        )

    def _report(self, item: pytest.Function, execution: Execution, verdict: Verdict, reproduction: str) -> None:
        """Show the ranks' output and end in pytest's outcome for the verdict (a failure's text ends
        in its `REPRO:` line)."""
        for rank in execution.results:
            stdout, stderr = execution.captured.get(rank, ("", ""))
            if stdout:
                sys.stdout.write(f"--- rank {rank} stdout ---\n{stdout}\n")
            if stderr:
                sys.stdout.write(f"--- rank {rank} stderr ---\n{stderr}\n")
        if verdict.outcome == "failed":
            pytest.fail(f"{verdict.message}\n{reproduction}", pytrace=False)
        if verdict.outcome == "skipped":
            pytest.skip(verdict.message)
        if verdict.outcome == "xfailed":
            pytest.xfail(verdict.message)


def final_verdict(
    phases: list[pytest.TestReport], proposal: Proposal | None, interrupted: BaseException | None
) -> tuple[Status, str, FailureReason | None]:
    """A distributed test's outcome and text as pytest reported them (its junitxml reads the same),
    and why the ranks failed it when pytest's failure is the ranks' verdict.

    The ranks' text (and reason) is kept where pytest agrees with the ranks' outcome; where a plugin
    changed the outcome (an xfail marker, an expected failure), pytest's reason is the text.
    """
    by_phase = {report.when: report for report in phases}
    setup, call, teardown = by_phase.get("setup"), by_phase.get("call"), by_phase.get("teardown")
    outcome: Status
    reason = None
    if setup is not None and setup.failed:
        outcome, message = "failed", f"error in setup: {setup.longreprtext}"
    elif setup is not None and setup.skipped:
        outcome, message = _skipped(setup)
    elif call is not None and call.passed:
        outcome, message = "passed", ""
    elif call is not None and call.failed:
        agree = proposal is not None and proposal.verdict.outcome == "failed"
        outcome, message = "failed", proposal.verdict.message if agree and proposal else call.longreprtext
        reason = proposal.verdict.reason if agree and proposal else None
    elif call is not None:
        outcome, message = _skipped(call)
        if proposal is not None and proposal.verdict.outcome == outcome and outcome == "skipped":
            message = proposal.verdict.message
    elif proposal is not None and interrupted is not None:
        outcome, message, reason = "failed", proposal.verdict.message, proposal.verdict.reason
    elif interrupted is not None:
        outcome, message = "failed", f"interrupted before the test ran: {describe_exception(interrupted)}"
    else:
        outcome, message = "failed", "the test ended without a result"
    if teardown is not None and teardown.failed:
        outcome, message = "failed", "\n\n".join(filter(None, [message, f"error in teardown: {teardown.longreprtext}"]))
    return outcome, message, reason


def verdict_reason(item: pytest.Item, report: pytest.TestReport) -> FailureReason | None:
    """Why the ranks failed `item` when pytest's failed call `report` still shows their verdict:
    None when the failure is not theirs (the parent's, an interrupt's) or a plugin replaced its
    text with a verdict of its own (the conformance expectations write theirs as text)."""
    proposal = item.stash.get(_PROPOSAL, None)
    if proposal is None or not report.failed or isinstance(report.longrepr, str):
        return None
    return proposal.verdict.reason


def check_replicas(item: pytest.Item) -> bool:
    """Whether `item`'s ranks digest what its models keep replicated after the body: its
    `check_replicas` marker (`check_replicas(False)` opts out), else `--check-replicas`."""
    marker = item.get_closest_marker("check_replicas")
    if marker is None:
        return bool(getattr(item.config.option, "check_replicas", False))
    return bool(marker.args[0] if marker.args else marker.kwargs.get("enabled", True))


def reuse_groups(item: pytest.Item) -> bool:
    """Whether `item`'s ranks serve its process-group requests from the groups earlier tests kept
    (`harness.rank.group_reuse`): not with the `fresh_groups` marker or `--fresh-groups`."""
    if item.get_closest_marker("fresh_groups") is not None:
        return False
    return not getattr(item.config.option, "fresh_groups", False)


def known_failures(item: pytest.Item) -> tuple[str, ...]:
    """The failure texts the plugins expect of `item` (`pytest_harness_known_failures`), each
    once, in call order: what the ranks' checks (`harness.check`) may go on past."""
    texts = [text for found in item.config.hook.pytest_harness_known_failures(item=item) for text in found]
    return tuple(dict.fromkeys(text for text in texts if isinstance(text, str) and text))


def _skipped(report: pytest.TestReport) -> tuple[Status, str]:
    reason = getattr(report, "wasxfail", None)
    if reason is not None:
        return "xfailed", str(reason)
    return "skipped", skip_reason(report)


def _suite_properties(item: pytest.Item) -> tuple[tuple[str, str], ...]:
    merged: dict[str, str] = {}
    for properties in reversed(item.config.hook.pytest_harness_suite_properties(item=item)):
        merged.update({str(name): str(value) for name, value in properties.items()})
    return tuple(merged.items())


def ranks_stderr(item: pytest.Item) -> dict[int, str]:
    """What each rank wrote to stderr while it ran ``item`` (its tail), by rank: from the moment
    the ranks have answered until the test is published, so a plugin's report hook of the call
    phase can read it; empty for a test no rank ran (or whose ranks wrote nothing there)."""
    proposal = item.stash.get(_PROPOSAL, None)
    if proposal is None or proposal.execution is None:
        return {}
    return {rank: err for rank, (_, err) in sorted(proposal.execution.captured.items()) if err}
