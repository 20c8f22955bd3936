"""A warm pool of N rank processes of one kind: start, dispatch one test, wait with deadlines, kill.

The pool owns the ranks' lifetimes and nothing else: it knows nothing about pytest. Its workers come
from a `harness.process.launcher.WorkerLauncher` (forked by the session's zygote, or spawned), and become
ranks here: each gets torchrun's environment (`harness.process.rank_env`), whose MASTER_PORT is a TCPStore
the parent hosts on an OS-assigned loopback port, and a `WorkerConfig` that points it at a
FileStore in the pool's private directory, so concurrent sessions on one machine never collide.

`WorkerPool.run` is one test, or one parent-side SPMD call (`harness.session.spmd`): `_dispatch`
sends the message to every rank (pickled once, the same bytes to each), `_wait` collects their
results (a failed rank leaves the others only the straggler grace; `hopeless` may end the wait
early), and the ranks that never answered are classified (`_Progress.unfinished_cause`) and lost
with their Python stacks. Its hot path opens, truncates and imports nothing: a rank's raised file
is emptied only before the message that follows a failure of that rank.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from harness.message_text import describe_exception, read_tail
from harness.messages import (
    DeviceKind,
    RankLoss,
    RankResult,
    Shutdown,
    SpmdCall,
    TestTask,
    WorkerConfig,
    WorkerReady,
    encoded,
)
from harness.process import procfs
from harness.process.gpu_locks import GpuReservation
from harness.process.launcher import LOG_TAIL_BYTES, WorkerLauncher, WorkerProcess, describe_exit
from harness.process.rank_env import AgentStore, rank_environment
from harness.process.rank_files import RankFiles

_POLL_S = 0.1  # how often exit status is polled where the kernel gives no pidfd to wait on
_HOPELESS_POLL_S = 0.25  # how often `hopeless` is asked while ranks are pending
# How a hung rank's stacks are quoted (the tail of faulthandler's dump of every thread).
_STACKS_TAIL_BYTES = 20000
# How long a hung rank gets to answer SIGUSR1 with its stacks. A rank answers in milliseconds
# (faulthandler writes from its C signal handler, whatever Python is doing); the bound only
# matters for one that cannot. On Ctrl-C / SIGTERM it is shorter: the session must stop in
# seconds, and CI's cancellation grace (often 10 s before SIGKILL) must cover the whole clean-up.
_STACKS_WAIT_S = 2.0
_STACKS_WAIT_ON_SIGNAL_S = 1.0


@dataclass(frozen=True)
class PoolKey:
    world_size: int
    device_kind: DeviceKind
    collective_timeout_s: float


class PoolStartError(RuntimeError):
    pass


class _RankProcess:
    def __init__(self, rank: int, worker: WorkerProcess, files: RankFiles) -> None:
        self.rank = rank
        self.worker = worker
        self.files = files
        self.dispatched_at: float | None = None
        """When the current task was sent (time.monotonic); a lost rank's duration counts from it."""
        self.may_have_raised = False
        self.work = "test"
        """What the rank is running ("test", or "SPMD call"): how its loss is told."""
        """Whether the rank's raised file may hold an earlier failure (its last result failed): it
        is emptied before the next message, so that a later loss is never told with a stale cause."""

    @property
    def to_rank(self) -> Connection:
        return self.worker.to_worker

    @property
    def from_rank(self) -> Connection:
        return self.worker.from_worker

    def exit_code(self, timeout_s: float = 5.0) -> int | None:
        return self.worker.exit_code(timeout_s)

    def lost(self, cause: str, stacks: str = "", after_peer_failed: bool = False) -> RankLoss:
        """A RankLoss with the exception the test raised on this rank before, if it noted one, and how
        long the rank had been running the test when it was found lost (dead, or about to be killed)."""
        raised = ""
        with contextlib.suppress(OSError), open(self.files.raised, encoding="utf-8", errors="replace") as handle:
            raised = handle.read()
        duration_s = 0.0 if self.dispatched_at is None else time.monotonic() - self.dispatched_at
        return RankLoss(self.rank, cause, stacks, raised, duration_s, after_peer_failed)

    def collect(self) -> RankResult:
        """The rank's outcome if it sent one, else how it was lost (call once it answered or exited:
        a live rank's pipe is then readable, so only a dead rank's is polled first)."""
        dead = self.worker.exited()
        if dead:
            # Dead: never block on the pipe. See [Note: a rank's death] in harness.process.launcher.
            os.set_blocking(self.from_rank.fileno(), False)
        try:
            if not dead or self.from_rank.poll():
                result: RankResult = self.from_rank.recv()
                return result
        except (EOFError, OSError):
            pass
        return self.lost(describe_exit(self.exit_code(), self.work))


