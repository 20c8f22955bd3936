"""Inner pytest sessions without an interpreter start each: a fork server for self-tests.

Self-tests of a pytest plugin run whole pytest sessions in subprocesses (`python -m pytest ...`).
Here most of such a start is importing torch (~2 s of CPU on the 2-core CI machine), paid again
by every inner session. `WarmPytest` starts one server process that imports torch (and pytest)
once; each `run` forks it, and the child becomes what `python -m pytest <args>` in `cwd` with
`env` would have been: its own process (pid, exit status, signals), fds 0-2 on /dev/null and the
caller's pipes, its working directory, environment, `sys.path` and `sys.argv`, atexit handlers
run at its end. Only imports differ: torch and pytest are already loaded (torch imported in the
caller's environment with the session's PYTHON* variables, and one OpenMP thread; each session
then gets the intra-op thread count its OMP_NUM_THREADS or the usable CPUs give), and their
objects are out of the garbage collector's reach (`gc.freeze`, so that sessions never copy them).
Nothing that pytest would rewrite (plugins, conftests, test modules) is preloaded, so assertion
rewriting and its warnings are those of a fresh process.

Semantics follow `subprocess.run(..., capture_output=True, text=True, timeout=...)`: the output is
read until every holder of the pipes has closed them, a timeout kills the session and raises
`subprocess.TimeoutExpired`, and so does an interrupt of the caller (the session is killed first).
Where the fork server cannot serve a request faithfully (its interpreter would need another
start-up configuration: different `PYTHON*` variables or executable; it has threads; it died),
`run` falls back to a real subprocess, so results never depend on the server.

The server is Linux/POSIX only (fork, SCM_RIGHTS); it dies with its client (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import atexit
import os
import pickle
import selectors
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

# What the server imports before it forks anything: what every inner session of this project
# imports and what costs most. Never a pytest plugin, conftest or test module (see above).
PRELOAD = ("torch", "torch.distributed", "pytest")

_MESSAGE_LIMIT = 1 << 20

# The server runs this file without importing the project's packages (`harness`, `tests`): a package
# imported before pytest starts could not be assertion-rewritten in the sessions
# (PytestAssertRewriteWarning).
_BOOTSTRAP = (
    "import sys; path = sys.argv[1]; "
    "exec(compile(open(path).read(), path, 'exec'), {'__name__': '__main__', '__file__': path})"
)


@dataclass(frozen=True)
class _Request:
    args: list[str]
    cwd: str
    env: dict[str, str]

    # Sent as a plain tuple: unpickling this class would import this module's package in the server.
    def pack(self) -> bytes:
        return pickle.dumps((self.args, self.cwd, self.env))

    @classmethod
    def unpack(cls, data: bytes) -> _Request:
        return cls(*pickle.loads(data))


def _startup_config(env: dict[str, str]) -> dict[str, str]:
    """The variables an interpreter reads when it starts (a forked child cannot re-read them)."""
    return {key: value for key, value in env.items() if key.startswith("PYTHON")}


class WarmPytest:
    """The caller's side: one server, one inner session at a time."""

    def __init__(self, env: dict[str, str] | None = None, preload: tuple[str, ...] = PRELOAD) -> None:
        self.env = dict(os.environ if env is None else env)
        self.forked = 0  # sessions the server ran (the rest fell back to subprocesses)
        self.fallback_reason = ""
        client, server = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = client
        # One OpenMP thread while torch is imported: with more, importing torch starts a thread, and
        # a process with threads cannot be forked faithfully. Each session sets its own (below).
        self._process: subprocess.Popen[bytes] | None = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, __file__, str(server.fileno()), str(os.getpid()), *preload],
            pass_fds=(server.fileno(),),
            env={**self.env, "OMP_NUM_THREADS": "1"},
            stdin=subprocess.DEVNULL,
        )
        server.close()

    def run(
        self, args: list[str], *, cwd: str | os.PathLike[str], env: dict[str, str], timeout: float | None = None
    ) -> subprocess.CompletedProcess[str]:
        """`python -m pytest *args` in `cwd` with `env`, as `subprocess.run` would report it."""
        command = [sys.executable, "-m", "pytest", *args]
        reason = self._unservable(env)
        if reason:
            self.fallback_reason = reason
            return _cold_run(command, cwd, env, timeout)
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        try:
            socket.send_fds(
                self._sock, [_Request(list(args), os.fspath(cwd), dict(env)).pack()], [out_write, err_write]
            )
        except OSError as error:
            for fd in (out_read, out_write, err_read, err_write):
                os.close(fd)
            self.fallback_reason = f"the server is gone ({error})"
            self.close()
            return _cold_run(command, cwd, env, timeout)
        os.close(out_write)
        os.close(err_write)
        deadline = None if timeout is None else time.monotonic() + timeout
        pid: int | None = None
        try:
            kind, value = self._receive(deadline)
            if kind == "refused":  # it could not fork faithfully (threads): a real subprocess instead
                self.fallback_reason = str(value)
                os.close(out_read)
                os.close(err_read)
                return _cold_run(command, cwd, env, timeout)
            pid = int(value)
            stdout, stderr = _read_until_closed(out_read, err_read, deadline)
            kind, value = self._receive(deadline)
            assert kind == "exited", f"warm pytest server: expected an exit report, got {kind}"
        except BaseException as error:
            if pid is not None:
                _kill(pid)
                self._receive(time.monotonic() + 10)  # its exit report: the server may serve again
            if isinstance(error, _Timeout):
                raise subprocess.TimeoutExpired(command, timeout or 0.0, error.stdout, error.stderr) from None
            raise
        self.forked += 1
        return subprocess.CompletedProcess(command, int(value), stdout, stderr)

    def _unservable(self, env: dict[str, str]) -> str:
        if self._process is None or self._process.poll() is not None:
            return "the server is not running"
        if _startup_config(env) != _startup_config(self.env):
            return "the session's PYTHON* variables differ from the server's"
        return ""

    def _receive(self, deadline: float | None) -> tuple[str, Any]:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        self._sock.settimeout(remaining)
        try:
            data = self._sock.recv(_MESSAGE_LIMIT)
        except TimeoutError:
            raise _Timeout("", "") from None
        if not data:
            raise RuntimeError("the warm pytest server died")
        return pickle.loads(data)

    def close(self) -> None:
        self._sock.close()  # the server exits on EOF
        if self._process is not None:
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None


