"""What one pytest session does with a distributed test: build the task, get every rank's result,
diff the traces, decide, report. Two ways to get results: a warm pool the parent owns
(`PoolSession`) or, under torchrun, this process being one rank of the world (`lockstep`).
"""
from __future__ import annotations

import os
import pickle
import re
import shlex
import shutil
import sys
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from harness import fixtures
from harness.devices import DevicePlan, plan_devices
from harness.divergence import Divergence, first_divergence, format_trace_table, unfinished_collectives
from harness.junit import CaseRecord, JUnitWriter, SuiteKey
from harness.messages import RankOutcome, TestTask
from harness.pool import PoolKey, PoolStartError, RankLoss, RankResult, WorkerPool, tail
from harness.trace import CollectiveRecord, read_trace
from harness.verdict import Verdict, decide

_PICKLABLE_OPTION_TYPES = (str, int, float, bool, type(None))
REPRO_CACHE_KEY = "harness/repro"
_CAPTURE_LIMIT = 1 << 20


@dataclass
class Execution:
    """Every rank's result of one test, with its captured output and collective trace."""

    results: dict[int, RankResult]
    captured: dict[int, tuple[str, str]]
    traces: dict[int, list[CollectiveRecord]]


class HarnessSession:
    """Reports, task building and verdicts shared by both ways of running ranks."""

    def __init__(self, config: pytest.Config, rank_fixture_modules: tuple[str, ...], reports_dir: str) -> None:
        self.config = config
        self.options = config.option
        self.rank_fixture_modules = rank_fixture_modules
        self.label_providers = tuple(config.getini("collective_label_providers"))
        self.dispatched = 0
        self.reports_dir = reports_dir
        self.junit = JUnitWriter(os.path.join(reports_dir, "junit"), {
            "seed": str(self.options.seed),
            "torch_version": torch.__version__,
            "python_version": sys.version.split()[0],
        })
        self.forwarded_options = {
            name: value for name, value in vars(config.option).items()
            if isinstance(value, _PICKLABLE_OPTION_TYPES)
            or (isinstance(value, list) and all(isinstance(v, str) for v in value))
        }

    # -- what differs between the two modes ------------------------------------------------
    def execute(self, item: pytest.Function, world_size: int, device_kind: str, task: TestTask) -> Execution:
        raise NotImplementedError

    def after_test(self, item: pytest.Function, execution: Execution, verdict: Verdict) -> None:
        """Called once the verdict is known (the pool session decides there whether to restart)."""

    def ranks_reported(self, world_size: int) -> range:
        return range(world_size)

    def plan(self, world_size: int) -> DevicePlan:
        """The device for a world of this size, or a skip reason when it cannot be had."""
        return plan_devices(self.options.device, world_size)

    def summary(self) -> str:
        return f"{self.dispatched} distributed tests"

    def finish(self) -> list[str]:
        return self.junit.write()

    def kill_all(self) -> None:
        """Nothing to kill unless this session owns processes."""

    # -- one test ------------------------------------------------------------------------
    def run_item(self, item: pytest.Function, world_size: int) -> None:
        self.dispatched += 1
        params = dict(item.callspec.params) if hasattr(item, "callspec") else {}
        plan = self.plan(world_size)
        suite = SuiteKey(str(params.get("backend", "")), world_size, plan.kind or self.options.device)
        if plan.kind is None:
            for rank in self.ranks_reported(world_size):
                self.junit.add(rank, suite, self.case(item, 0.0, "skipped", plan.skip_reason))
            pytest.skip(plan.skip_reason)
        task = self._task(item, params)
        try:
            execution = self.execute(item, world_size, plan.kind, task)
        except PoolStartError as error:
            text = f"could not start a world of {world_size} ({plan.kind}): {error}"
            for rank in self.ranks_reported(world_size):
                self.junit.add(rank, suite, self.case(item, 0.0, "failed", str(error).splitlines()[0], text))
            pytest.fail(text, pytrace=False)
        divergence = first_divergence(execution.traces, list(execution.results))
        expected = item.get_closest_marker("expect_divergence") is not None or any(
            isinstance(result, RankOutcome) and result.injected_faults for result in execution.results.values())
        verdict = decide(execution.results, divergence.describe() if divergence else None, expected,
                         unfinished_collectives(execution.traces))
        self.after_test(item, execution, verdict)
        if divergence is not None or verdict.outcome == "failed":
            self._write_trace(item, execution.traces, divergence)
        if self.options.show_traces:
            sys.stdout.write(f"--- collective traces ---\n{format_trace_table(execution.traces)}\n")
        if verdict.outcome == "failed":
            self._remember_repro(item)
        self._report(item, suite, execution, verdict)

    def _task(self, item: pytest.Function, params: dict[str, Any]) -> TestTask:
        rank_side = set(fixtures.registered_names())
        argnames = item._fixtureinfo.argnames
        call_kwargs = {name: params[name] if name in params else item.funcargs[name]
                       for name in argnames if name not in rank_side}
        if not _picklable(call_kwargs):  # one pickling on the hot path; per argument only to explain
            name = next(n for n, value in call_kwargs.items() if not _picklable(value))
            pytest.fail(f"argument {name!r} of {item.nodeid} cannot be sent to the ranks; "
                        "use picklable parametrize values or register it with harness.rank_fixture",
                        pytrace=False)
        return TestTask(
            nodeid=item.nodeid,
            module_name=item.module.__name__,
            module_file=str(item.module.__file__),
            qualname=item.obj.__qualname__,
            call_kwargs=call_kwargs,
            rank_fixture_names=tuple(name for name in argnames if name in rank_side),
            params=params if _picklable(params) else {k: v for k, v in params.items() if _picklable(v)},
            seed=self.options.seed,
            options=self.forwarded_options,
            sys_path=list(sys.path),
        )

    def _write_trace(self, item: pytest.Function, traces: dict[int, list[CollectiveRecord]],
                     divergence: Divergence | None) -> None:
        directory = os.path.join(self.reports_dir, "traces")
        os.makedirs(directory, exist_ok=True)
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", item.nodeid).strip("_") + ".txt"
        header = f"first divergence: {divergence.describe()}" if divergence else "no divergence between ranks"
        with open(os.path.join(directory, name), "w", encoding="utf-8") as handle:
            handle.write(f"{item.nodeid}\n{header}\n\n{format_trace_table(traces)}\n")

    def _report(self, item: pytest.Function, suite: SuiteKey, execution: Execution, verdict: Verdict) -> None:
        reported = set(self.ranks_reported(suite.world_size))
        for rank, result in execution.results.items():
            stdout, stderr = execution.captured.get(rank, ("", ""))
            if rank in reported:
                self.junit.add(rank, suite, self._rank_case(item, rank, result, stdout, stderr, verdict))
            if stdout:
                sys.stdout.write(f"--- rank {rank} stdout ---\n{stdout}\n")
            if stderr:
                sys.stdout.write(f"--- rank {rank} stderr ---\n{stderr}\n")
        if verdict.outcome == "failed":
            lost = [f"--- rank {rank} stderr (last lines) ---\n{_tail_lines(execution.captured[rank][1], 25)}"
                    for rank, result in execution.results.items()
                    if isinstance(result, RankLoss) and execution.captured.get(rank, ("", ""))[1]]
            pytest.fail("\n".join([verdict.message, *lost, self.repro_line(item)]), pytrace=False)
        if verdict.outcome == "skipped":
            pytest.skip(verdict.message)
        if verdict.outcome == "xfailed":
            pytest.xfail(verdict.message)

    def _rank_case(self, item: pytest.Function, rank: int, result: RankResult, stdout: str, stderr: str,
                   verdict: Verdict) -> CaseRecord:
        if isinstance(result, RankLoss):
            text = f"rank {rank} {result.cause}\n{result.stacks}\n--- stderr ---\n{stderr}"
            return self.case(item, 0.0, "failed", f"rank {rank} {result.cause}", text, stdout, stderr)
        if verdict.divergence and result.status != "failed":
            return self.case(item, result.duration_s, "failed", verdict.divergence, verdict.divergence,
                             stdout, stderr)
        text = "\n".join(filter(None, [result.traceback or result.summary, verdict.divergence]))
        return self.case(item, result.duration_s, result.status, result.summary, text, stdout, stderr)

    @staticmethod
    def case(item: pytest.Function, duration: float, status: str, message: str, text: str = "",
             stdout: str = "", stderr: str = "") -> CaseRecord:
        path, _, rest = item.nodeid.partition("::")
        classname = path.removesuffix(".py").replace("/", ".")
        if "::" in rest:
            classname += "." + rest.rsplit("::", 1)[0].replace("::", ".")
        return CaseRecord(classname, item.name, duration, status, message, text, stdout, stderr)

    def repro_args(self, item: pytest.Function) -> list[str]:
        """The pytest arguments that re-run exactly this test: node id, device, seed, timeouts, backend."""
        opts = self.options
        args = [item.nodeid, f"--device={opts.device}", f"--seed={opts.seed}",
                f"--collective-timeout={opts.collective_timeout:g}", f"--test-timeout={opts.test_timeout:g}"]
        for extra in item.config.hook.pytest_harness_repro_args(item=item):
            args.extend(extra)
        return args

    def repro_line(self, item: pytest.Function) -> str:
        command = [sys.executable, "-m", "pytest", *self.repro_args(item)]
        return (f"REPRO: cd {shlex.quote(str(item.config.rootpath))} && {shlex.join(command)}"
                f"  (or: pytest --repro {shlex.quote(item.nodeid)})")

    def _remember_repro(self, item: pytest.Function) -> None:
        cache = getattr(self.config, "cache", None)
        if cache is not None:
            recorded = cache.get(REPRO_CACHE_KEY, {})
            recorded[item.nodeid] = self.repro_args(item)
            cache.set(REPRO_CACHE_KEY, recorded)


