"""The zygote: one process per session that imports torch and the rank-side harness once, then forks
every rank worker on request, so a new rank costs a fork (tens of milliseconds) instead of an
interpreter start and a torch import (seconds, and CPU that a 2-core runner does not have when a
red suite restarts its pool after every fault).

Started by `harness.process.launcher.WorkerLauncher` as `python -m harness.rank.zygote SOCKET_FD PARENT_PID PRELOAD`
(or forked from pytest and made to run this module so, see `harness.process.zygote_fork`), where PRELOAD
is JSON: the parent's `sys.path` and the modules the zygote imports once before its first fork
(see [Note: zygote preload]). It talks to the parent over a Unix SOCK_SEQPACKET
socket, one pickled message per packet:

    parent -> zygote   ("fork", serial, log path, environment, cwd)  + 2 fds: the worker's task and result pipes
    zygote -> parent   ("forked", serial, pid) | ("refused", serial, reason) | ("exited", pid, exit code)

Why forking here is safe: the zygote never runs a test, never creates a thread (checked before
every fork: with OMP_NUM_THREADS=1, which the launcher sets unless the user chose otherwise,
importing torch starts none), never initialises CUDA or a process group. A worker forked from it
is what a freshly spawned worker is at the moment it waits for its config. If the zygote has more
than one thread, it refuses, and the launcher spawns workers itself.

Lifetimes: the zygote dies with the parent (PR_SET_PDEATHSIG) and each worker with the zygote, so
a killed pytest takes both down; the zygote reaps its workers and reports each exit code, which
the parent (not their parent) could not otherwise learn.
"""

from __future__ import annotations

import faulthandler
import functools
import gc
import importlib
import json
import os
import pickle
import select
import signal
import socket
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any, NoReturn

from harness.process import procfs
from harness.process.fork_probe import forks_are_marked_bad
from harness.rank.worker import die_with_parent, serve

MAX_PACKET = 1 << 16


def send(sock: socket.socket, message: tuple[Any, ...], fds: list[int] | None = None) -> None:
    data = pickle.dumps(message)
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


# [Note: zygote preload]
# What the zygote imports once, before its first fork, so that no forked rank pays the import
# (the order is `PoolSession`'s, duplicates dropped):
#   1. the `rank_preload_modules` ini option: heavy imports most ranks make sooner or later (the
#      conformance suite lists Dynamo and inductor, ~2 s of CPU per rank otherwise);
#   2. the modules of `collective_label_providers` and 3. `rank_fixture_modules`, which every rank
#      imports before its first test anyway.
# What follows from importing them here rather than in a rank:
#   - their import-time code sees the session's environment, not a rank's (`RANK` and the like
#     are set after the fork);
#   - a module that fails to import is only written to the zygote's log: each rank imports it
#     again itself and reports the error where it belongs, in the tests that need it;
#   - a module that starts a thread or initialises CUDA makes a fork unsafe (checked before every
#     fork, `_unsafe_to_fork`): the zygote refuses, naming what it had imported, and the launcher
#     spawns workers for the rest of the session.
def _preload(spec: str) -> str:
    """Import the modules of `spec` (see [Note: zygote preload]); what was imported, for the
    message of a refusal (`_unsafe_to_fork`)."""
    wanted = json.loads(spec)
    sys.path[:] = wanted["sys_path"]
    imported = []
    for module in wanted["modules"]:
        try:
            importlib.import_module(module)
        except BaseException:  # noqa: BLE001 - any failure is the rank's to report, not the zygote's
            print(f"preloading {module} failed; each rank imports it itself:", file=sys.stderr)
            traceback.print_exc()
        else:
            imported.append(module)
    return f" (after importing {', '.join(imported)})" if imported else ""


def _unsafe_to_fork() -> str:
    """Why a fork of this process would not be what a fresh worker is, or "" if it would be."""
    threads = _threads()
    if threads != 1:
        return f"the zygote has {threads} threads"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a preloaded module initialised CUDA
        return "the zygote initialised CUDA, which a forked child cannot use"
    if _forks_marked_bad():  # a preloaded module asked the CUDA runtime
        return "a preloaded module asked the CUDA runtime, so torch marks the zygote's forks unable to use CUDA"
    return ""


