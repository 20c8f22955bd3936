"""Per-call cost of parent-side SPMD calls (`harness.SpmdWorld.run`) on a warm pool, against the
distributed-test dispatch measured in the same run.

For world sizes 2 and 4, one warm CPU pool each: a no-op function (`_trivial.noop`) called through
`SpmdWorld.run` exactly as a test calls it, in each combination of `trace` and `isolate`, and the
anchor, `WorkerPool.run` of bench/harness_overhead.py's trivial `TestTask` (one all-reduce, the
path every distributed test takes). The function does nothing, so a call's wall time is the
harness's own cost. The modes are measured in interleaved rounds (the machine is shared: a round
that others slowed shows in every mode alike); each figure is the median over the rounds of a
round's mean.

    python bench/spmd_call_overhead.py [--calls 200] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from _trivial import noop, trivial_task  # noqa: E402

from harness.process.pool import PoolKey, WorkerPool  # noqa: E402
from harness.session.spmd import SpmdWorld  # noqa: E402
from harness.session.verdict import decide  # noqa: E402

MODES = ((False, False), (True, False), (False, True), (True, True))  # (trace, isolate)


class _OnePoolSession:
    """What `SpmdWorld` asks of its session (`PoolSession`), around one pool started here."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self.options = SimpleNamespace(seed=0, test_timeout=60.0, straggler_grace=5.0, collective_timeout=30.0)
        self.forwarded_options = {"seed": 0, "device": "cpu", "test_timeout": 60.0}
        self.spmd_calls = 0
        self.interrupted = False

    def pool_for(self, key: PoolKey) -> WorkerPool:
        return self.pool

    def discard_pool(self, key: PoolKey) -> None:
        raise AssertionError("a no-op call must never discard the pool")


def measure(world_size: int, calls: int, rounds: int) -> dict[str, float]:
    """ms per call (or per test, for the anchor) of each mode at `world_size`."""
    with tempfile.TemporaryDirectory() as run_dir:
        pool = WorkerPool(PoolKey(world_size, "cpu", 30.0), run_dir, (), "bench")
        pool.start()
        try:
            world = SpmdWorld(_OnePoolSession(pool), world_size, "cpu")  # type: ignore[arg-type]
            task = trivial_task()

            def anchor() -> None:
                assert decide(pool.run(task, 60, 5)).outcome == "passed"

            def spmd(trace: bool, isolate: bool) -> None:
                result = world.run(noop, trace=trace, isolate=isolate)
                assert result.ok and not result.restarted, result.describe()

            runners = {"test dispatch (anchor)": anchor}
            for trace, isolate in MODES:
                runners[f"trace={trace!s:5} isolate={isolate!s:5}"] = lambda t=trace, i=isolate: spmd(t, i)
            for run in runners.values():  # warm-up: gloo connections, first imports, caches
                for _ in range(10):
                    run()
            samples: dict[str, list[float]] = {name: [] for name in runners}
            for _ in range(rounds):
                for name, run in runners.items():
                    started = time.perf_counter()
                    for _ in range(calls):
                        run()
                    samples[name].append((time.perf_counter() - started) * 1000 / calls)
            return {name: statistics.median(values) for name, values in samples.items()}
        finally:
            pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per mode and round (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default: %(default)s)")
    args = parser.parse_args()
    for world_size in (2, 4):
        results = measure(world_size, args.calls, args.rounds)
        anchor = results["test dispatch (anchor)"]
        for name, ms in results.items():
            ratio = "" if name.startswith("test dispatch") else f"  ({ms / anchor:.2f}x the test dispatch)"
            print(f"ws{world_size} {name}: {ms:.3f} ms/call{ratio}", flush=True)


if __name__ == "__main__":
    main()
