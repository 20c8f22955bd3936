"""What a pytest session that died leaves behind is ended: its ranks' descendants and its run directory.

A session's ranks die with it (`PR_SET_PDEATHSIG`), but not what the ranks started: those
processes are re-parented to init. Two things clean up after a session that could not (SIGKILL,
an OOM kill, a crash):

  * its **reaper**, a small process the session starts with its first worker (in a new session,
    so a Ctrl-C to the terminal's process group leaves it alone). It reads its stdin, a pipe only
    the pytest process holds: EOF without the word "done" means pytest died, and the reaper kills
    every process carrying the session's marker in its environment (`procfs.SESSION_ENV`) or
    holding a file of its run directory open (a rank's output files, which what a rank forked
    without exec still holds), and removes the run directory;
  * the **next session** on the machine (`sweep_stale_run_dirs`): a run directory whose owner lock
    is free belongs to a dead session; its marked processes are killed and the directory removed.

The reaper runs as a script by path with `python -S -E`: it must start in milliseconds and must not
import torch (the `harness` package imports it), so it imports only the standard library and
`processes` (which does too).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import shutil
import signal
import subprocess
import sys
from typing import IO

if __package__:
    from harness.process import procfs
else:  # run as a script by path (see `Reaper.start`)
    import procfs  # type: ignore[no-redef]

RUN_DIR_PREFIX = "fsdp-harness-"
_OWNER_LOCK = ".owner.lock"


def clean_up(session_tag: str, run_dir: str) -> None:
    """Kill what a dead session's workers left running; remove its run directory."""
    marked = procfs.marked_processes([f"{procfs.SESSION_ENV}={session_tag}"])
    procfs.kill(sorted({*marked, *procfs.processes_holding_files_in(run_dir)}))
    shutil.rmtree(run_dir, ignore_errors=True)


def hold_run_dir(run_dir: str) -> IO[bytes]:
    """Mark `run_dir` as owned by this live process (an flock, released by the kernel when the
    process dies); keep the returned file open for as long as the directory is in use."""
    handle = open(os.path.join(run_dir, _OWNER_LOCK), "wb")  # noqa: SIM115 - held for the session's life
    fcntl.flock(handle, fcntl.LOCK_EX)
    return handle


def run_dir_name(session_tag: str) -> str:
    return f"{RUN_DIR_PREFIX}{session_tag}-"


def sweep_stale_run_dirs(parent: str) -> list[str]:
    """Clean up after sessions that died: run directories in `parent` whose owner lock is free."""
    swept = []
    for run_dir in glob.glob(os.path.join(parent, f"{RUN_DIR_PREFIX}*-*")):
        lock_path = os.path.join(run_dir, _OWNER_LOCK)
        try:
            handle = open(lock_path, "rb")  # noqa: SIM115 - closed below
        except OSError:
            continue  # not a run directory of this version, or another user's
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its session is alive
            session_tag = os.path.basename(run_dir)[len(RUN_DIR_PREFIX) :].split("-", 1)[0]
            clean_up(session_tag, run_dir)
            swept.append(run_dir)
    return swept


class Reaper:
    """The parent's handle on its reaper process."""

    def __init__(self, session_tag: str, run_dir: str) -> None:
        self._popen = subprocess.Popen(
            [sys.executable, "-S", "-E", os.path.abspath(__file__), session_tag, run_dir],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def finish(self, timeout_s: float = 5.0) -> None:
        """The session cleaned up itself: let the reaper go without doing anything."""
        stdin = self._popen.stdin
        if stdin is not None:
            with contextlib.suppress(OSError):
                stdin.write(b"done\n")
                stdin.close()
        try:
            self._popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._popen.kill()
            self._popen.wait()


def main() -> None:
    session_tag, run_dir = sys.argv[1], sys.argv[2]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # an interrupt is for pytest, which then says "done"
    for line in sys.stdin:
        if line.strip() == "done":
            return
    clean_up(session_tag, run_dir)  # EOF without "done": the pytest process is gone


if __name__ == "__main__":
    main()
