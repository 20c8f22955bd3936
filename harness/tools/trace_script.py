"""Trace and diff a plain `torchrun` script, no pytest test needed.

    torchrun --nproc-per-node 4 -m harness.tools.trace_script [--trace-dir DIR] train.py [script args]
    python -m harness.tools.trace_script --diff DIR         # diff traces written earlier

Every rank records its collectives into `DIR/rank-<r>.jsonl` as the script runs (the format of
`harness.trace.records`; default DIR: `./collective-traces`), with the same tensor names, call sites and
labels as in a test. Global rank 0 prints the diff (`harness.trace.divergence`) to stderr:
  * when the script ends (or raises) on every rank: the first divergent collective, or a line
    saying the ranks agree;
  * when a rank waits in a collective that can never complete (`harness.trace.one_sided`: its peers
    finished without issuing it, or wait in calls that cannot match): at once, then it exits with
    status 3 so that torchrun stops the other ranks instead of waiting for the collective timeout;
  * when torchrun stops it (another rank crashed): from what the ranks recorded until then.
`DIR/diff.txt` gets the diff and every rank's trace table.

All ranks must see DIR (one host, or a shared file system).
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import sys
import threading
import time
from pathlib import Path

__all__ = ["diff_directory", "main"]

_END_SUFFIX = ".end"
_POLL_S = 0.5


def diff_directory(directory: str | Path, world_size: int | None = None, reason: str = "") -> str:
    """The diff of the traces in `directory` (`rank-<r>.jsonl`), as printed; also written to diff.txt."""
    from harness.trace.divergence import diagnosis, format_trace_table
    from harness.trace.records import read_trace_or_empty

    directory = Path(directory)
    ranks = sorted(int(path.stem.removeprefix("rank-")) for path in directory.glob("rank-*.jsonl"))
    if world_size is None:
        world_size = max(ranks, default=-1) + 1
    traces = {rank: read_trace_or_empty(str(directory / f"rank-{rank}.jsonl")) for rank in range(world_size)}
    lines = [f"harness.tools.trace_script: {reason}"] if reason else []
    lines.append(diagnosis(traces, list(range(world_size))))
    missing = [rank for rank in range(world_size) if rank not in ranks]
    if missing:
        lines.append(f"no trace from ranks {missing}: they never started the script under harness.tools.trace_script")
    text = "\n".join(lines)
    table = format_trace_table(traces)
    (directory / "diff.txt").write_text(f"{text}\n\n{table}", encoding="utf-8")
    return f"{text}\n(every rank's trace: {directory / 'diff.txt'})"


class _RankSide:
    """What one rank of a traced script does around the script."""

    def __init__(self, directory: Path, rank: int, world_size: int) -> None:
        self.directory, self.rank, self.world_size = directory, rank, world_size
        self.reported = threading.Lock()
        self.status = "running"

    def start(self) -> None:
        from harness.rank import tracing

        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / f"rank-{self.rank}{_END_SUFFIX}").unlink(missing_ok=True)
        tracing.install()
        tracing.begin_test(str(self.trace_path(self.rank)))
        signal.signal(signal.SIGTERM, self._terminated)
        if self.rank == 0:
            threading.Thread(target=self._watch, name="harness-trace-watch", daemon=True).start()

    def trace_path(self, rank: int) -> Path:
        return self.directory / f"rank-{rank}.jsonl"

    def finish(self, status: str) -> None:
        """The script is over on this rank: say so; rank 0 waits for the others, then reports."""
        self.status = status
        (self.directory / f"rank-{self.rank}{_END_SUFFIX}").write_text(status)
        if self.rank != 0:
            return
        deadline = time.monotonic() + float(os.environ.get("HARNESS_TRACE_WAIT_S", "30"))
        while time.monotonic() < deadline and len(self._finished()) < self.world_size:
            time.sleep(0.1)
        waiting = self.world_size - len(self._finished())
        reason = f"the script ended ({status}) on rank 0"
        if waiting:
            reason += f"; {waiting} ranks had not ended it after {os.environ.get('HARNESS_TRACE_WAIT_S', '30')} s"
        self._report(reason)

    def _finished(self) -> set[int]:
        return {
            int(path.name.removeprefix("rank-").removesuffix(_END_SUFFIX))
            for path in self.directory.glob(f"rank-*{_END_SUFFIX}")
        }

    def _report(self, reason: str) -> None:
        if not self.reported.acquire(blocking=False):
            return
        sys.stderr.write(diff_directory(self.directory, self.world_size, reason) + "\n")
        sys.stderr.flush()

    def _watch(self) -> None:
        from harness.trace.one_sided import OneSidedWatch

        paths = {rank: str(self.trace_path(rank)) for rank in range(self.world_size)}
        watch = OneSidedWatch(paths, truncate=False)
        while True:
            time.sleep(_POLL_S)
            finished = self._finished()
            hopeless = watch.check(finished, set(range(self.world_size)) - finished)
            if hopeless:
                self._report(f"stopped: {hopeless}")
                os._exit(3)  # torchrun then stops the other ranks

    def _terminated(self, signum: int, _frame: object) -> None:
        (self.directory / f"rank-{self.rank}{_END_SUFFIX}").write_text("terminated")
        if self.rank == 0:
            self._report(f"rank 0 was stopped by signal {signum} (another rank failed or torchrun was interrupted)")
        os._exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.tools.trace_script", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--trace-dir", default="collective-traces", help="where every rank writes its trace")
    parser.add_argument("--diff", metavar="DIR", help="only diff the traces already in DIR and exit")
    parser.add_argument("script", nargs="?", help="the training script, run as __main__ on every rank")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    if options.diff:
        print(diff_directory(options.diff))
        return 0
    if not options.script:
        parser.error("give the script to run (under torchrun), or --diff DIR")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        parser.error("run under torchrun (RANK and WORLD_SIZE are not set), e.g. torchrun --nproc-per-node 2 -m ...")
    side = _RankSide(Path(options.trace_dir), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    side.start()
    sys.argv = [options.script, *options.script_args]
    sys.path[0] = os.path.dirname(os.path.abspath(options.script))  # as `python train.py` would
    status = "returned"
    try:
        runpy.run_path(options.script, run_name="__main__")
    except SystemExit as exit_:
        status = f"exited with {exit_.code}"
        raise
    except BaseException as error:
        status = f"raised {type(error).__name__}: {error}"
        raise
    finally:
        side.finish(status)
    return 0


if __name__ == "__main__":
    sys.exit(main())
