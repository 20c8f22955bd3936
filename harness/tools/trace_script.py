"""Trace and diff a plain `torchrun` script, no pytest test needed.

    torchrun --nproc-per-node 4 -m harness.tools.trace_script [--trace-dir DIR] train.py [script args]
    python -m harness.tools.trace_script --diff DIR         # diff the last run's traces in DIR again

Every rank records its collectives into `DIR/rank-<r>.jsonl` as the script runs (the format of
`harness.trace.records`; default DIR: `./collective-traces`), with the same tensor names, call sites and
labels as in a test. Exactly one rank of the run prints the cross-rank diff (`harness.trace.divergence`)
to stderr, and `DIR/diff.txt` gets it with every rank's trace table; it is made from the trace files
alone, so it holds whatever happened to the ranks:
  * the script ended on every rank (returned, raised, exited, `os._exit`) or a rank died (a signal,
    gloo's SIGABRT on a size mismatch): the last rank standing reports. A rank that died is known by
    its pid file and /proc on the same host; one on another host is waited for `HARNESS_TRACE_WAIT_S`
    (default 30 s) when the script returned, 2 s otherwise;
  * a rank waits in a collective that can never complete (`harness.trace.one_sided`, watched on every
    rank, every 0.25 s): the rank that sees it reports at once and every rank exits with status 3,
    instead of waiting for the collective timeout;
  * torchrun stops the job (SIGTERM, SIGHUP; SIGINT a second after it, if the script's
    KeyboardInterrupt did not end it): each rank ends within about 2 s although its main thread may be
    blocked in gloo (where no Python signal handler runs): the signal's number reaches a thread of ours
    through `signal.set_wakeup_fd`; the processes the rank started go with it (SIGKILL to its process
    group and descendants), and a rank whose torchrun dies gets SIGTERM (`PR_SET_PDEATHSIG`);
  * every rank died before one could report: the next run on the same DIR prints that run's diff
    before it starts (also in `DIR/previous-diff.txt`), and torchrun's failure summary shows each dead
    rank's line "... python -m harness.tools.trace_script --diff DIR" (the rank's TORCHELASTIC_ERROR_FILE).
A script that installs its own SIGTERM / SIGHUP / SIGINT handler keeps it: that signal is then its own.

Exit status of a rank: the script's (0 when it returned, its `sys.exit` / `os._exit` status, 1 for an
exception); 3 when the one-sided watch stopped the run; 4 when the script returned but the ranks'
replicated parameters or buffers differ (replica drift: `end_of_run_checks`; `HARNESS_CHECK_REPLICAS=0`
turns the check off); 128 + N when signal N ended it (143: SIGTERM).
torchrun exits 1 when any rank failed. `--diff` exits 0.

The files in DIR, besides the traces: `rank-<r>.pid` (which run, process and host), `rank-<r>.end`
(how the script ended there), `report-<run>.claim` (the one rank that reports, made with O_EXCL),
`stop-<run>` (a stop by the watch, read by the other ranks), `.lock`. A run is told from the last one
in DIR by its torchrun agent (one host) or a key drawn in torchrun's store (several hosts).
All ranks must see DIR (one host, or a shared file system). The files and the processes behind them are
`harness.tools.trace_run_files`.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import hashlib
import os
import runpy
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

from harness.tools.trace_run_files import (
    ALIVE,
    DEAD,
    ELSEWHERE,
    ENDED,
    NOT_STARTED,
    End,
    RunFiles,
    latest_run,
    locked,
    own_processes,
    proc_stat,
    rank_of,
    read_json,
    run_identity,
    this_host,
    write_json,
)

__all__ = ["EXIT_DRIFT", "EXIT_STOPPED", "diff_directory", "end_of_run_checks", "main"]


EXIT_STOPPED = 3
"""A rank's exit status when the one-sided watch stopped the run."""


EXIT_DRIFT = 4
"""A rank's exit status when its script returned but the replicas of the ranks differ."""


_POLL_S = 0.25
"""How often each rank's watch looks at the traces (as a pool's parent does)."""


_WAITING_S = 0.5
"""How long a rank must wait in a collective before its watch reads its peers' traces (a collective
that completes normally costs no read of theirs)."""


_END_POLL_S = 0.05
"""How often an ending rank looks whether its peers have ended."""