@dataclass
class _Progress:
    """One test across the ranks while `WorkerPool.run` waits: who answered, who is pending, and the
    clocks that decide how long the pending ones get and why they are lost."""

    deadline_s: float
    straggler_grace_s: float
    started: float
    """When the task was dispatched to every rank: the pool is up by then, so its start (or a
    restart) is never charged to the test's deadline."""
    results: dict[int, RankResult]
    pending: dict[int, _RankProcess]
    failed_at: float | None = None
    """When the first rank failed or was lost: the others get `straggler_grace_s` from then."""
    gave_up: str | None = None
    """Why `hopeless` judged the pending ranks unable to finish, if it did."""
    deadline_source: str = ""
    """Who set the deadline, when not the session's `--test-timeout` (said with a hang)."""
    work: str = "test"
    """What the ranks run ("test", or "SPMD call"), as the causes of losses name it."""

    @property
    def deadline(self) -> float:
        return self.started + self.deadline_s

    def limit(self) -> float:
        """Until when the pending ranks are waited for: the test deadline, or the grace after a failure."""
        if self.failed_at is None:
            return self.deadline
        return min(self.deadline, self.failed_at + self.straggler_grace_s)

    def note(self, rank: int, result: RankResult) -> None:
        self.results[rank] = result
        if self.failed_at is None and (isinstance(result, RankLoss) or result.status == "failed"):
            self.failed_at = time.monotonic()

    def unfinished_after_peer(self) -> bool:
        """Whether the ranks still pending when the wait ended were stopped because of another rank
        (a failed peer's straggler grace ran out, or `hopeless` judged their waits unending)."""
        return self.gave_up is not None or (
            self.failed_at is not None and self.failed_at + self.straggler_grace_s < self.deadline
        )

    def unfinished_cause(self) -> str:
        """Why the ranks still pending when the wait ended are lost."""
        waited = time.monotonic() - self.started
        if self.gave_up is not None:
            return f"stopped by the harness {waited:.1f} s into the {self.work}: {self.gave_up}"
        if self.failed_at is not None and self.failed_at + self.straggler_grace_s < self.deadline:
            return (
                f"hung: still running {waited:.1f} s into the {self.work}, "
                f"{self.straggler_grace_s:g} s after another rank failed"
            )
        source = f" ({self.deadline_source})" if self.deadline_source else ""
        return f"hung: no result within the {self.deadline_s:g} s {self.work} deadline{source}"


