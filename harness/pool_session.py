"""The parent owns the ranks: warm pools of rank processes, started lazily, kept while reusable."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid

import pytest

from harness.devices import visible_gpu_count
from harness.messages import TestTask
from harness.pool import PoolKey, PoolStartError, WorkerPool, tail
from harness.session import Execution, HarnessSession, WorldStartError
from harness.tracefile import read_trace_or_empty
from harness.verdict import world_reusable

_CAPTURE_LIMIT = 1 << 20  # per rank and stream: the tail of a flood of output is what explains it


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
            if key.device_kind == "cuda":
                self._make_room_on_gpus(key.world_size)
            run_dir = os.path.join(self.run_dir, f"ws{key.world_size}-{key.device_kind}-{self.pool_starts}")
            pool = WorkerPool(key, run_dir, self.rank_fixture_modules, self.tag, self.label_providers)
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
        for key in list(self.pools):
            self.discard_pool(key)
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def finish(self) -> list[str]:
        """Close pools politely and write the reports (idempotent)."""
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
        try:
            pool = self.pool_for(key)
        except PoolStartError as error:
            raise WorldStartError(str(error)) from error
        try:
            results = pool.run(task, self.options.test_timeout, self.options.straggler_grace)
        except BaseException:
            self.discard_pool(key)  # interrupted (Ctrl-C, pytest-timeout): no rank may outlive it
            raise
        files = {rank: pool.rank_files(rank) for rank in results}
        return Execution(
            results=results,
            captured={
                rank: (tail(f.stdout, _CAPTURE_LIMIT), tail(f.stderr, _CAPTURE_LIMIT)) for rank, f in files.items()
            },
            traces={rank: read_trace_or_empty(f.trace) for rank, f in files.items()},
        )

    def after_test(self, item: pytest.Function, execution: Execution) -> None:
        # The one place that decides whether the ranks go on: the reuse rule is
        # `world_reusable`; a `fresh_world` test also leaves fresh ranks behind it.
        fresh_world = item.get_closest_marker("fresh_world") is not None
        if fresh_world or not world_reusable(execution.results, execution.traces):
            for key in [k for k in self.pools if k.world_size == len(execution.results)]:
                self.discard_pool(key)