_SHORT_WAIT_S = 2.0
"""How long a rank that ends by a signal, an error or `os._exit` waits for its peers' ends."""


_FAILED_ALIVE_S = 0.5
"""How long a rank whose script failed waits for peers still running before it leaves the report to
them (a peer whose death failed this rank's call is seen dead at once: `_running`)."""


_SIGINT_GRACE_S = 1.0
"""How long SIGINT's KeyboardInterrupt gets to end the script before the rank ends as for SIGTERM."""


_HEARTBEAT_S = 1.0
"""How often a rank refreshes the time in its torchrun error file (torchrun orders failures by it)."""


_STOPPING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def end_of_run_checks(directory: Path, rank: int, world_size: int, returned: bool, run: str = "") -> list[str]:
    """Checks a rank runs once its script has ended, in its main thread, before this rank's end is
    recorded and before the report: the one place for such checks. `returned`: the script returned
    (or exited 0) on this rank; false after an exception or a non-zero exit, when a check that needs
    its peers should not wait for them. Each returned line is kept in `DIR/rank-<r>.end` and printed
    after the diff by whichever rank reports ("ranks 0, 1: <line>", one line for the ranks that said
    the same). The tracer is still recording: a check that issues collectives must issue them on
    every rank. Not run when a signal, `os._exit` or the one-sided watch ends the rank (its main
    thread may be blocked in a collective then).

    The check made here: replica drift (`harness.rank.replicas`, on unless `HARNESS_CHECK_REPLICAS=0`).
    Each rank writes its replicas' digests to `DIR/replicas-<run>-rank-<r>.json`, waits for its
    peers' (at most `_REPLICA_WAIT_S`, none after a failure) and compares them itself: no
    collective, so a script that destroyed its process group is checked too, and every rank says
    the same line."""
    global _drift_found
    from harness.rank import replicas
    from harness.trace.checksums import ReplicaSnapshot, comparison

    recorder = replicas.active_recorder()
    if recorder is None:
        return []
    try:
        snapshot = recorder.finish(rank)
    finally:
        replicas.end_test()
    write_json(directory / f"replicas-{run}-rank-{rank}.json", snapshot.to_dict())
    if not returned:
        return []
    paths = {peer: directory / f"replicas-{run}-rank-{peer}.json" for peer in range(world_size)}
    deadline = time.monotonic() + _REPLICA_WAIT_S
    while not all(path.exists() for path in paths.values()) and time.monotonic() < deadline:
        time.sleep(_END_POLL_S)
    snapshots = {
        peer: ReplicaSnapshot.from_dict(data) for peer, path in paths.items() if (data := read_json(path)) is not None
    }
    report = comparison(snapshots)
    missing = sorted(set(paths) - set(snapshots))
    lines = [report.describe()] if report.drift is not None or report.compared else []
    if report.drift is not None:
        _drift_found = True
    if missing and lines:
        lines.append(f"replicas of ranks {missing} not compared: their script had not ended after {_REPLICA_WAIT_S} s")
    return lines


_REPLICA_WAIT_S = 10.0
"""How long a rank whose script returned waits for its peers' replica digests."""


_drift_found = False
"""Whether this rank's end-of-run check found replicas that differ (the rank then exits EXIT_DRIFT)."""


def diff_directory(directory: str | Path, world_size: int | None = None, reason: str = "") -> str:
    """The diff of the last run's traces in `directory` (`rank-<r>.jsonl`), as printed; also written
    to diff.txt. Traces of ranks the last run did not start (left by an earlier, larger run) are not read."""
    directory = Path(directory)
    run = latest_run(directory)
    if run is not None:
        files = RunFiles(directory, run)
        started = files.started_ranks()
        recorded = max((int((files.started(rank) or {}).get("world_size", 0)) for rank in started), default=0)
        traced = set(started)
    else:  # traces written without pid files: every trace in the directory
        traced = {int(path.stem.removeprefix("rank-")) for path in directory.glob("rank-*.jsonl")}
        recorded = 0
    if world_size is None:
        world_size = max(recorded, max(traced, default=-1) + 1)
    return _write_diff(directory, traced, world_size, [reason] if reason else [])


