"""A warm pool of N rank processes: spawn, dispatch one test, wait with deadlines, kill cleanly.

The pool owns process lifetimes and nothing else: it knows nothing about pytest. Each rank runs
`python -m harness.worker` in its own session, so killing its process group removes what the
rank started there; descendants that left the group are found through the rank's process tree
and its environment marker (`harness.processes`). The ranks rendezvous through a FileStore in the
pool's private directory and get torchrun's environment (`harness.rank_env`), whose MASTER_PORT
is a TCPStore the parent hosts on an OS-assigned loopback port, so concurrent sessions on one
machine never collide.

Workers come from a `WorkerLauncher`: they are forked by the session's zygote, which imported
torch once, so a pool (re)start costs forks and a rendezvous instead of N interpreter starts and
torch imports (see `harness.zygote`). A worker is not a rank until its pool says so: the rank's
environment travels with the launch (the fork message, or the spawned process's environment).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

from harness import processes
from harness.devices import DeviceKind, GpuReservation
from harness.messages import RankLoss, RankResult, Shutdown, TestTask, WorkerConfig, WorkerReady
from harness.paths import RankFiles
from harness.rank_env import AgentStore, rank_environment, session_environment
from harness.text import describe_exception, read_tail

SESSION_ENV = processes.SESSION_ENV
_HARNESS_ROOT = str(Path(__file__).resolve().parent.parent)
_POLL_S = 0.1  # how often exit status is polled where the kernel gives no pidfd to wait on
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
    """One rank worker process and its pipes, from launch to kill (forked by the zygote or spawned)."""

    def __init__(
        self,
        serial: int,
        pid: int,
        to_worker: Connection,
        from_worker: Connection,
        log: str,
        exit_code: Callable[[float], int | None],
    ) -> None:
        self.serial = serial
        self.pid = pid
        self.to_worker = to_worker
        self.from_worker = from_worker
        self.log = log
        """stdout and stderr until the worker is configured (import errors, start-up crashes)."""
        self._exit_code = exit_code
        # A pidfd becomes readable when the process exits: death is seen from the process itself,
        # whoever else holds its result pipe open (a forked child of the test).
        self.pidfd: int | None = None
        with contextlib.suppress(AttributeError, OSError):
            self.pidfd = os.pidfd_open(pid)

    def exited(self) -> bool:
        if self.pidfd is not None:
            return bool(select.select([self.pidfd], [], [], 0)[0])
        return self._exit_code(0.0) is not None

    def exit_code(self, timeout_s: float = 5.0) -> int | None:
        """How it ended (negative: killed by that signal), or None if it still runs after `timeout_s`."""
        return self._exit_code(timeout_s)

    def kill(self) -> None:
        # The worker leads its own session and process group, so one killpg ends what the test
        # started in it; descendants in other sessions are found through the process tree while
        # the worker is still there to lead to them.
        strays = processes.descendants(self.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        processes.kill(strays)
        self.exit_code(5.0)  # reaped (by us or the zygote): no zombie stays
        self.to_worker.close()
        self.from_worker.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class ZygoteUnavailable(RuntimeError):
    pass


class _Zygote:
    """The parent's side of `harness.zygote`: fork requests out, fork and exit reports in."""

    def __init__(self, directory: str, env: dict[str, str], preload: tuple[str, ...]) -> None:
        parent_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = os.path.join(directory, "zygote.log")
        preload_spec = json.dumps({"sys_path": list(sys.path), "modules": list(preload)})
        with open(self.log, "wb") as out:
            self._popen = subprocess.Popen(
                [sys.executable, "-m", "harness.zygote", str(zygote_end.fileno()), str(os.getpid()), preload_spec],
                pass_fds=(zygote_end.fileno(),),
                start_new_session=True,  # a Ctrl-C to the terminal is for pytest alone
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=env,
            )
        zygote_end.close()
        self._sock = parent_end
        self._forked: dict[int, tuple[str, object]] = {}
        self._exits: dict[int, int] = {}
        self.pid = self._popen.pid

    def fork(self, serial: int, log: str, env: dict[str, str], fds: tuple[int, int], timeout_s: float) -> int:
        """A new worker's pid; raises ZygoteUnavailable if the zygote cannot fork one."""
        message = pickle.dumps(("fork", serial, log, env, os.getcwd()))
        try:
            socket.send_fds(self._sock, [message], list(fds))
        except OSError as error:
            raise ZygoteUnavailable(f"the zygote is gone ({error})") from None
        deadline = time.monotonic() + timeout_s
        while serial not in self._forked:
            if not self._receive(max(0.0, deadline - time.monotonic())):
                raise ZygoteUnavailable(f"the zygote did not fork within {timeout_s:.0f} s or died:\n{tail(self.log)}")
        kind, value = self._forked.pop(serial)
        if kind == "refused":
            raise ZygoteUnavailable(str(value))
        assert isinstance(value, int)
        return value

    def exit_code(self, pid: int, timeout_s: float) -> int | None:
        deadline = time.monotonic() + timeout_s
        while pid not in self._exits:
            if not self._receive(max(0.0, deadline - time.monotonic())):
                if self._popen.poll() is not None and not _process_exists(pid):
                    return -signal.SIGKILL  # the zygote died and took its workers with it (PDEATHSIG)
                return None
        return self._exits[pid]

    def _receive(self, timeout_s: float) -> bool:
        """Take one message from the zygote; False on timeout or when it is gone."""
        if not select.select([self._sock], [], [], timeout_s)[0]:
            return False
        try:
            data = self._sock.recv(1 << 16)
        except OSError:
            return False
        if not data:
            return False
        kind, key, value = pickle.loads(data)
        if kind == "exited":
            self._exits[key] = value
        else:
            self._forked[key] = (kind, value)
        return True

    def close(self) -> None:
        self._sock.close()  # the zygote exits on EOF; its workers die with it
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout=2.0)
        if self._popen.poll() is None:
            self._popen.kill()
            self._popen.wait()


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class WorkerLauncher:
    """Starts rank worker processes for the pools of one session.

    Workers are forked by the session's zygote (`harness.zygote`), which imported torch once: a
    pool restart after a fault costs forks and a rendezvous, not N interpreter starts and torch
    imports. Where the zygote cannot fork (it has threads, or it died), workers are spawned with
    `python -m harness.worker` instead, for the rest of the session.

    `preload`: modules every rank imports anyway (label providers, rank fixture modules, the
    `rank_preload_modules` ini option), which the zygote imports before its first fork so that
    each forked rank has them already.
    """

    def __init__(
        self,
        directory: str,
        session_tag: str,
        on_spawn: Callable[[int], None] | None = None,
        zygote: bool = True,
        preload: tuple[str, ...] = (),
    ) -> None:
        self.directory = directory
        self.preload = preload
        self.session_tag = session_tag
        self._on_spawn = on_spawn
        self._serial = 0
        self._use_zygote = zygote
        self._zygote: _Zygote | None = None
        self.zygote_unavailable = ""
        """Why workers are spawned instead of forked, if they are."""
        self.spawned = 0

    def launch(self, rank_env: dict[str, str] | None = None, timeout_s: float = 300.0) -> WorkerProcess:
        """A new worker whose environment is the session's updated with `rank_env`."""
        os.makedirs(self.directory, exist_ok=True)
        serial = self._serial
        self._serial += 1
        self.spawned += 1
        env = {**(rank_env or {}), processes.PROCESS_ENV: f"{self.session_tag}.{serial}"}
        if self._use_zygote:
            try:
                return self._fork(serial, env, timeout_s)
            except ZygoteUnavailable as error:
                self._use_zygote = False
                self.zygote_unavailable = str(error)
                self._close_zygote()
        return self._spawn(serial, env)

    def close(self) -> None:
        self._close_zygote()

    def _close_zygote(self) -> None:
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None

    def _environment(self) -> dict[str, str]:
        env = session_environment(os.environ)
        env[processes.SESSION_ENV] = self.session_tag
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: N ranks must not oversubscribe the cores
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_HARNESS_ROOT, env.get("PYTHONPATH", "")) if p)
        return env

    def _fork(self, serial: int, env: dict[str, str], timeout_s: float) -> WorkerProcess:
        if self._zygote is None:
            self._zygote = _Zygote(self.directory, self._environment(), self.preload)
            if self._on_spawn is not None:
                self._on_spawn(self._zygote.pid)
        zygote = self._zygote
        log = os.path.join(self.directory, f"worker-{serial}.log")
        to_child, from_child = os.pipe(), os.pipe()
        try:
            pid = zygote.fork(
                serial,
                log,
                env,
                (to_child[0], from_child[1]),
                timeout_s,
            )
        except BaseException:
            for fd in (*to_child, *from_child):
                os.close(fd)
            raise
        # Only the worker may hold its ends (see `_spawn`).
        os.close(to_child[0])
        os.close(from_child[1])
        return WorkerProcess(
            serial,
            pid,
            Connection(to_child[1], readable=False),
            Connection(from_child[0], writable=False),
            log,
            lambda timeout_s: zygote.exit_code(pid, timeout_s),
        )

    def _spawn(self, serial: int, rank_env: dict[str, str]) -> WorkerProcess:
        log = os.path.join(self.directory, f"worker-{serial}.log")
        parent_to_child = os.pipe()
        child_to_parent = os.pipe()
        env = {**self._environment(), **rank_env}
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

        def exit_code(timeout_s: float) -> int | None:
            try:
                return popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                return None

        return WorkerProcess(
            serial,
            popen.pid,
            Connection(parent_to_child[1], readable=False),
            Connection(child_to_parent[0], writable=False),
            log,
            exit_code,
        )