class PoolSession(HarnessSession):
    """The parent owns warm pools of rank processes, one per (world size, device, timeout)."""

    def __init__(self, config: pytest.Config, rank_fixture_modules: tuple[str, ...], reports_dir: str) -> None:
        super().__init__(config, rank_fixture_modules, reports_dir)
        self.tag = uuid.uuid4().hex[:12]
        self.run_dir = tempfile.mkdtemp(prefix=f"fsdp-harness-{self.tag}-")
        self.pools: dict[PoolKey, WorkerPool] = {}
        self.pool_starts = 0
        self._closed = False

    def pool_for(self, key: PoolKey) -> WorkerPool:
        pool = self.pools.get(key)
        if pool is None:
            run_dir = os.path.join(self.run_dir, f"ws{key.world_size}-{key.device_kind}-{self.pool_starts}")
            pool = WorkerPool(key, run_dir, self.rank_fixture_modules, self.tag, self.label_providers)
            self.pool_starts += 1
            pool.start()
            self.pools[key] = pool
        return pool

    def discard_pool(self, key: PoolKey) -> None:
        pool = self.pools.pop(key, None)
        if pool is not None:
            pool.kill()

    def kill_all(self) -> None:
        for key in list(self.pools):
            self.discard_pool(key)
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def finish(self) -> list[str]:
        """Close pools politely and write the per-rank reports (idempotent)."""
        if not self._closed:
            self._closed = True
            for pool in self.pools.values():
                pool.close()
            self.pools.clear()
        return super().finish()

    def summary(self) -> str:
        return f"{self.dispatched} distributed tests, {self.pool_starts} pool starts"

    def execute(self, item: pytest.Function, world_size: int, device_kind: str, task: TestTask) -> Execution:
        key = PoolKey(world_size, device_kind, self.options.collective_timeout)  # type: ignore[arg-type]
        if item.get_closest_marker("fresh_world") is not None:
            self.discard_pool(key)
        pool = self.pool_for(key)
        try:
            results = pool.run(task, self.options.test_timeout, self.options.straggler_grace)
        except BaseException:
            self.discard_pool(key)  # interrupted (Ctrl-C, pytest-timeout): no rank may outlive it
            raise
        files = {rank: pool.rank_files(rank) for rank in results}
        return Execution(
            results=results,
            captured={rank: (tail(f.stdout, _CAPTURE_LIMIT), tail(f.stderr, _CAPTURE_LIMIT)) for rank, f in files.items()},
            traces={rank: _read_trace(f.trace) for rank, f in files.items()},
        )

    def after_test(self, item: pytest.Function, execution: Execution, verdict: Verdict) -> None:
        interrupted_collective = any(not r.completed for records in execution.traces.values() for r in records)
        if (item.get_closest_marker("fresh_world") is not None or interrupted_collective
                or not verdict.pool_reusable):
            # A collective that raised or hung leaves gloo/NCCL pairs unusable; so may a rank
            # that failed with work half-issued. The next test gets fresh ranks.
            for key in [k for k in self.pools if k.world_size == len(execution.results)]:
                self.discard_pool(key)


def _tail_lines(text: str, count: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-count:])


def _read_trace(path: str) -> list[CollectiveRecord]:
    try:
        return read_trace(path)
    except FileNotFoundError:  # the rank died before its first test began
        return []


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001 - any pickling failure has the same fix
        return False
    return True