def _write_diff(
    directory: Path,
    traced: set[int],
    world_size: int,
    reason: list[str],
    after: tuple[str, ...] = (),
    name: str = "diff.txt",
) -> str:
    """The report: the reason's lines, the diagnosis, the ranks without a trace, the lines `after`
    (the end-of-run checks'); `name` gets it with every rank's trace table. Only the ranks in `traced`
    are read."""
    from harness.trace.divergence import diagnosis, format_trace_table
    from harness.trace.records import read_trace

    notes: list[str] = []  # what a rank's trace says it could not see or record

    def read(rank: int) -> list:
        try:
            return read_trace(str(directory / f"rank-{rank}.jsonl"), notes)
        except FileNotFoundError:
            return []

    traces = {rank: read(rank) if rank in traced else [] for rank in range(world_size)}
    lines = [f"harness.tools.trace_script: {line}" for line in reason[:1]] + reason[1:]
    lines.append(diagnosis(traces, list(range(world_size)), notes))
    missing = [rank for rank in range(world_size) if rank not in traced]
    if missing:
        lines.append(f"no trace from ranks {missing}: they never started the script under harness.tools.trace_script")
    text = "\n".join([*lines, *after])
    (directory / name).write_text(f"{text}\n\n{format_trace_table(traces)}", encoding="utf-8")
    return f"{text}\n(every rank's trace: {directory / name})"


def _report_previous_runs(directory: Path, current: str, host: str) -> None:
    """Print the diff of an earlier run in DIR that no rank reported (every rank died), then forget
    its files. Called under DIR's lock, before this rank truncates its trace."""
    runs: dict[str, list[int]] = {}
    for path in directory.glob("rank-*.pid"):
        data = read_json(path)
        if data is not None and data.get("run") != current and rank_of(path) >= 0:
            runs.setdefault(str(data.get("run")), []).append(rank_of(path))
    for run, ranks in runs.items():
        previous = RunFiles(directory, run)
        world_size = max(int(previous.started(rank)["world_size"]) for rank in ranks)
        if any(previous.state(rank, host) == ALIVE for rank in ranks):
            continue  # still running: another job shares DIR
        if previous.claim(-1):
            said = "; ".join(previous.describe(world_size, host))
            reason = [f"the previous run in {directory} was never reported ({said}); its diff, before this run starts:"]
            after = tuple(previous.check_lines(world_size))
            text = _write_diff(directory, set(ranks), world_size, reason, after, name="previous-diff.txt")
            _say(text)
        previous.forget(ranks)


def _say(text: str) -> None:
    """To stderr, bypassing sys.stderr's lock (a signal's thread may write while the main thread is
    interrupted inside a write)."""
    data = (text + "\n").encode()
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(2, data) :]


def _flush_streams(timeout_s: float = 0.5) -> None:
    """The script's buffered output, before an os._exit; given up after `timeout_s` (a main thread
    blocked writing a full pipe holds the stream's lock)."""

    def flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()

    flusher = threading.Thread(target=flush, name="harness-trace-flush", daemon=True)
    flusher.start()
    flusher.join(timeout_s)


