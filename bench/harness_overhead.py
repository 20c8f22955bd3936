"""Per-test overhead: the harness's warm pool vs an upstream-style fresh spawn per test.

Both run the same trivial test (one all-reduce) at world sizes 2 and 4 in one run. The warm
side dispatches through `WorkerPool.run`, the exact path the pytest plugin uses; the fresh side
does what upstream's MultiProcessTestCase does per test: spawn N interpreters, import torch,
rendezvous, run, tear down.

    python bench/harness_overhead.py [--warm-tests 200] [--fresh-tests 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from _trivial import trivial_task  # noqa: E402

from harness.process.pool import PoolKey, WorkerPool  # noqa: E402
from harness.session.verdict import decide  # noqa: E402


def warm_ms_per_test(world_size: int, tests: int) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        pool = WorkerPool(PoolKey(world_size, "cpu", 30.0), run_dir, (), "bench")
        pool.start()
        task = trivial_task()
        try:
            for _ in range(5):  # first collectives open gloo connections: not per-test cost
                assert decide(pool.run(task, 60, 5)).outcome == "passed"
            started = time.perf_counter()
            for _ in range(tests):
                assert decide(pool.run(task, 60, 5)).outcome == "passed"
            return (time.perf_counter() - started) * 1000 / tests
        finally:
            pool.close()


def _fresh_rank(rank: int, world_size: int, init_file: str) -> None:
    from _trivial import trivial_test

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    trivial_test(rank)
    dist.destroy_process_group()


def fresh_ms_per_test(world_size: int, tests: int) -> float:
    samples = []
    for _ in range(tests):
        with tempfile.TemporaryDirectory() as scratch:
            started = time.perf_counter()
            mp.start_processes(
                _fresh_rank, args=(world_size, os.path.join(scratch, "init")), nprocs=world_size, start_method="spawn"
            )
            samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm-tests", type=int, default=200)
    parser.add_argument("--fresh-tests", type=int, default=3)
    args = parser.parse_args()
    lines = []
    for world_size in (2, 4):
        warm = warm_ms_per_test(world_size, args.warm_tests)
        fresh = fresh_ms_per_test(world_size, args.fresh_tests)
        lines.append(
            f"harness overhead ws{world_size}: warm {warm:.2f} ms/test, fresh {fresh:.0f} ms/test, "
            f"ratio Y/X = {fresh / warm:.0f}"
        )
        print(lines[-1], flush=True)


if __name__ == "__main__":
    main()