_SERVERS: dict[frozenset[tuple[str, str]], WarmPytest] = {}
DISABLE_VARIABLE = "HARNESS_WARM_PYTEST"  # "0": every session is a real subprocess


def run_pytest(
    command: list[str], *, cwd: str | os.PathLike[str], env: dict[str, str], timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)`
    for a ``[sys.executable, "-m", "pytest", ...]`` command, served by a warm server of this
    process (one per interpreter start-up configuration, started on first use, ended at exit).
    Any other command, or ``HARNESS_WARM_PYTEST=0`` in the caller's environment, runs as a
    real subprocess."""
    if command[:3] != [sys.executable, "-m", "pytest"] or os.environ.get(DISABLE_VARIABLE) == "0":
        return _cold_run(command, cwd, env, timeout)
    key = frozenset(_startup_config(env).items())
    server = _SERVERS.get(key)
    if server is None:
        # The caller's environment, not the session's: the server outlives the session, and
        # markers a test puts in a session's environment to find its processes must not be found
        # on the server. Only the start-up variables must be the session's.
        base = {name: value for name, value in os.environ.items() if not name.startswith("PYTHON")}
        server = _SERVERS[key] = WarmPytest({**base, **_startup_config(env)})
    return server.run(command[3:], cwd=cwd, env=env, timeout=timeout)


@atexit.register
def _close_servers() -> None:
    for server in _SERVERS.values():
        server.close()
    _SERVERS.clear()


def _cold_run(
    command: list[str], cwd: str | os.PathLike[str], env: dict[str, str], timeout: float | None
) -> subprocess.CompletedProcess[str]:
    """The session as a real subprocess: what every warm run stands in for."""
    return subprocess.run(command, cwd=cwd, env=env, text=True, capture_output=True, timeout=timeout)


class _Timeout(Exception):
    def __init__(self, stdout: str, stderr: str) -> None:
        super().__init__("timed out")
        self.stdout, self.stderr = stdout, stderr


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _read_until_closed(out_fd: int, err_fd: int, deadline: float | None) -> tuple[str, str]:
    """Both pipes to EOF (every writer closed them), as `Popen.communicate` reads."""
    chunks: dict[int, list[bytes]] = {out_fd: [], err_fd: []}
    with selectors.DefaultSelector() as selector:
        for fd in chunks:
            selector.register(fd, selectors.EVENT_READ)
        try:
            while selector.get_map():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise _Timeout(*(b"".join(chunks[fd]).decode(errors="replace") for fd in (out_fd, err_fd)))
                for key, _ in selector.select(remaining):
                    data = os.read(key.fd, 65536)
                    if data:
                        chunks[key.fd].append(data)
                    else:
                        selector.unregister(key.fd)
        finally:
            os.close(out_fd)
            os.close(err_fd)
    return tuple(_text(b"".join(chunks[fd])) for fd in (out_fd, err_fd))  # type: ignore[return-value]


def _text(data: bytes) -> str:
    """As `subprocess.run(text=True)` decodes: the locale's encoding, universal newlines."""
    return data.decode(errors="strict").replace("\r\n", "\n").replace("\r", "\n")


# -- the server ---------------------------------------------------------------------------------
def _serve(sock: socket.socket) -> None:
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, _MESSAGE_LIMIT, 2)
        except OSError:
            return
        if not message:
            return  # the client closed its end
        request = _Request.unpack(message)
        threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
        if threads != 1:
            for fd in fds:
                os.close(fd)
            sock.send(pickle.dumps(("refused", f"the server has {threads} threads; forking it would not be faithful")))
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            sock.close()
            _become_session(request, fds)  # never returns
        for fd in fds:
            os.close(fd)
        sock.send(pickle.dumps(("started", pid)))
        _, status = os.waitpid(pid, 0)
        sock.send(pickle.dumps(("exited", os.waitstatus_to_exitcode(status))))


def _become_session(request: _Request, fds: list[int]) -> None:
    """In the forked child: turn into `python -m pytest *args` and exit with its status."""
    code: int = 1
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        for source, target in ((devnull, 0), (fds[0], 1), (fds[1], 2)):
            os.dup2(source, target)
            os.close(source)
        os.chdir(request.cwd)
        os.environ.clear()
        os.environ.update(request.env)
        import tempfile

        tempfile.tempdir = None  # TMPDIR is the session's (a fresh process computes it on first use)
        torch = sys.modules.get("torch")
        if torch is not None:  # the intra-op threads torch would have chosen at its import here
            threads = request.env.get("OMP_NUM_THREADS", "")
            usable = _usable_cpus()  # torch caps OMP_NUM_THREADS there when it starts
            torch.set_num_threads(min(int(threads), usable) if threads.isdigit() and int(threads) > 0 else usable)
        # `python -m` puts the working directory first; the rest (PYTHONPATH, site) is the server's,
        # whose start-up configuration equals the session's (see WarmPytest._unservable).
        sys.path[0] = os.getcwd()
        import pytest

        sys.argv = [os.path.join(os.path.dirname(pytest.__file__), "__main__.py"), *request.args]
        unbuffered = bool(request.env.get("PYTHONUNBUFFERED"))
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=unbuffered or stream is sys.stderr)
        code = _exit_code(pytest.console_main)
    except SystemExit as exit_:
        code = _exit_status(exit_.code)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 - reported as an interpreter would, then the exit status
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _exit_code(main: Any) -> int:
    try:
        return _exit_status(main())
    except SystemExit as exit_:
        return _exit_status(exit_.code)


def _exit_status(value: Any) -> int:
    """What the interpreter makes of `raise SystemExit(value)`."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    sys.stderr.write(f"{value}\n")
    return 1


def main() -> None:
    """The server: ``python -c _BOOTSTRAP <this file> <socket fd> <client pid> <module>...``."""
    sock = socket.socket(fileno=int(sys.argv[2]))
    parent = int(sys.argv[3])
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the client
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        return  # the client died before the death signal was armed
    import importlib

    for module in sys.argv[4:]:
        importlib.import_module(module)
    # Sessions share this heap copy-on-write; frozen, their collections never traverse (and so
    # never write to and copy) it. `harness.rank.zygote` does the same for rank workers.
    import gc

    gc.collect()
    gc.freeze()
    _serve(sock)


if __name__ == "__main__":
    main()