class _OwnTrace:
    """A rank's own trace file, read as it grows: is its last collective still unfinished?"""

    def __init__(self, path: Path) -> None:
        from harness.trace.records import RankTrace

        self.path, self.offset, self.partial, self.trace = path, 0, b"", RankTrace()

    def waiting(self) -> bool:
        with contextlib.suppress(OSError), open(self.path, "rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
            self.offset += len(data)
            lines = (self.partial + data).split(b"\n")
            self.partial = lines.pop()
            for line in lines:
                with contextlib.suppress(ValueError):
                    self.trace.add(line)
        records = self.trace.by_index
        last = records[max(records)] if records else None
        return last is not None and not last.completed and not last.skipped


class _RankSide:
    """What one rank of a traced script does around the script."""

    def __init__(self, directory: Path, rank: int, world_size: int) -> None:
        self.directory, self.rank, self.world_size = directory, rank, world_size
        self.pid = os.getpid()
        self.host = this_host()
        self.files = RunFiles(directory, "")
        self._end: End | None = None
        self._end_lock = threading.Lock()
        self._report_lock = threading.Lock()
        """Held while this rank writes the report: an exit waits for it."""
        self._concluded = threading.Event()
        self._exiting = False
        self._real_exit = os._exit
        self._wakeup: tuple[int, int] | None = None
        self._error_file = os.environ.get("TORCHELASTIC_ERROR_FILE") or None
        self._error_message = ""

    # -------------------------------------------------------------------------------- start

    def start(self) -> None:
        import harness.trace.divergence  # noqa: F401  imported now: a signal's thread must not import
        from harness.rank import tracing

        self.directory.mkdir(parents=True, exist_ok=True)
        run = hashlib.sha1(run_identity().encode()).hexdigest()[:16]
        self.files = RunFiles(self.directory, run)
        tracing.install()
        with locked(self.directory):
            _report_previous_runs(self.directory, run, self.host)
            self.files.end_file(self.rank).unlink(missing_ok=True)
            tracing.begin_test(str(self.files.trace(self.rank)))
            if os.environ.get("HARNESS_CHECK_REPLICAS", "1") != "0":
                from harness.rank import replicas

                replicas.begin_test(str(self.files.trace(self.rank)))
            stat = proc_stat(self.pid)
            started = {"run": run, "world_size": self.world_size, "pid": self.pid, "host": self.host}
            write_json(self.files.pid_file(self.rank), {**started, "start": stat[3] if stat else ""})
        self._write_error_file(
            f"harness.tools.trace_script: rank {self.rank} ended without its own account (killed or aborted); "
            f"a rank still running prints the collective diff, else: python -m harness.tools.trace_script "
            f"--diff {self.directory}"
        )
        self._install_signals()
        os._exit = self._os_exit
        os.register_at_fork(after_in_child=self._in_child)
        if "TORCHELASTIC_RUN_ID" in os.environ:
            with contextlib.suppress(OSError, AttributeError):  # SIGTERM when torchrun dies (Linux)
                ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        threading.Thread(target=self._watch, name="harness-trace-watch", daemon=True).start()

    def _install_signals(self) -> None:
        for signum in _STOPPING_SIGNALS:
            if signal.getsignal(signum) == signal.SIG_DFL:
                signal.signal(signum, self._on_python_signal)
        read, write = os.pipe()
        os.set_blocking(write, False)
        try:
            signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except (ValueError, OSError):
            os.close(read)
            os.close(write)
            return
        self._wakeup = (read, write)
        threading.Thread(target=self._signal_thread, name="harness-trace-signals", daemon=True).start()

    def _in_child(self) -> None:
        """A process forked by the script (a DataLoader worker) is not this rank: it gets the default
        dispositions back, and its signals never reach this rank's thread."""
        if self._wakeup is not None:
            with contextlib.suppress(ValueError, OSError):
                signal.set_wakeup_fd(-1)
            for fd in self._wakeup:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._wakeup = None
        for signum in _STOPPING_SIGNALS:
            with contextlib.suppress(ValueError, OSError):
                if signal.getsignal(signum) == self._on_python_signal:
                    signal.signal(signum, signal.SIG_DFL)

    # -------------------------------------------------------------------------------- the end

    def finish(self, end: End) -> None:
        """The script is over on this rank (main thread): record it, and report if this rank is the
        last one standing. After a return, wait for the peers still running (their end is the report's);
        after a failure, leave the report to them (torchrun stops them)."""
        try:
            checks = end_of_run_checks(
                self.directory, self.rank, self.world_size, returned=end.code == 0, run=self.files.run
            )
        except Exception as error:  # noqa: BLE001 - a check's own failure is a line of the report
            checks = [f"an end-of-run check failed: {type(error).__name__}: {error}"]
        own = replace(end, checks=tuple(checks))
        if self._mark_end(own) is own:
            try:
                if end.code == 0:
                    unseen_s = float(os.environ.get("HARNESS_TRACE_WAIT_S", "30"))
                    self._conclude(alive_s=float("inf"), then_report=True, unseen_s=unseen_s)
                else:  # torchrun stops the ranks still running: they report
                    self._conclude(alive_s=_FAILED_ALIVE_S, then_report=False, unseen_s=_SHORT_WAIT_S)
            except KeyboardInterrupt:  # SIGINT's thread ends this rank (below)
                self._exiting_soon()
                raise
            self._end_error_file(end, end.code)
        self._exiting_soon()

    def _exiting_soon(self) -> None:
        """A signal or a stop is ending this rank from its thread (that exit kills the processes the
        script started and sets the status): the main thread must not end the process first."""
        if self._exiting or (self._end is not None and self._end.kind in ("signal", "stopped")):
            deadline = time.monotonic() + _SIGINT_GRACE_S + _SHORT_WAIT_S + 10
            while time.monotonic() < deadline:
                time.sleep(0.05)

    def _mark_end(self, end: End) -> End:
        """This rank's end, recorded once: the first one wins."""
        with self._end_lock:
            if self._end is None:
                self._end = end
                with contextlib.suppress(OSError):
                    self.files.write_end(self.rank, end)
            return self._end

    def _conclude(self, alive_s: float, then_report: bool, unseen_s: float) -> None:
        """Report if this rank is the last one standing, once every other rank has ended or died.
        `alive_s`: how long to wait for ranks still running (inf: until they end), and then report
        anyway (`then_report`) or leave the report to them; `unseen_s`: how long to wait for ranks
        whose life cannot be seen (on another host, not started), then report."""
        started = time.monotonic()
        while not self.files.claimed():
            states = self.files.states(self.world_size, self.host)
            others = [state for rank, state in states.items() if rank != self.rank]
            waited = time.monotonic() - started
            alive = ALIVE in others and waited < alive_s
            if ALIVE in others and waited >= alive_s and not then_report:
                break
            if not alive and (not (ELSEWHERE in others or NOT_STARTED in others) or waited >= unseen_s):
                self._report_once()
                break
            time.sleep(_END_POLL_S)
        self._concluded.set()

    def _report_once(self) -> None:
        with self._report_lock:
            if self.files.claim(self.rank):
                said = "; ".join(self.files.describe(self.world_size, self.host))
                self._report(f"the run ended: {said} (reported by rank {self.rank})")

    def _report(self, reason: str) -> None:
        traced = set(self.files.started_ranks())
        after = tuple(self.files.check_lines(self.world_size))
        _flush_streams()  # the script's own lines first
        _say(_write_diff(self.directory, traced, self.world_size, [reason], after))

    def _exit(self, code: int, end: End) -> None:
        """End this rank now, from any thread: after a report in progress, with the script's buffered
        output, without the processes it started."""
        self._exiting = True
        with self._report_lock:
            self._end_error_file(end, code)
            _flush_streams()
            for pid in own_processes(self.pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            self._real_exit(code)

    def _os_exit(self, code: int) -> None:
        """`os._exit` as the script calls it: its end is recorded (and reported, if this rank is the
        last one), then the process ends at once. A process the script forked exits untouched."""
        if os.getpid() == self.pid and not self._exiting:
            end = self._mark_end(End("os._exit", code))
            self._conclude(alive_s=_FAILED_ALIVE_S, then_report=False, unseen_s=_SHORT_WAIT_S)
            self._end_error_file(end, code)
        self._real_exit(code)

    # -------------------------------------------------------------------------------- signals

    def _on_python_signal(self, signum: int, _frame: object) -> None:
        """The Python-level handler (main thread, between bytecodes): the signal's thread does the
        work; only where the wakeup fd is no longer ours (the script set its own) is it done here."""
        if os.getpid() != self.pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        current = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(current, warn_on_full_buffer=False)
        if self._wakeup is None or current != self._wakeup[1]:
            self._signalled(signum)

    def _signal_thread(self) -> None:
        assert self._wakeup is not None
        read = self._wakeup[0]
        while True:
            try:
                data = os.read(read, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in _STOPPING_SIGNALS and signal.getsignal(signum) == self._on_python_signal:
                    self._signalled(signum)
                elif signum == signal.SIGINT and signal.getsignal(signum) is signal.default_int_handler:
                    self._interrupted(signum)

    def _interrupted(self, signum: int) -> None:
        """SIGINT with Python's own handler: the script's KeyboardInterrupt gets a second to end it
        (only a main thread that is not blocked in a collective raises it)."""
        if not self._concluded.wait(_SIGINT_GRACE_S):
            self._signalled(signum)

    def _signalled(self, signum: int) -> None:
        """A signal ends this rank: record it, wait a moment for the peers (torchrun signals them all),
        report if this rank is the last one, exit with 128 + signum."""
        end = self._mark_end(End("signal", 128 + signum, signal.Signals(signum).name))
        self._conclude(alive_s=_SHORT_WAIT_S, then_report=True, unseen_s=_SHORT_WAIT_S)
        self._exit(128 + signum, end)

    # -------------------------------------------------------------------------------- the watch

    def _watch(self) -> None:
        """Every rank: a stop by another rank's watch ends this one; a one-sided wait is judged once
        this rank's own trace has been idle for a while (waiting, or ended), from every rank's trace."""
        from harness.trace.one_sided import OneSidedWatch

        watch: OneSidedWatch | None = None
        broken = False
        heartbeat = time.monotonic()
        own, waiting_since = _OwnTrace(self.files.trace(self.rank)), None
        while True:
            time.sleep(_POLL_S)
            now = time.monotonic()
            stop = read_json(self.files.stop_file)
            if stop is not None:
                reason = f"by rank {stop.get('rank')}'s watch: {stop.get('reason')}"
                self._exit(EXIT_STOPPED, self._mark_end(End("stopped", EXIT_STOPPED, reason)))
            if now - heartbeat >= _HEARTBEAT_S:
                heartbeat = now
                self._refresh_error_file()
            if self._end is None:  # only a rank waiting in a collective reads its peers' traces
                waiting_since = (waiting_since or now) if own.waiting() else None
                if waiting_since is None or now - waiting_since < _WAITING_S:
                    continue
            if broken:
                continue
            try:
                if watch is None:
                    if len(self.files.started_ranks()) < self.world_size:
                        continue  # a trace not yet begun may still hold an earlier run's records
                    paths = {rank: str(self.files.trace(rank)) for rank in range(self.world_size)}
                    watch = OneSidedWatch(paths, truncate=False)
                states = self.files.states(self.world_size, self.host)
                finished = {rank for rank, state in states.items() if state in (ENDED, DEAD)}
                hopeless = watch.check(finished, set(range(self.world_size)) - finished)
            except Exception as error:  # noqa: BLE001 - the script runs on; its end is still reported
                broken = True
                _say(f"harness.tools.trace_script: rank {self.rank} stops watching for one-sided waits: {error!r}")
                continue
            if hopeless:
                self._stop(hopeless)

    def _stop(self, reason: str) -> None:
        """This rank's watch found a wait that can never end: report it, tell the other ranks, exit 3."""
        end = self._mark_end(End("stopped", EXIT_STOPPED, reason))
        with self._report_lock:
            if self.files.claim(self.rank):
                # The report first: the others exit when they read the stop, and torchrun then
                # SIGTERMs this rank, which must not cut the report short.
                self._report(f"stopped: {reason} (seen by rank {self.rank})")
                write_json(self.files.stop_file, {"rank": self.rank, "reason": reason})
        self._exit(EXIT_STOPPED, end)

    # -------------------------------------------------------------------------------- torchrun's error file

    def _write_error_file(self, message: str) -> None:
        """This rank's line in torchrun's failure summary (TORCHELASTIC_ERROR_FILE): written at the
        start for a rank that dies, replaced by how it ended, removed when it succeeded. A file the
        script wrote itself (torchelastic's @record) is left alone."""
        if self._error_file is None:
            return
        self._error_message = message
        with contextlib.suppress(OSError):
            now = str(int(time.time()))  # torchelastic's own format (its @record writes it)
            extra = {"py_callstack": message, "timestamp": now}
            write_json(Path(self._error_file), {"message": {"message": message, "extraInfo": extra}, "harness": 1})

    def _error_file_is_ours(self) -> bool:
        return self._error_file is not None and (read_json(Path(self._error_file)) or {}).get("harness") == 1

    def _refresh_error_file(self) -> None:
        """The time in it is when this rank was last seen alive: torchrun names the earliest failure first."""
        if self._error_file_is_ours():
            self._write_error_file(self._error_message)

    def _end_error_file(self, end: End, code: int) -> None:
        if not self._error_file_is_ours():
            return
        if code == 0:
            with contextlib.suppress(OSError):
                os.unlink(str(self._error_file))
            return
        where = f"the collective diff: {self.directory / 'diff.txt'}, or python -m harness.tools.trace_script"
        self._write_error_file(
            f"harness.tools.trace_script: rank {self.rank} {end.describe()}; {where} --diff {self.directory}"
        )


def _read_by_hand(directory: Path) -> None:
    """`--diff` showed the last run: if it was never reported (its ranks are gone), the next run in
    DIR need not print it again."""
    run = latest_run(directory)
    if run is not None:
        files, host = RunFiles(directory, run), this_host()
        with contextlib.suppress(OSError):
            if all(files.state(rank, host) != ALIVE for rank in files.started_ranks()):
                files.claim(-1)


def _end_of(error: BaseException) -> End:
    if isinstance(error, SystemExit):
        code = error.code
        if code is None or code == 0:
            return End("returned", 0)
        return End("exited", code if isinstance(code, int) else 1, str(code))
    text = f"{type(error).__name__}: {error}".strip().splitlines()[0][:300]
    return End("raised", 1, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.tools.trace_script", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--trace-dir", default="collective-traces", help="where every rank writes its trace")
    parser.add_argument("--diff", metavar="DIR", help="only diff the last run's traces in DIR and exit")
    parser.add_argument("script", nargs="?", help="the training script, run as __main__ on every rank")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    if options.diff:
        print(diff_directory(options.diff))
        _read_by_hand(Path(options.diff))
        return 0
    if not options.script:
        parser.error("give the script to run (under torchrun), or --diff DIR")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        parser.error("run under torchrun (RANK and WORLD_SIZE are not set), e.g. torchrun --nproc-per-node 2 -m ...")
    side = _RankSide(Path(options.trace_dir), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    side.start()
    sys.argv = [options.script, *options.script_args]
    sys.path[0] = os.path.dirname(os.path.abspath(options.script))  # as `python train.py` would
    end, status = End("returned", 0), 0
    try:
        runpy.run_path(options.script, run_name="__main__")
    except BaseException as error:  # noqa: BLE001 - the rank leaves as the interpreter would (below)
        end, status = _end_of(error), _leaving_status(error)
    # The script's leaving (its traceback or exit message, above, then its atexit handlers and its
    # output) comes before this rank's end is recorded: once it is, a peer may report and exit, and
    # torchrun then stops this rank with SIGTERM, which would lose what the script still had to say.
    _run_exit_handlers()
    side.finish(end)
    return status or (EXIT_DRIFT if _drift_found else 0)


_PROCESS_EXIT = os._exit
"""os._exit as this module found it, before a rank side wraps it for the script."""


def _leaving_status(error: BaseException) -> int:
    """The status the interpreter gives a script that ended by `error`, having printed what it prints:
    a SystemExit's non-int code, else the traceback (KeyboardInterrupt: 130)."""
    if isinstance(error, SystemExit):
        if error.code is not None and not isinstance(error.code, int):
            print(error.code, file=sys.stderr)
        return _end_of(error).code
    sys.excepthook(type(error), error, error.__traceback__)
    return 130 if isinstance(error, KeyboardInterrupt) else 1


def _run_exit_handlers() -> None:
    """The script's atexit handlers (a logger's flush, an experiment tracker's end), once, then its
    buffered output."""
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    _flush_streams()


def run_and_leave(argv: list[str] | None = None) -> NoReturn:
    """`main`, then leave as the interpreter would (the script's traceback, its atexit handlers,
    flushed output, its exit status), but without the interpreter's finalization: gloo's worker
    thread may release a finished collective's work, and its tensors' Python objects, while the
    interpreter is being torn down, when a process group something still references outlived
    destroy_process_group(); the process then aborts ("terminate called without an active
    exception", SIGABRT) after the script ended well and its report was written, and torchrun
    fails a correct run (pytorch/pytorch#179291 describes it; 1 run in a CI's hundreds here)."""
    try:
        status = main(argv)  # the script's own end is handled there (its status, traceback, atexit)
    except BaseException as error:  # noqa: BLE001 - this module's (argparse's exit, a second ^C): as the interpreter would
        status = _leaving_status(error)
    _run_exit_handlers()  # none left if the script ran
    _PROCESS_EXIT(status)  # the real one: the script's os._exit is this rank's wrapper (_RankSide)


if __name__ == "__main__":
    run_and_leave()
