"""A warm pool of N rank processes: spawn, dispatch one test, wait with deadlines, kill cleanly.

The pool owns process lifetimes and nothing else: it knows nothing about pytest. Each rank runs
`python -m harness.worker` in its own session, so killing its process group removes what the
rank started there; descendants that left the group are found through the rank's process tree
and its environment marker (`harness.processes`). The parent hosts the rendezvous store on an
OS-assigned loopback port, so concurrent sessions on one machine never collide.

Workers come from a `WorkerLauncher`: a worker imports torch before it is told which rank it is,
so after a restart the launcher's spares (started in the background while the next tests run)
make a new pool cost a rendezvous instead of N interpreter starts and torch imports.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch.distributed as dist

from harness import processes
from harness.devices import DeviceKind, GpuReservation
from harness.messages import RankLoss, RankResult, Shutdown, TestTask, WorkerConfig, WorkerReady
from harness.paths import RankFiles
from harness.text import describe_exception, read_tail

SESSION_ENV = processes.SESSION_ENV
_HARNESS_ROOT = str(Path(__file__).resolve().parent.parent)
_POLL_S = 0.1  # how often exit status is polled where the kernel gives no pidfd to wait on


@dataclass(frozen=True)
class PoolKey:
    world_size: int
    device_kind: DeviceKind
    collective_timeout_s: float


class PoolStartError(RuntimeError):
    pass


def tail(path: str, limit: int = 4000) -> str:
    return read_tail(path, limit)


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "closed its pipe to the parent but kept running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} ({-returncode})"
    return f"exited with code {returncode} while running the test"


class WorkerProcess:
    """One `python -m harness.worker` process and its pipes, from spawn to kill."""

    def __init__(
        self, serial: int, popen: subprocess.Popen[bytes], to_worker: Connection, from_worker: Connection, log: str
    ) -> None:
        self.serial = serial
        self.popen = popen
        self.to_worker = to_worker
        self.from_worker = from_worker
        self.log = log
        """stdout and stderr until the worker is configured (import errors, start-up crashes)."""
        # A pidfd becomes readable when the process exits: death is seen from the process itself,
        # whoever else holds its result pipe open (a forked child of the test).
        self.pidfd: int | None = None
        with contextlib.suppress(AttributeError, OSError):
            self.pidfd = os.pidfd_open(popen.pid)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exited(self) -> bool:
        return self.popen.poll() is not None

    def exit_code(self, timeout_s: float = 5.0) -> int | None:
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        # The worker leads its own session and process group (start_new_session), so one killpg
        # ends what the test started in it; descendants in other sessions are found through the
        # process tree while the worker is still there to lead to them.
        strays = processes.descendants(self.popen.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        processes.kill(strays)
        self.popen.wait()  # reaped: no zombie stays
        self.to_worker.close()
        self.from_worker.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class WorkerLauncher:
    """Starts worker processes for the pools of one session and keeps spares for restarts.

    A spare has imported torch and waits for its `WorkerConfig`; `launch` hands out a live spare
    before it spawns. Spares are made only on request (`keep_spares`, after a pool was discarded):
    a session whose tests all pass never pays for them.
    """

    def __init__(self, directory: str, session_tag: str, on_spawn: Callable[[int], None] | None = None) -> None:
        self.directory = directory
        self.session_tag = session_tag
        self._on_spawn = on_spawn
        self._serial = 0
        self._spares: list[WorkerProcess] = []
        self.spawned = 0

    def launch(self) -> WorkerProcess:
        while self._spares:
            worker = self._spares.pop(0)
            if not worker.exited():
                return worker
            worker.kill()  # a spare that died while waiting (killed from outside): not usable
        return self._spawn()

    def keep_spares(self, count: int) -> None:
        """Start spares until `count` wait (returns at once: they import torch in the background)."""
        for worker in [w for w in self._spares if w.exited()]:
            self._spares.remove(worker)
            worker.kill()
        while len(self._spares) < count:
            self._spares.append(self._spawn())

    @property
    def spares(self) -> int:
        return len(self._spares)

    def close(self) -> None:
        for worker in self._spares:
            with contextlib.suppress(OSError):
                worker.to_worker.send(Shutdown())
            worker.kill()
        self._spares.clear()

    def _spawn(self) -> WorkerProcess:
        serial = self._serial
        self._serial += 1
        self.spawned += 1
        os.makedirs(self.directory, exist_ok=True)
        log = os.path.join(self.directory, f"worker-{serial}.log")
        parent_to_child = os.pipe()
        child_to_parent = os.pipe()
        env = dict(os.environ)
        env[processes.SESSION_ENV] = self.session_tag
        env[processes.PROCESS_ENV] = f"{self.session_tag}.{serial}"
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: N ranks must not oversubscribe the cores
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_HARNESS_ROOT, env.get("PYTHONPATH", "")) if p)
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "harness.worker",
                    str(parent_to_child[0]),
                    str(child_to_parent[1]),
                    str(os.getpid()),
                ],
                pass_fds=(parent_to_child[0], child_to_parent[1]),
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=env,
            )
        # Close our copies of the worker's ends at once: the worker must be the only holder of the
        # result pipe's write end, or its death would not show as EOF.
        os.close(parent_to_child[0])
        os.close(child_to_parent[1])
        if self._on_spawn is not None:
            self._on_spawn(popen.pid)
        return WorkerProcess(
            serial,
            popen,
            Connection(parent_to_child[1], readable=False),
            Connection(child_to_parent[0], writable=False),
            log,
        )


class _RankProcess:
    def __init__(self, rank: int, worker: WorkerProcess, files: RankFiles) -> None:
        self.rank = rank
        self.worker = worker
        self.files = files

    @property
    def to_rank(self) -> Connection:
        return self.worker.to_worker

    @property
    def from_rank(self) -> Connection:
        return self.worker.from_worker

    def exit_code(self, timeout_s: float = 5.0) -> int | None:
        return self.worker.exit_code(timeout_s)

    def lost(self, cause: str, stacks: str = "") -> RankLoss:
        """A RankLoss with the exception the test raised on this rank before, if it noted one."""
        raised = ""
        with contextlib.suppress(OSError), open(self.files.raised, encoding="utf-8", errors="replace") as handle:
            raised = handle.read()
        return RankLoss(self.rank, cause, stacks, raised)

    def collect(self) -> RankResult:
        """The rank's outcome if it sent one, else how it was lost (call once it answered or exited)."""
        if self.worker.exited():
            # Dead: never block on the pipe, which a surviving child of the test may hold open
            # (a message cut short by the death would otherwise wait forever for its end).
            os.set_blocking(self.from_rank.fileno(), False)
        try:
            if self.from_rank.poll():
                result: RankResult = self.from_rank.recv()
                return result
        except (EOFError, OSError):
            pass
        return self.lost(describe_exit(self.exit_code()))


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
        self._store: dist.TCPStore | None = None
        self._gpus: GpuReservation | None = None
        self.interrupted_results: dict[int, RankResult] | None = None
        """Set when `run` was interrupted (Ctrl-C, pytest-timeout): what each rank had done by then."""

    def rank_files(self, rank: int) -> RankFiles:
        return RankFiles(self.run_dir, rank)

    @property
    def pids(self) -> list[int]:
        return [proc.worker.pid for proc in self._ranks]

    def start(self, timeout_s: float = 300.0) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        if self.key.device_kind == "cuda":
            self._gpus = GpuReservation(self.key.world_size)
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        try:
            for rank in range(self.key.world_size):
                self._ranks.append(self._spawn(rank))
            self._await_ready(timeout_s)
        except BaseException:
            self.kill()
            raise

    def _spawn(self, rank: int) -> _RankProcess:
        files = RankFiles(self.run_dir, rank)
        proc = _RankProcess(rank, self._launcher.launch(), files)
        assert self._store is not None
        proc.to_rank.send(
            WorkerConfig(
                rank=rank,
                world_size=self.key.world_size,
                local_rank=rank,
                device_kind=self.key.device_kind,
                store_host="127.0.0.1",
                store_port=self._store.port,
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
                        f"{tail(proc.worker.log)}{tail(proc.files.stderr)}"
                    ) from None
                assert isinstance(message, WorkerReady), message

    def run(self, task: TestTask, deadline_s: float, straggler_grace_s: float) -> dict[int, RankResult]:
        """Run `task` on every rank; ranks that neither answer nor die in time are reported hung.

        Once a rank has failed, the others get only `straggler_grace_s` more: a failed rank
        usually leaves its peers blocked in a collective, and waiting for the collective
        timeout would only delay the report.

        If the wait is interrupted (KeyboardInterrupt, pytest-timeout's exception), the
        exception propagates after `interrupted_results` is set: the ranks that answered, and the
        others as lost, with their Python stacks unless the interrupt was a KeyboardInterrupt
        (the user wants out at once).
        """
        # How a rank's death is noticed: the parent waits on each rank's result pipe and on the
        # process itself (its pidfd, or polling). The pipe alone is not enough: a grandchild that
        # inherited it (a test that forked) keeps it open after the rank died.
        self.interrupted_results = None
        results: dict[int, RankResult] = {}
        pending: dict[int, _RankProcess] = {}
        for proc in self._ranks:
            with contextlib.suppress(OSError):
                os.truncate(proc.files.raised, 0)
            try:
                proc.to_rank.send(task)
                pending[proc.rank] = proc
            except OSError:
                results[proc.rank] = proc.lost(describe_exit(proc.exit_code()))
        started = time.monotonic()
        deadline = started + deadline_s
        failed_at: float | None = time.monotonic() if results else None
        try:
            while pending:
                limit = deadline if failed_at is None else min(deadline, failed_at + straggler_grace_s)
                waitables: dict[object, _RankProcess] = {}
                polled = False
                for proc in pending.values():
                    waitables[proc.from_rank] = proc
                    if proc.worker.pidfd is not None:
                        waitables[proc.worker.pidfd] = proc
                    else:
                        polled = True
                timeout = max(0.0, limit - time.monotonic())
                ready = wait(list(waitables), timeout=min(timeout, _POLL_S) if polled else timeout)
                answered = {waitables[obj].rank for obj in ready}
                if polled:
                    answered |= {rank for rank, proc in pending.items() if proc.worker.exited()}
                if not answered:
                    if time.monotonic() >= limit:
                        break
                    continue
                for rank in sorted(answered):
                    result = pending.pop(rank).collect()
                    results[rank] = result
                    if failed_at is None and (isinstance(result, RankLoss) or result.status == "failed"):
                        failed_at = time.monotonic()
        except BaseException as error:
            lost = list(pending.values())
            stacks = {} if isinstance(error, KeyboardInterrupt) else self._dump_stacks(lost)
            cause = f"was still running when the pytest process stopped the test ({describe_exception(error)})"
            for proc in lost:
                results[proc.rank] = proc.lost(cause, stacks.get(proc.rank, ""))
            self.interrupted_results = dict(sorted(results.items()))
            raise
        if pending:
            stacks = self._dump_stacks(list(pending.values()))
            waited = time.monotonic() - started
            for proc in pending.values():
                if failed_at is not None and failed_at + straggler_grace_s < deadline:
                    cause = (
                        f"hung: still running {waited:.1f} s into the test, "
                        f"{straggler_grace_s:.0f} s after another rank failed"
                    )
                else:
                    cause = f"hung: no result within the {deadline_s:.0f} s test deadline"
                results[proc.rank] = proc.lost(cause, stacks.get(proc.rank, ""))
        return dict(sorted(results.items()))

    def _dump_stacks(self, procs: list[_RankProcess], wait_s: float = 2.0) -> dict[int, str]:
        """Ask hung ranks for their Python stacks (faulthandler on SIGUSR1) before they are killed."""
        for proc in procs:
            # Empty the file first: the rank holds it in append mode, so its dump starts at
            # offset 0 and a non-zero size below means this dump has begun.
            open(proc.files.stacks, "w").close()
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.worker.pid, signal.SIGUSR1)
        deadline = time.monotonic() + wait_s
        stacks: dict[int, str] = {}
        for proc in procs:
            while time.monotonic() < deadline and os.path.getsize(proc.files.stacks) == 0:
                time.sleep(0.02)
            time.sleep(0.05)  # let faulthandler finish writing every thread
            stacks[proc.rank] = tail(proc.files.stacks, 20000) or "(no stack: the rank did not answer SIGUSR1)"
        return stacks

    def close(self, timeout_s: float = 5.0) -> None:
        """Polite shutdown (ranks leave their process group), then kill whatever remains."""
        for proc in self._ranks:
            with contextlib.suppress(OSError):
                proc.to_rank.send(Shutdown())
        deadline = time.monotonic() + timeout_s
        for proc in self._ranks:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.worker.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        markers = [f"{processes.PROCESS_ENV}={self._session_tag}.{proc.worker.serial}" for proc in self._ranks]
        for proc in self._ranks:
            proc.worker.kill()
        # Descendants of ranks that had died before (re-parented to init, out of every tree).
        if markers:
            processes.kill(processes.marked_processes(markers))
        self._ranks.clear()
        self._store = None
        if self._own_launcher:
            self._launcher.close()
        if self._gpus is not None:
            self._gpus.release()
            self._gpus = None
