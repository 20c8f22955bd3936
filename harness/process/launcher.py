"""Rank worker processes for the pools of one session: launched, watched, killed.

A worker is forked by the session's zygote or, where the zygote cannot fork, spawned as
`python -m harness.rank.worker` (`WorkerLauncher` says when and why). Either way it runs in its
own session (killing its process group removes what it started there; descendants that left the
group are found through its process tree and its environment marker, `harness.process.procfs`), and
its death is read from the process, never inferred from its pipe (see [Note: a rank's death]).

A worker is not a rank until a pool says so (`harness.process.pool`): the rank's environment travels with
the launch (the fork message, or the spawned process's environment) and its `WorkerConfig` comes
over the task pipe.
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
from multiprocessing.connection import Connection
from pathlib import Path

from harness.message_text import read_tail
from harness.process import procfs, zygote_fork
from harness.process.rank_env import session_environment

_HARNESS_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding the harness package
LOG_TAIL_BYTES = 4000
"""How much of a worker's or the zygote's start-up log an error quotes."""


def describe_exit(returncode: int | None, work: str = "test") -> str:
    """How a worker ended, as the clause after "rank N" (`returncode` as `WorkerProcess.exit_code`;
    `work`: what it was running, "test" or "SPMD call")."""
    if returncode is None:
        return "closed its pipe to the parent but kept running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} ({-returncode})"
    return f"exited with code {returncode} while running the {work}"


# [Note: a rank's death]
# A worker's death is read from the process itself, never inferred from its result pipe: a test
# that forked leaves a grandchild holding the pipe's write end (inherited), so the pipe may stay
# open after the worker died. The parent therefore waits on the pipe (an answer) and on the
# process: a pidfd, readable once the process exited, or, where the kernel gives none, its exit
# status polled (`WorkerProcess.exited`; a forked worker's status comes in the zygote's exit
# report, since the zygote is its parent). Once dead, the pipe is only read without blocking: a
# message cut short by the death would otherwise wait forever for its end. The parent closes its
# own copies of the worker's pipe ends at once, so that without such a grandchild the pipe shows
# the death as EOF too.
class WorkerProcess:
    """One rank worker process and its pipes, from launch to kill (forked by the zygote or spawned);
    how its death is seen: See [Note: a rank's death]."""

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
        # Readable once the process exited. See [Note: a rank's death].
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
        strays = procfs.descendants(self.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        procfs.kill(strays)
        self.exit_code(5.0)  # reaped (by us or the zygote): no zombie stays
        self.to_worker.close()
        self.from_worker.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class ZygoteUnavailable(RuntimeError):
    pass


class _ForkedZygote:
    """The parts of `subprocess.Popen` the client uses, for a zygote forked from this process."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"zygote {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


class _ZygoteClient:
    """The parent's side of `harness.rank.zygote`: fork requests out, fork and exit reports in."""

    def __init__(self, directory: str, env: dict[str, str], preload: tuple[str, ...]) -> None:
        parent_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = os.path.join(directory, "zygote.log")
        preload_spec = json.dumps({"sys_path": list(sys.path), "modules": list(preload)})
        # Forked from this process where that gives what a cold start gives, else a new
        # interpreter. See [Note: a zygote forked from pytest] in harness.process.zygote_fork.
        self.cold_reason = zygote_fork.refusal(env)
        """Why the zygote was started cold (a new interpreter), or "" if it was forked from pytest."""
        with open(self.log, "wb") as out:
            process: subprocess.Popen[bytes] | _ForkedZygote | None = None
            if not self.cold_reason:
                try:
                    pid = zygote_fork.fork_zygote(zygote_end.fileno(), os.getpid(), preload_spec, env, out.fileno())
                    process = _ForkedZygote(pid)
                except OSError as error:  # no memory or process slot for a copy of pytest
                    self.cold_reason = f"forking pytest failed ({error})"
            if process is None:
                out.write(f"zygote: started cold, as a new interpreter: {self.cold_reason}\n".encode())
                out.flush()
                process = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "harness.rank.zygote",
                        str(zygote_end.fileno()),
                        str(os.getpid()),
                        preload_spec,
                    ],
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
        self._process = process
        self.pid = process.pid

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
                raise ZygoteUnavailable(
                    f"the zygote did not fork within {timeout_s:.0f} s or died:\n{read_tail(self.log, LOG_TAIL_BYTES)}"
                )
        kind, value = self._forked.pop(serial)
        if kind == "refused":
            raise ZygoteUnavailable(str(value))
        assert isinstance(value, int)
        return value

    def exit_code(self, pid: int, timeout_s: float) -> int | None:
        deadline = time.monotonic() + timeout_s
        while pid not in self._exits:
            if not self._receive(max(0.0, deadline - time.monotonic())):
                if self._process.poll() is not None and not _process_exists(pid):
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
            self._process.wait(timeout=2.0)
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()


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

    Workers are forked by the session's zygote (`harness.rank.zygote`), which imported torch once: a
    pool restart after a fault costs forks and a rendezvous, not N interpreter starts and torch
    imports. Where the zygote cannot fork (it has threads, or it died), workers are spawned with
    `python -m harness.rank.worker` instead, for the rest of the session.

    `preload`: the modules the zygote imports before its first fork (see [Note: zygote preload]
    in `harness.rank.zygote`).
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
        self._zygote: _ZygoteClient | None = None
        self.zygote_unavailable = ""
        """Why workers are spawned instead of forked, if they are."""
        self.spawned = 0
        self.zygote_start = ""
        """How the zygote started: "forked from pytest" or "cold: <why>" ("" before it did)."""

    def launch(self, rank_env: dict[str, str] | None = None, timeout_s: float = 300.0) -> WorkerProcess:
        """A new worker whose environment is the session's updated with `rank_env`."""
        os.makedirs(self.directory, exist_ok=True)
        serial = self._serial
        self._serial += 1
        self.spawned += 1
        env = {**(rank_env or {}), procfs.PROCESS_ENV: f"{self.session_tag}.{serial}"}
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
        env[procfs.SESSION_ENV] = self.session_tag
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: N ranks must not oversubscribe the cores
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_HARNESS_ROOT, env.get("PYTHONPATH", "")) if p)
        return env

    def start_zygote(self) -> None:
        """Start the session's zygote now if it is to fork workers and has not started: before the
        caller starts a thread, so that pytest may be forked (see harness.process.zygote_fork)."""
        if self._use_zygote and self._zygote is None:
            os.makedirs(self.directory, exist_ok=True)
            self._zygote = _ZygoteClient(self.directory, self._environment(), self.preload)
            reason = self._zygote.cold_reason
            self.zygote_start = f"cold: {reason}" if reason else "forked from pytest"
            if self._on_spawn is not None:
                self._on_spawn(self._zygote.pid)

    def _fork(self, serial: int, env: dict[str, str], timeout_s: float) -> WorkerProcess:
        self.start_zygote()
        zygote = self._zygote
        assert zygote is not None
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
        # Only the worker may hold its ends. See [Note: a rank's death].
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
                    "harness.rank.worker",
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
        # Only the worker may hold its ends. See [Note: a rank's death].
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