class WorkerPool:
    """N warm ranks of one (world size, device, timeout) kind."""

    def __init__(
        self,
        key: PoolKey,
        run_dir: str,
        rank_fixture_modules: tuple[str, ...],
        session_tag: str,
        label_providers: tuple[str, ...] = (),
        launcher: WorkerLauncher | None = None,
    ) -> None:
        self.key = key
        self.run_dir = run_dir
        self._rank_fixture_modules = rank_fixture_modules
        self._label_providers = label_providers
        self._session_tag = session_tag
        self._own_launcher = launcher is None
        self._launcher = launcher or WorkerLauncher(run_dir, session_tag)
        self._ranks: list[_RankProcess] = []
        self._agent_store: AgentStore | None = None
        self._gpus: GpuReservation | None = None
        self.interrupted_results: dict[int, RankResult] | None = None
        """Set when `run` was interrupted (Ctrl-C, SIGTERM): what each rank had done by then."""
        # Where the ranks' Flight Recorder dumps go (torch appends the rank): the user's choice, else
        # the pool's own directory, so that a dump is never another session's.
        self.flight_recorder_prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.path.join(
            run_dir, "flight-recorder", "rank_"
        )

    @property
    def agent_store_failure(self) -> str | None:
        """Why this pool's MASTER_ADDR:MASTER_PORT store could not be built, or None."""
        return self._agent_store.failure if self._agent_store is not None else None

    def rank_files(self, rank: int) -> RankFiles:
        return RankFiles(self.run_dir, rank)

    def flight_recorder_dumps(self, since: float) -> list[str]:
        """The Flight Recorder dumps this pool's ranks wrote since `since` (`time.time()`): NCCL's
        watchdog writes one per rank when a collective times out (`TORCH_NCCL_DUMP_ON_TIMEOUT`)."""
        found = []
        for rank in range(self.key.world_size):
            for path in (f"{self.flight_recorder_prefix}{rank}", f"{self.flight_recorder_prefix}{rank}.json"):
                try:
                    if os.path.getmtime(path) >= since:
                        found.append(path)
                except OSError:
                    continue
        return found

    @property
    def pids(self) -> list[int]:
        return [proc.worker.pid for proc in self._ranks]

    @property
    def launcher(self) -> WorkerLauncher:
        return self._launcher

    def start(self, timeout_s: float = 300.0) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        os.makedirs(os.path.dirname(self.flight_recorder_prefix) or ".", exist_ok=True)
        if self.key.device_kind == "cuda":
            try:
                self._gpus = GpuReservation(self.key.world_size)
            except RuntimeError as error:
                raise PoolStartError(str(error)) from None
        # The zygote first: the store's threads would make forking pytest for it unsafe.
        self._launcher.start_zygote()
        self._agent_store = AgentStore()
        try:
            for rank in range(self.key.world_size):
                self._ranks.append(self._spawn(rank))
            self._await_ready(timeout_s)
        except BaseException:
            self.kill()
            raise

    def _spawn(self, rank: int) -> _RankProcess:
        files = RankFiles(self.run_dir, rank)
        assert self._agent_store is not None
        full = rank_environment(
            os.environ,
            rank=rank,
            world_size=self.key.world_size,
            master_port=self._agent_store.port,
            cuda_devices=self._gpus.names if self._gpus is not None else None,
            flight_recorder_prefix=self.flight_recorder_prefix,
        )
        # Only what differs from the session's environment travels: the zygote and spawned
        # workers start from the session's (`session_environment` drops what a rank must not see).
        rank_env = {key: value for key, value in full.items() if os.environ.get(key) != value}
        proc = _RankProcess(rank, self._launcher.launch(rank_env), files)
        proc.to_rank.send(
            WorkerConfig(
                rank=rank,
                world_size=self.key.world_size,
                local_rank=rank,
                device_kind=self.key.device_kind,
                store_path=os.path.join(self.run_dir, "store"),
                collective_timeout_s=self.key.collective_timeout_s,
                run_dir=self.run_dir,
                sys_path=list(sys.path),
                rank_fixture_modules=self._rank_fixture_modules,
                label_providers=self._label_providers,
            )
        )
        return proc

    def _await_ready(self, timeout_s: float) -> None:
        waiting = {proc.from_rank: proc for proc in self._ranks}
        deadline = time.monotonic() + timeout_s
        while waiting:
            ready = wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                ranks = sorted(proc.rank for proc in waiting.values())
                raise PoolStartError(f"ranks {ranks} did not join the world within {timeout_s:.0f} s")
            for conn in ready:
                proc = waiting.pop(conn)
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    raise PoolStartError(
                        f"rank {proc.rank} {describe_exit(proc.exit_code())} during start-up:\n"
                        f"{read_tail(proc.worker.log, LOG_TAIL_BYTES)}{read_tail(proc.files.stderr, LOG_TAIL_BYTES)}"
                    ) from None
                assert isinstance(message, WorkerReady), message

    def run(
        self,
        task: TestTask | SpmdCall,
        deadline_s: float,
        straggler_grace_s: float,
        hopeless: Callable[[set[int], set[int]], str | None] | None = None,
        deadline_source: str = "",
    ) -> dict[int, RankResult]:
        """Run `task` (a test, or a parent-side SPMD call) on every rank; ranks that neither answer
        nor die in time are reported hung.

        `deadline_s` counts from the task's dispatch; `deadline_source` says who set it when not
        `--test-timeout` (e.g. "pytest-timeout --timeout 3"), in the hung ranks' cause.

        `hopeless(finished ranks, waiting ranks)`, asked every 0.25 s while ranks are pending, may
        end the wait early with the reason the waiting ranks can never finish (`harness.trace.one_sided`).

        Once a rank has failed, the others get only `straggler_grace_s` more: a failed rank
        usually leaves its peers blocked in a collective, and waiting for the collective
        timeout would only delay the report.

        If the wait is interrupted (KeyboardInterrupt or SessionTerminated for Ctrl-C and SIGTERM,
        or whatever another signal handler raises), the exception propagates after `interrupted_results` is set:
        the ranks that answered, and the others as lost, with their Python stacks (when a CI job
        is cancelled because it hung, those stacks are the evidence; a signal gets a shorter wait
        for them, so the session still stops in about a second).
        """
        self.interrupted_results = None
        progress = self._dispatch(task, deadline_s, straggler_grace_s, deadline_source)
        try:
            self._wait(progress, hopeless)
        except BaseException as error:
            self.interrupted_results = self._lose_interrupted(progress, error)
            raise
        if progress.pending:
            stacks = self._dump_stacks(list(progress.pending.values()))
            cause = progress.unfinished_cause()  # after the stacks: the time waited includes them
            after_peer = progress.unfinished_after_peer()
            for proc in progress.pending.values():
                progress.results[proc.rank] = proc.lost(cause, stacks.get(proc.rank, ""), after_peer)
        results = progress.results
        for proc in self._ranks:
            proc.may_have_raised = proc.may_have_raised or results[proc.rank].status == "failed"
        return dict(sorted(results.items()))

    def _dispatch(
        self, task: TestTask | SpmdCall, deadline_s: float, straggler_grace_s: float, deadline_source: str
    ) -> _Progress:
        """Send `task` to every rank; a rank whose pipe is already closed is lost at once."""
        results: dict[int, RankResult] = {}
        pending: dict[int, _RankProcess] = {}
        # Pickled once for all ranks (the worker's `recv` unpickles it as `send` would have sent it).
        message = encoded(task)
        work = "SPMD call" if isinstance(task, SpmdCall) else "test"
        for proc in self._ranks:
            proc.work = work
            if proc.may_have_raised:
                with contextlib.suppress(OSError):
                    os.truncate(proc.files.raised, 0)
                proc.may_have_raised = False
            proc.dispatched_at = time.monotonic()
            try:
                proc.to_rank.send_bytes(message)
                pending[proc.rank] = proc
            except OSError:
                results[proc.rank] = proc.lost(describe_exit(proc.exit_code(), work))
        started = time.monotonic()
        failed_at = started if results else None  # a rank lost at dispatch starts the straggler grace
        return _Progress(
            deadline_s,
            straggler_grace_s,
            started,
            results,
            pending,
            failed_at,
            deadline_source=deadline_source,
            work=work,
        )

    @staticmethod
    def _wait(progress: _Progress, hopeless: Callable[[set[int], set[int]], str | None] | None) -> None:
        """Collect results until every rank answered, `hopeless` gave up, or the time limit passed."""
        # Each pending rank is waited on through its result pipe and its process (pidfd, or
        # polling). See [Note: a rank's death] in harness.process.launcher. One poll object for
        # the whole wait (registering each descriptor once, unregistering a rank's as it answers):
        # `multiprocessing.connection.wait` would build a selector for every wake-up, a tenth of a
        # millisecond of a parent-side SPMD call at 4 ranks.
        poller = select.poll()
        owners: dict[int, _RankProcess] = {}
        polled = False
        for proc in progress.pending.values():
            for fd in (proc.from_rank.fileno(), proc.worker.pidfd):
                if fd is not None:
                    poller.register(fd, select.POLLIN)
                    owners[fd] = proc
            polled = polled or proc.worker.pidfd is None
        while progress.pending and progress.gave_up is None:
            limit = progress.limit()
            timeout = max(0.0, limit - time.monotonic())
            if polled or hopeless is not None:
                timeout = min(timeout, _POLL_S if polled else _HOPELESS_POLL_S)
            ready = poller.poll(math.ceil(timeout * 1000))
            answered = {owners[fd].rank for fd, _ in ready if owners[fd].rank in progress.pending}
            if polled:
                answered |= {rank for rank, proc in progress.pending.items() if proc.worker.exited()}
            if not answered and hopeless is not None:
                progress.gave_up = hopeless(set(progress.results), set(progress.pending))
            if not answered:
                if time.monotonic() >= limit:
                    return
                continue
            for rank in sorted(answered):
                proc = progress.pending.pop(rank)
                for fd in (proc.from_rank.fileno(), proc.worker.pidfd):
                    if fd is not None:
                        poller.unregister(fd)
                progress.note(rank, proc.collect())

    def _lose_interrupted(self, progress: _Progress, error: BaseException) -> dict[int, RankResult]:
        """Every rank's result when `error` interrupted the wait: the pending ones lost, with their stacks."""
        lost = list(progress.pending.values())
        wait_s = _STACKS_WAIT_ON_SIGNAL_S if isinstance(error, KeyboardInterrupt) else _STACKS_WAIT_S
        try:
            stacks = self._dump_stacks(lost, wait_s)
        except (KeyboardInterrupt, OSError):
            # A second Ctrl-C where no signal guard holds it, or the run directory is gone:
            # the losses are still reported, without stacks.
            stacks = {}
        cause = f"was still running when the pytest process stopped the {progress.work} ({describe_exception(error)})"
        for proc in lost:
            progress.results[proc.rank] = proc.lost(cause, stacks.get(proc.rank, ""))
        return dict(sorted(progress.results.items()))

    def _dump_stacks(self, procs: list[_RankProcess], wait_s: float = _STACKS_WAIT_S) -> dict[int, str]:
        """Ask hung ranks for their Python stacks (faulthandler on SIGUSR1) before they are killed."""
        for proc in procs:
            # Empty the file first: the rank holds it in append mode, so its dump starts at
            # offset 0 and a non-zero size below means this dump has begun.
            open(proc.files.stacks, "w").close()
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.worker.pid, signal.SIGUSR1)
        deadline = time.monotonic() + wait_s
        for proc in procs:
            while time.monotonic() < deadline and os.path.getsize(proc.files.stacks) == 0:
                time.sleep(0.02)
        time.sleep(0.05)  # let faulthandler finish writing every thread (once for all ranks)
        return {
            proc.rank: read_tail(proc.files.stacks, _STACKS_TAIL_BYTES) or "(no stack: the rank did not answer SIGUSR1)"
            for proc in procs
        }

    def close(self, timeout_s: float = 5.0) -> None:
        """Polite shutdown (ranks leave their process group), then kill whatever remains."""
        for proc in self._ranks:
            with contextlib.suppress(OSError):
                proc.to_rank.send(Shutdown())
        deadline = time.monotonic() + timeout_s
        for proc in self._ranks:
            proc.worker.exit_code(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        markers = [f"{procfs.PROCESS_ENV}={self._session_tag}.{proc.worker.serial}" for proc in self._ranks]
        for proc in self._ranks:
            proc.worker.kill()
        # Descendants of ranks that had died before (re-parented to init, out of every tree).
        if markers:
            procfs.kill(procfs.marked_processes(markers))
        self._ranks.clear()
        if self._agent_store is not None:
            self._agent_store.close()
            self._agent_store = None
        if self._own_launcher:
            self._launcher.close()
        if self._gpus is not None:
            self._gpus.release()
            self._gpus = None