class _RankProcess:
    def __init__(self, rank: int, worker: WorkerProcess, files: RankFiles) -> None:
        self.rank = rank
        self.worker = worker
        self.files = files
        self.dispatched_at: float | None = None
        """When the current task was sent (time.monotonic); a lost rank's duration counts from it."""

    @property
    def to_rank(self) -> Connection:
        return self.worker.to_worker

    @property
    def from_rank(self) -> Connection:
        return self.worker.from_worker

    def exit_code(self, timeout_s: float = 5.0) -> int | None:
        return self.worker.exit_code(timeout_s)

    def lost(self, cause: str, stacks: str = "") -> RankLoss:
        """A RankLoss with the exception the test raised on this rank before, if it noted one, and how
        long the rank had been running the test when it was found lost (dead, or about to be killed)."""
        raised = ""
        with contextlib.suppress(OSError), open(self.files.raised, encoding="utf-8", errors="replace") as handle:
            raised = handle.read()
        duration_s = 0.0 if self.dispatched_at is None else time.monotonic() - self.dispatched_at
        return RankLoss(self.rank, cause, stacks, raised, duration_s)

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
        self._agent_store: AgentStore | None = None
        self._gpus: GpuReservation | None = None
        self.interrupted_results: dict[int, RankResult] | None = None
        """Set when `run` was interrupted (Ctrl-C, pytest-timeout): what each rank had done by then."""

    @property
    def agent_store_failure(self) -> str | None:
        """Why this pool's MASTER_ADDR:MASTER_PORT store could not be built, or None."""
        return self._agent_store.failure if self._agent_store is not None else None

    def rank_files(self, rank: int) -> RankFiles:
        return RankFiles(self.run_dir, rank)

    @property
    def pids(self) -> list[int]:
        return [proc.worker.pid for proc in self._ranks]

    @property
    def launcher(self) -> WorkerLauncher:
        return self._launcher

    def start(self, timeout_s: float = 300.0) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        if self.key.device_kind == "cuda":
            try:
                self._gpus = GpuReservation(self.key.world_size)
            except RuntimeError as error:
                raise PoolStartError(str(error)) from None
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
                        f"{tail(proc.worker.log)}{tail(proc.files.stderr)}"
                    ) from None
                assert isinstance(message, WorkerReady), message

    def run(
        self,
        task: TestTask,
        deadline_s: float,
        straggler_grace_s: float,
        hopeless: Callable[[set[int], set[int]], str | None] | None = None,
    ) -> dict[int, RankResult]:
        """Run `task` on every rank; ranks that neither answer nor die in time are reported hung.

        `hopeless(finished ranks, waiting ranks)`, asked every 0.25 s while ranks are pending, may
        end the wait early with the reason the waiting ranks can never finish (`harness.one_sided`).

        Once a rank has failed, the others get only `straggler_grace_s` more: a failed rank
        usually leaves its peers blocked in a collective, and waiting for the collective
        timeout would only delay the report.

        If the wait is interrupted (KeyboardInterrupt or SessionTerminated for Ctrl-C and SIGTERM,
        pytest-timeout's exception), the exception propagates after `interrupted_results` is set:
        the ranks that answered, and the others as lost, with their Python stacks (when a CI job
        is cancelled because it hung, those stacks are the evidence; a signal gets a shorter wait
        for them, so the session still stops in about a second).
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
            proc.dispatched_at = time.monotonic()
            try:
                proc.to_rank.send(task)
                pending[proc.rank] = proc
            except OSError:
                results[proc.rank] = proc.lost(describe_exit(proc.exit_code()))
        started = time.monotonic()
        deadline = started + deadline_s
        failed_at: float | None = time.monotonic() if results else None
        gave_up: str | None = None
        try:
            while pending and gave_up is None:
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
                if polled or hopeless is not None:
                    timeout = min(timeout, _POLL_S if polled else 0.25)
                ready = wait(list(waitables), timeout=timeout)
                answered = {waitables[obj].rank for obj in ready}
                if polled:
                    answered |= {rank for rank, proc in pending.items() if proc.worker.exited()}
                if not answered and hopeless is not None:
                    gave_up = hopeless(set(results), set(pending))
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
            wait_s = _STACKS_WAIT_ON_SIGNAL_S if isinstance(error, KeyboardInterrupt) else _STACKS_WAIT_S
            try:
                stacks = self._dump_stacks(lost, wait_s)
            except (KeyboardInterrupt, OSError):
                # A second Ctrl-C where no signal guard holds it, or the run directory is gone:
                # the losses are still reported, without stacks.
                stacks = {}
            cause = f"was still running when the pytest process stopped the test ({describe_exception(error)})"
            for proc in lost:
                results[proc.rank] = proc.lost(cause, stacks.get(proc.rank, ""))
            self.interrupted_results = dict(sorted(results.items()))
            raise
        if pending:
            stacks = self._dump_stacks(list(pending.values()))
            waited = time.monotonic() - started
            for proc in pending.values():
                if gave_up is not None:
                    cause = f"stopped by the harness {waited:.1f} s into the test: {gave_up}"
                elif failed_at is not None and failed_at + straggler_grace_s < deadline:
                    cause = (
                        f"hung: still running {waited:.1f} s into the test, "
                        f"{straggler_grace_s:g} s after another rank failed"
                    )
                else:
                    cause = f"hung: no result within the {deadline_s:g} s test deadline"
                results[proc.rank] = proc.lost(cause, stacks.get(proc.rank, ""))
        return dict(sorted(results.items()))

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
            proc.rank: tail(proc.files.stacks, 20000) or "(no stack: the rank did not answer SIGUSR1)" for proc in procs
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
        markers = [f"{processes.PROCESS_ENV}={self._session_tag}.{proc.worker.serial}" for proc in self._ranks]
        for proc in self._ranks:
            proc.worker.kill()
        # Descendants of ranks that had died before (re-parented to init, out of every tree).
        if markers:
            processes.kill(processes.marked_processes(markers))
        self._ranks.clear()
        if self._agent_store is not None:
            self._agent_store.close()
            self._agent_store = None
        if self._own_launcher:
            self._launcher.close()
        if self._gpus is not None:
            self._gpus.release()
            self._gpus = None
