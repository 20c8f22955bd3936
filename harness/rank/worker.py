"""Rank worker: joins the world once, then runs the test bodies and parent-side SPMD calls the
parent sends until told to stop.

Forked by the session's zygote (`harness.rank.zygote`), or spawned by `harness.process.launcher` as
`python -m harness.rank.worker FD_IN FD_OUT PARENT_PID`, in its own session either way (so the pool can
kill it with everything it started). It has imported torch before it is told which rank it is
(`serve` waits for its `WorkerConfig`). Once configured, its stdout/stderr go to per-rank files the
parent reads after each test, so output survives even a rank that dies.

`serve` dispatches on the message's type: a `TestTask` runs in `harness.rank.runner`, an `SpmdCall`
in `harness.rank.call_runner`; a call with `isolate=True` is bracketed like a test (output reset,
process state restored), the light path only keeps the output files from growing without bound.
Outcomes are pickled once with the plain pickler and sent as bytes (`Connection.send` would build
a `ForkingPickler`, with torch's shared-memory reducers, for every message).
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import pickle
import signal
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import NoReturn

import torch.distributed as dist

from harness.message_text import describe_exception
from harness.messages import RankOutcome, Shutdown, SpmdCall, TestTask, WorkerConfig, WorkerReady
from harness.process import procfs
from harness.process.rank_files import RankFiles
from harness.rank.call_runner import CallRunner
from harness.rank.isolation import ProcessIsolation
from harness.rank.runner import TestRunner
from harness.rank.world import join_world, rank_device

_PR_SET_PDEATHSIG = 1


# Destroyed process groups a rank may keep alive (through objects of earlier tests) before it is
# replaced. Each gloo group keeps a loop thread and two worker threads: measured on 2 cores, 40 of
# them cost a rank ~5% of a core while idle, and the 127 per rank that the suite accumulated when
# nothing bounded it made the whole run ~1.6x slower. A replacement costs a fork, a rendezvous and
# the first test's imports again (seconds for DeepSpeed, whose ZeRO-3 engines leak a group each).
LEAKED_GROUP_LIMIT = 16
# How large a capture file may grow on the light path of SPMD calls (which does not reset the
# capture per call) before it is emptied: the parent reads only its tail, for a rank it lost.
LIGHT_CAPTURE_LIMIT_BYTES = 1 << 20


def die_with_parent(parent_pid: int) -> None:
    """Linux kills us when the parent dies, so a crashed pytest never leaves ranks behind."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: the pool's atexit kill is the remaining guard
    if os.getppid() != parent_pid:
        os._exit(1)


