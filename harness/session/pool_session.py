"""The parent owns the ranks: warm pools of rank processes, started lazily, kept while reusable.

What this session starts, it ends, however the session ends: pools are closed politely at the
normal end and killed on an interrupt (Ctrl-C, SIGTERM) or at exit; the run directory in TMPDIR
is removed. If the pytest process itself is killed, its reaper (`harness.process.reaper`) ends what the
ranks left and removes the run directory, and the next session sweeps what remains.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid

import pytest
import torch

from harness.config.deadlines import deadline_of
from harness.config.devices import visible_gpu_count
from harness.config.rank_modules import RankModules
from harness.message_text import read_tail
from harness.messages import RankResult, TestTask
from harness.process.launcher import WorkerLauncher
from harness.process.pool import PoolKey, PoolStartError, WorkerPool
from harness.process.reaper import Reaper, hold_run_dir, run_dir_name, sweep_stale_run_dirs
from harness.session.flow import Execution, HarnessSession, WorldStartError, WorldUnusable
from harness.session.verdict import world_reusable
from harness.trace.flight_recorder import dump_report
from harness.trace.one_sided import OneSidedWatch
from harness.trace.records import read_trace_or_empty

_CAPTURE_LIMIT = 256 * 1024  # bytes per rank and stream: the tail of a flood of output is what explains it


def agent_store_error(failure: str) -> str:
    """The harness error of a test whose pool could not serve MASTER_ADDR:MASTER_PORT."""
    return (
        "harness error: the store behind MASTER_ADDR:MASTER_PORT (the TCPStore torchrun's agent "
        f"would host, built by harness.process.rank_env.AgentStore) could not be started: {failure}. "
        f"The test's own outcome is void. This torch ({torch.__version__}) needs another way to "
        "start a TCPStore in harness/process/rank_env.py; report it to the harness with this message"
    )


class PoolSession(HarnessSession):
    """The parent owns warm pools of rank processes, one per (world size, device, timeout)."""

    def __init__(self, config: pytest.Config, rank_modules: RankModules, reports_dir: str) -> None:
        super().__init__(config, rank_modules, reports_dir)
        self.tag = uuid.uuid4().hex[:12]
        sweep_stale_run_dirs(tempfile.gettempdir())
        self.run_dir = tempfile.mkdtemp(prefix=run_dir_name(self.tag))
        self._owner = hold_run_dir(self.run_dir)
        self.pools: dict[PoolKey, WorkerPool] = {}
        self.pool_starts = 0
        self.spmd_calls = 0
        """Parent-side SPMD calls run on this session's pools (`harness.session.spmd`)."""
        self.interrupted = False
        self._reaper: Reaper | None = None
        # Imported once, by the zygote. See [Note: zygote preload] in harness.rank.zygote.
        provider_modules = tuple(spec.partition(":")[0] for spec in self.label_providers)
        preload = (*rank_modules.preload, *provider_modules, *rank_modules.fixtures)
        self.launcher = WorkerLauncher(
            self.run_dir, self.tag, on_spawn=self._on_spawn, preload=tuple(dict.fromkeys(preload))
        )
        self._interrupted_results: dict[int, RankResult] | None = None
        self._closed = False

    def _on_spawn(self, pid: int) -> None:
        if self._reaper is None:  # started with the first worker: a session without ranks needs none
            self._reaper = Reaper(self.tag, self.run_dir)

    def pool_for(self, key: PoolKey) -> WorkerPool:
        pool = self.pools.get(key)
        if pool is None:
            if key.device_kind == "cuda":
                self._make_room_on_gpus(key.world_size)
            run_dir = os.path.join(self.run_dir, f"ws{key.world_size}-{key.device_kind}-{self.pool_starts}")
            pool = WorkerPool(key, run_dir, self.rank_fixture_modules, self.tag, self.label_providers, self.launcher)
            self.pool_starts += 1
            pool.start()
            self.pools[key] = pool
        return pool

    def _make_room_on_gpus(self, needed: int) -> None:
        """Close this session's idle CUDA pools when they hold GPUs a new pool needs.

        Otherwise a warm pool of 2 ranks on a 4-GPU runner would make a pool of 4 wait for
        GPUs that only this session could give back (until the reservation timed out).
        """
        held = sum(k.world_size for k in self.pools if k.device_kind == "cuda")
        if held and held + needed > visible_gpu_count():
            for key in [k for k in self.pools if k.device_kind == "cuda"]:
                self.pools.pop(key).close()

    def discard_pool(self, key: PoolKey) -> None:
        pool = self.pools.pop(key, None)
        if pool is not None:
            pool.kill()

    def kill_all(self) -> None:
        """Kill every process of the session and remove its run directory (idempotent; also at exit)."""
        for key in list(self.pools):
            self.discard_pool(key)
        self.launcher.close()
        if self._reaper is not None:
            self._reaper.finish()
            self._reaper = None
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self._owner.close()

    def finish(self) -> list[str]:
        """Close pools (politely unless interrupted) and write the reports (idempotent)."""
        if not self._closed:
            self._closed = True
            for key, pool in list(self.pools.items()):
                if self.interrupted:
                    pool.kill()
                else:
                    pool.close()
                del self.pools[key]
            self.launcher.close()
        return super().finish()

    def summary(self) -> str:
        text = (
            f"{self.dispatched} distributed tests, {self.pool_starts} pool starts, "
            f"{self.launcher.spawned} rank processes"
        )
        if self.spmd_calls:
            text += f", {self.spmd_calls} parent-side SPMD calls"
        if self.launcher.zygote_unavailable:
            text += f" (spawned, not forked: {self.launcher.zygote_unavailable.splitlines()[0]})"
        return text

    def interrupted_results(self) -> dict[int, RankResult] | None:
        return self._interrupted_results

    def execute(self, item: pytest.Function, world_size: int, device_kind: str, task: TestTask) -> Execution:
        key = PoolKey(world_size, device_kind, self.options.collective_timeout)  # type: ignore[arg-type]
        self._interrupted_results = None
        if item.get_closest_marker("fresh_world") is not None:
            self.discard_pool(key)
        try:
            pool = self.pool_for(key)
        except PoolStartError as error:
            raise WorldStartError(str(error)) from error
        try:
            # A test that diverges on purpose may also wait in a collective on purpose (to see it
            # time out): only the collective timeout ends its waits.
            watch = OneSidedWatch({rank: pool.rank_files(rank).trace for rank in range(world_size)})
            hopeless = None if item.get_closest_marker("expect_divergence") else watch.check
            # --test-timeout, or pytest-timeout's limit for this test (whose own timer is held off).
            deadline = deadline_of(item, self.options.test_timeout)
            started_at = time.time()
            results = pool.run(task, deadline.seconds, self.options.straggler_grace, hopeless, deadline.source)
        except BaseException as error:
            # Interrupted (Ctrl-C, SIGTERM): no rank may outlive the test.
            self._interrupted_results = pool.interrupted_results
            if isinstance(error, KeyboardInterrupt):
                self.interrupted = True
            self.discard_pool(key)
            raise
        store_failure = pool.agent_store_failure
        if store_failure is not None:
            # The ranks ran without the torchrun contract's store: whatever they concluded, a
            # library that connects to it could not have, so the test is a harness error.
            self.discard_pool(key)
            raise WorldUnusable(agent_store_error(store_failure))
        files = {rank: pool.rank_files(rank) for rank in results}
        return Execution(
            results=results,
            captured={
                rank: (read_tail(f.stdout, _CAPTURE_LIMIT), read_tail(f.stderr, _CAPTURE_LIMIT))
                for rank, f in files.items()
            },
            traces={rank: read_trace_or_empty(f.trace) for rank, f in files.items()},
            flight_recorder=dump_report(pool.flight_recorder_dumps(started_at), list(results)),
        )

    def after_test(self, item: pytest.Function, execution: Execution) -> None:
        # The one place that decides whether the ranks go on: the reuse rule is
        # `world_reusable`; a `fresh_world` test also leaves fresh ranks behind it.
        fresh_world = item.get_closest_marker("fresh_world") is not None
        if fresh_world or not world_reusable(execution.results, execution.traces):
            for key in [k for k in self.pools if k.world_size == len(execution.results)]:
                self.discard_pool(key)
