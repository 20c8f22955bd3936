"""Finding and ending the processes a test started (Linux /proc; elsewhere these find nothing).

Two ways to find them, for two situations:
  * while a rank lives: its descendants. The rank is a child subreaper (`become_subreaper`), so a
    descendant whose own parent exited (a daemon that double-forked, a child started with
    `start_new_session`) is re-parented to the rank instead of init, and stays in the rank's tree
    (`descendants`).
  * once a rank is gone (killed, crashed, or the whole pytest process died): its descendants were
    re-parented to init, so the tree no longer leads to them. Every worker is started with a marker
    in its environment (`PROCESS_ENV`, and the session's `SESSION_ENV`), which its descendants
    inherit; `marked_processes` scans /proc for it. A descendant started with an explicitly empty
    environment is found only while the rank lives.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Iterable

SESSION_ENV = "FSDP_HARNESS_SESSION"
"""Set in every worker of a pytest session: `<session tag>`."""
PROCESS_ENV = "FSDP_HARNESS_PROCESS"
"""Set in every worker: `<session tag>.<serial>`, one value per worker process."""

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphaned descendants of this process are re-parented to it (Linux >= 3.4); False elsewhere."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def children(pid: int) -> list[int]:
    """Direct children of `pid` (every thread's), from /proc/<pid>/task/*/children."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as handle:
                found.extend(int(child) for child in handle.read().split())
        except OSError:
            continue
    return found


def descendants(pid: int) -> list[int]:
    """Every process below `pid` in the process tree, parents before their children."""
    found: list[int] = []
    pending = children(pid)
    while pending:
        child = pending.pop(0)
        if child in found:
            continue
        found.append(child)
        pending.extend(children(child))
    return found


def command_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as handle:
            return handle.read().strip()
    except OSError:
        return "?"


def processes_holding_files_in(directory: str, exclude: Iterable[int] = ()) -> list[int]:
    """PIDs with an fd open on a file in `directory` (a rank's descendant that was forked, not
    exec'd, holds the rank's output files: its environment is its ancestor's at exec, which for a
    zygote forked from pytest carries no marker)."""
    prefix = os.path.join(os.path.realpath(directory), "")
    found = []
    for pid in _other_processes(exclude):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # gone, or not ours to read
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(prefix):
                found.append(pid)
                break
    return found


def marked_processes(markers: Iterable[str], exclude: Iterable[int] = ()) -> list[int]:
    """PIDs whose environment holds any of `markers` (each `NAME=value`, matched whole)."""
    needles = [b"\0" + marker.encode() + b"\0" for marker in markers]
    if not needles:
        return []
    found = []
    for pid in _other_processes(exclude):
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                environ = b"\0" + handle.read() + b"\0"
        except OSError:
            continue  # gone, or not ours to read
        if any(needle in environ for needle in needles):
            found.append(pid)
    return found


def _other_processes(exclude: Iterable[int]) -> list[int]:
    """Every PID in /proc but this process and `exclude` (empty where /proc cannot be read)."""
    skip = {os.getpid(), *exclude}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    return [int(entry) for entry in entries if entry.isdigit() and int(entry) not in skip]


def kill(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def reap_children(timeout_s: float = 2.0, wait_for: Iterable[int] = ()) -> list[int]:
    """Reap this process's exited children (orphans re-parented to a subreaper included) and wait
    until every PID in `wait_for` is gone from /proc; return those still running (not exiting)
    after `timeout_s`: processes SIGKILL did not end, which the caller cannot vouch for.

    Gone means gone: a killed child is not done with when it stops running but when it is reaped,
    since until then its PID stays in /proc as a zombie, and the next test (or a check that no
    process a test started outlived it) sees it. Each round therefore reaps first and looks second:
    a child that turns into a zombie between the two is reaped in the next round, never left.
    A process already exiting at `timeout_s` (SIGKILL first unmaps its memory, which a loaded
    machine makes slow) is waited for up to `_EXITING_GRACE_S` longer, as is a zombie whose parent
    is still being ended (it is re-parented here, then reaped).
    """
    waiting = set(wait_for)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            while (pid := os.waitpid(-1, os.WNOHANG)[0]) > 0:
                waiting.discard(pid)
        except ChildProcessError:
            return []  # no children left at all: nothing killed here is waiting to be reaped
        waiting = {pid for pid in waiting if _in_proc(pid)}
        if not waiting:
            return []
        now = time.monotonic()
        if now >= deadline:
            running = sorted(pid for pid in waiting if _alive(pid) and not _exiting(pid))
            if running or now >= deadline + _EXITING_GRACE_S:
                return running
        time.sleep(0.005)


_EXITING_GRACE_S = 10.0
"""How long past its timeout `reap_children` waits for processes already exiting to be gone."""


def _in_proc(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


_PF_EXITING = 0x4  # include/linux/sched.h: the process has begun to exit


def _alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    state = _stat(pid)
    return state is not None and state[0] not in ("Z", "X")


def _exiting(pid: int) -> bool:
    """Whether `pid` has begun to exit (nothing can bring it back): a process sent SIGKILL is not
    gone at once, its exit first unmaps its memory (a rank's fork shares hundreds of megabytes of
    a CUDA torch build's mappings), and until then /proc shows it running, PF_EXITING set."""
    state = _stat(pid)
    return state is not None and bool(state[1] & _PF_EXITING)


def _stat(pid: int) -> tuple[str, int] | None:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return state_and_flags(handle.read())
    except OSError:
        return None


def state_and_flags(stat: str) -> tuple[str, int] | None:
    """The state letter and the kernel flags word of one /proc/<pid>/stat line (the command name
    may hold spaces and ')'), or None if the line cannot be read."""
    fields = stat.rpartition(")")[2].split()
    try:
        return fields[0], int(fields[6])
    except (IndexError, ValueError):
        return None


def end_descendants() -> tuple[list[str], list[int]]:
    """SIGKILL every descendant of this process and reap them.

    Returns a description of each (`pid (command)`) and the PIDs still alive 2 s later (a process
    in uninterruptible sleep), which the caller cannot vouch for.
    """
    found = descendants(os.getpid())
    described = [f"{pid} ({command_name(pid)})" for pid in found]
    kill(found)
    survivors = reap_children(wait_for=found) if found else reap_children(timeout_s=0.0)
    return described, survivors