class _OutputCapture:
    """Points fds 1 and 2 at the rank's files; C-level output (gloo, NCCL) is captured too."""

    def __init__(self, files: RankFiles) -> None:
        # O_APPEND: after `reset` truncates a file, the next write lands at offset 0 instead of
        # at the old offset (which would leave a hole of NULs before each test's output).
        for fd, path in ((1, files.stdout), (2, files.stderr)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
            os.dup2(target, fd)
            os.close(target)

    @staticmethod
    def flush() -> None:
        sys.stdout.flush()
        sys.stderr.flush()

    def reset(self) -> None:
        """Start a test's output from empty files (the parent reads them whole after the test)."""
        self.flush()
        os.ftruncate(1, 0)
        os.ftruncate(2, 0)

    def bound(self) -> None:
        """Empty the files once either has grown past `LIGHT_CAPTURE_LIMIT_BYTES` (two fstat calls)."""
        if os.fstat(1).st_size > LIGHT_CAPTURE_LIMIT_BYTES or os.fstat(2).st_size > LIGHT_CAPTURE_LIMIT_BYTES:
            self.reset()


class RankWorker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.files = RankFiles(config.run_dir, config.rank)
        self.capture = _OutputCapture(self.files)
        self._stack_file = open(self.files.stacks, "a")  # noqa: SIM115 - lives as long as the process
        # After the capture: the fds it set up are what every test starts from.
        self.process_isolation = ProcessIsolation(self._stack_file)
        self.device = rank_device(config.device_kind, config.local_rank)
        self._join_world()
        self.runner = TestRunner(
            config.rank,
            config.world_size,
            config.local_rank,
            self.device,
            config.rank_fixture_modules,
            config.label_providers,
            self.files.trace,
            self.files.raised,
        )
        self.calls = CallRunner(self.runner)

    def _join_world(self) -> None:
        # A FileStore, not a TCP one: no socket, so no name lookup can slow the rendezvous
        # down (see harness.process.rank_env). The rank's torchrun variables came with its environment.
        cfg = self.config
        store = dist.FileStore(cfg.store_path, cfg.world_size)
        join_world(self.device, cfg.collective_timeout_s, store=store, rank=cfg.rank, world_size=cfg.world_size)

    def run(self, task: TestTask) -> RankOutcome:
        return self._bracketed(task.sys_path, lambda: self.runner.run(task))

    def call(self, call: SpmdCall) -> RankOutcome:
        """One parent-side SPMD call: bracketed like a test with `isolate`, else the light path."""
        sys_path = self.calls.sys_path(call)
        if call.isolate:
            return self._bracketed(sys_path, lambda: self.calls.run(call))
        if sys.path != sys_path:
            sys.path[:] = sys_path
        self.capture.bound()
        outcome = self.calls.run(call)
        self.capture.flush()
        return outcome

    def _bracketed(self, sys_path: list[str], body: Callable[[], RankOutcome]) -> RankOutcome:
        """Run `body` (a test or an isolated call) from fresh output files, then put the process's
        state back and decide whether this rank may go on."""
        if sys.path != sys_path:
            sys.path[:] = sys_path
        self.capture.reset()
        outcome = body()
        # Before the outcome leaves: the parent reads the output files once it has every outcome,
        # so notes about what the test left behind belong to this test's stderr.
        notes, replace_reason = self.process_isolation.restore()
        notes += self.runner.isolation.take_notes()
        leaked = self.runner.isolation.leaked_groups()
        if len(leaked) >= LEAKED_GROUP_LIMIT:
            notes.append(
                f"{len(leaked)} process groups that tests created and destroyed are still referenced by objects "
                f"that outlived their tests (groups {', '.join(leaked)}); the rank is replaced so that their "
                "threads do not slow later tests"
            )
            replace_reason = replace_reason or f"{len(leaked)} leaked process groups"
        for note in notes:
            sys.stderr.write(f"[harness] {note}\n")
        self.capture.flush()
        if replace_reason and not outcome.replace_reason:
            outcome.replace_reason = replace_reason
        return outcome

    def harness_error(self, error: BaseException) -> RankOutcome:
        """The outcome sent when serving a task failed outside the test (a harness bug): the test
        fails with the cause, and the rank asks to be replaced."""
        summary = f"harness error on rank {self.config.rank}: {describe_exception(error)}"
        return RankOutcome(self.config.rank, "failed", 0.0, summary, summary, replace_reason=summary)


def serve(tasks: Connection, results: Connection) -> NoReturn:
    """Wait for a config (a spare or freshly forked worker waits here, torch imported), join the
    world, then run the tasks the parent sends until it says `Shutdown`."""
    # The pipes stay out of whatever a test execs; a test that forks still inherits them (see
    # [Note: a rank's death] in harness.process.launcher).
    os.set_inheritable(tasks.fileno(), False)
    os.set_inheritable(results.fileno(), False)
    procfs.become_subreaper()
    message = tasks.recv()
    if isinstance(message, Shutdown):
        os._exit(0)
    config: WorkerConfig = message
    sys.path[:] = config.sys_path
    worker = RankWorker(config)
    results.send(WorkerReady(rank=config.rank, pid=os.getpid(), device=str(worker.device)))
    while True:
        # A parent that died closes the pipe: recv raises EOFError and the rank ends here, if
        # PR_SET_PDEATHSIG has not killed it already.
        message = tasks.recv()
        if isinstance(message, Shutdown):
            break
        try:
            outcome = worker.call(message) if type(message) is SpmdCall else worker.run(message)
        except Exception as error:  # noqa: BLE001 - a harness bug fails the test, not the whole pool silently
            outcome = worker.harness_error(error)
        results.send_bytes(pickle.dumps(outcome, pickle.HIGHEST_PROTOCOL))
    # Teardown, in this order: leave the process group while every peer is still there to
    # leave it too (the parent sent Shutdown to all ranks); flush Python's buffers into the
    # captured fds, since os._exit skips that; then leave without interpreter teardown, where
    # torch's C++ threads can abort after FSDP ran ("terminate called ..."), which would only
    # add a misleading line to the rank's stderr. The parent kills what remains after 5 s.
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    tasks = Connection(int(sys.argv[1]), writable=False)
    results = Connection(int(sys.argv[2]), readable=False)
    die_with_parent(int(sys.argv[3]))
    faulthandler.enable(all_threads=True)  # until configured: a crash shows in the worker's boot log
    serve(tasks, results)


if __name__ == "__main__":
    main()