@functools.cache
def _forks_marked_bad() -> bool:
    """Asked of a probe child once: the zygote runs nothing after its preload that could ask the
    CUDA runtime, so the answer holds for every fork (a probe per rank would double the forks)."""
    return forks_are_marked_bad()


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1  # no /proc: cannot tell; fork as a spawned worker would start


def _become_worker(
    sock: socket.socket, wakeup: tuple[int, int], log: str, env: dict[str, str], cwd: str, fds: list[int]
) -> NoReturn:
    """In the forked child: detach from the zygote and serve as a rank worker."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a spawned worker
    sock.close()
    for fd in wakeup:
        os.close(fd)
    os.setsid()  # its own session and process group, as a spawned worker has (see harness.process.launcher)
    zygote = os.getppid()
    die_with_parent(zygote)  # the zygote dies with pytest; the worker with the zygote
    target = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
    os.dup2(target, 1)
    os.dup2(target, 2)
    os.close(target)
    os.environ.update(env)  # seen by whatever the worker's tests exec (harness.process.procfs markers)
    os.chdir(cwd)  # where the parent is now, as a worker it spawned now would start
    _rebuild_torch_thread_pool()
    serve(Connection(fds[0], writable=False), Connection(fds[1], readable=False))


def _rebuild_torch_thread_pool() -> None:
    """torch's pthreadpool marks itself corrupted in a forked child and is rebuilt at its next use;
    two threads using it first at once (autograd's device threads start with set_num_threads, while
    the main thread runs an op) can find it half rebuilt: "pool INTERNAL ASSERT FAILED ...
    ParallelOpenMP.cpp ... Invalid thread pool!", SIGABRT in a rank (seen once on torch 2.14.1).
    Rebuilt here, while the worker has one thread."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(torch.get_num_threads())


def main() -> None:
    try:
        _serve_forks()
    except OSError:
        pass  # the parent's end is gone (it closed it, or died): the session is over
    # Without interpreter teardown: with torch loaded it takes seconds, and nothing is left to do.
    os._exit(0)


def _serve_forks() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    die_with_parent(int(sys.argv[2]))
    faulthandler.enable(all_threads=True)
    procfs.become_subreaper()  # orphans of a worker's tests come here, not to init, and are reaped
    wakeup = os.pipe()
    os.set_blocking(wakeup[1], False)
    signal.set_wakeup_fd(wakeup[1])
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # only to wake the select below
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # an interrupt is for pytest
    preloaded = _preload(sys.argv[3])
    # Every worker starts with this heap, copy-on-write. Frozen, it is never traversed by their
    # collections: a full collection writes to every object it scans, which would copy each
    # page of the shared heap into each worker (seconds of system time, and its memory).
    gc.collect()
    gc.freeze()
    while True:
        ready, _, _ = select.select([sock, wakeup[0]], [], [])
        if wakeup[0] in ready:
            os.read(wakeup[0], 4096)
        _report_exits(sock)
        if sock not in ready:
            continue
        data, fds, _, _ = socket.recv_fds(sock, MAX_PACKET, 2)
        if not data:
            return  # the parent closed its end: the session is over
        _, serial, log, env, cwd = pickle.loads(data)
        unsafe = _unsafe_to_fork()
        if unsafe:
            send(sock, ("refused", serial, f"{unsafe}{preloaded}; forking it is not safe"))
            for fd in fds:
                os.close(fd)
            continue
        pid = os.fork()
        if pid == 0:
            _become_worker(sock, wakeup, log, env, cwd, fds)
        for fd in fds:
            os.close(fd)
        send(sock, ("forked", serial, pid))


def _report_exits(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        send(sock, ("exited", pid, os.waitstatus_to_exitcode(status)))


if __name__ == "__main__":
    main()
