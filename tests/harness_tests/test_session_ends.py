"""How a session ends when it is stopped from outside: Ctrl-C, a second Ctrl-C, SIGTERM, SIGKILL.

Four inner sessions run at once (each in its own directory and TMPDIR); each has a test that
passed and one that is running (both ranks started a child process in a new session; rank 0 then
hangs in a point-to-point receive, rank 1 in Python) when the signal arrives. Checked from outside:
the exit, how long it took, the per-rank files (the finished test, and the interrupted one with
the parent's reason, each rank's stack and its own duration), no process left and no run directory.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import InnerSession, read_cases, still_running, wait_for_no_leftovers
from harness.process import procfs
from harness.process.reaper import hold_run_dir, run_dir_name, sweep_stale_run_dirs

BODY = """
import os, pathlib, subprocess, threading, time, pytest, torch, torch.distributed as dist

HERE = pathlib.Path(__file__).parent

@pytest.mark.world_size(2)
def test_1_finished(rank):
    print(f"rank {rank} finished")

@pytest.mark.world_size(2)
def test_2_running(rank):
    child = subprocess.Popen(["sleep", "300"], start_new_session=True)
    forked = os.fork()  # not exec'd: its environment is the rank's at exec (no marker if forked)
    if forked == 0:
        time.sleep(300)
        os._exit(0)
    (HERE / f"forked-{rank}").write_text(str(forked))
    flag = HERE / f"running-{rank}"
    if rank == 0:  # hung inside torch.distributed (C++), where only faulthandler's dump reaches;
        # the flag comes from a thread, once the receive has had time to start waiting
        threading.Timer(0.5, flag.write_text, (str(child.pid),)).start()
        dist.recv(torch.zeros(1), src=1)
    flag.write_text(str(child.pid))
    time.sleep(300)

@pytest.mark.world_size(2)
def test_3_never_started(rank):
    pass
"""

# A second Ctrl-C at the moment the session starts ending (a human pressing it twice quickly):
# sent by the session to itself from pytest's own interrupt hook, so it always lands mid-clean-up.
SECOND_SIGINT = """
import os, signal

def pytest_keyboard_interrupt(excinfo):
    os.kill(os.getpid(), signal.SIGINT)
"""

STOP_S = 30  # from the (last) signal to the end of the process: the clean-up is bounded (seconds when quiet)


@dataclass
class Stopped:
    inner: InnerSession
    returncode: int
    output: str
    stop_s: float
    children: list[int]
    ran_before_signal_s: float
    """From seeing that both ranks run test_2 to the signal: a lower bound of their time in it."""


def _start(inner: InnerSession, twice: bool) -> subprocess.Popen[str]:
    inner.write("test_stopped.py", BODY)
    if twice:
        inner.write("conftest.py", SECOND_SIGINT)
    return inner.popen("-q", "--collective-timeout=30")


def _wait_running(inner: InnerSession, process: subprocess.Popen[str], deadline: float) -> list[int]:
    flags = [inner.directory / f"running-{rank}" for rank in (0, 1)]
    while not all(flag.exists() and flag.read_text() for flag in flags):
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            pytest.fail(f"test_2 never started:\n{process.communicate()[0]}")
        time.sleep(0.05)
    forked = [int((inner.directory / f"forked-{rank}").read_text()) for rank in (0, 1)]
    return [int(flag.read_text()) for flag in flags] + forked


def _ignores_sigint(pid: int) -> bool:
    """Whether SIGINT is ignored in process `pid` (its SigIgn mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    return False


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Stopped]:
    plans = {
        "sigint": signal.SIGINT,
        "second_sigint": signal.SIGINT,
        "sigterm": signal.SIGTERM,
        "sigkill": signal.SIGKILL,
    }
    inners = {name: InnerSession(tmp_path_factory.mktemp(name)) for name in plans}
    # A session started in the background by a non-interactive shell (`pytest ... &`, a CI step)
    # runs with SIGINT ignored, which every child inherits through exec: the inner sessions would
    # then never see the Ctrl-C this module sends. A caught handler is reset to the default at exec.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        processes_ = {name: _start(inners[name], twice=name == "second_sigint") for name in plans}
    finally:
        signal.signal(signal.SIGINT, previous)
    deadline = time.monotonic() + 240
    results = {}
    for name, sig in plans.items():
        inner, process = inners[name], processes_[name]
        children = _wait_running(inner, process, deadline)
        assert not _ignores_sigint(process.pid), f"the inner session {name} ignores SIGINT: the test cannot stop it"
        running_seen = time.monotonic()
        process.send_signal(sig)
        sent = time.monotonic()
        output, _ = process.communicate(timeout=120)
        results[name] = Stopped(
            inner, process.returncode, output, time.monotonic() - sent, children, sent - running_seen
        )
    return results


@pytest.mark.parametrize("name", ["sigint", "second_sigint", "sigterm"])
def test_an_interrupted_session_reports_what_finished_and_the_interrupted_test(
    stopped: dict[str, Stopped], name: str
) -> None:
    run = stopped[name]
    assert run.returncode == 2, run.output  # pytest's "interrupted"
    stop = "SessionTerminated: SIGTERM received" if name == "sigterm" else "KeyboardInterrupt"
    assert f"INCOMPLETE: interrupted ({stop}" in run.output, run.output  # the run summary says so
    assert run.stop_s < STOP_S, run.stop_s
    for rank in (0, 1):
        cases = read_cases(run.inner.junit(rank))
        assert sorted(cases) == ["test_1_finished", "test_2_running"], (rank, cases)
        assert cases["test_1_finished"].status == "passed"
        assert cases["test_1_finished"].stdout.strip() == f"rank {rank} finished"
        interrupted = cases["test_2_running"]
        assert interrupted.status == "failed"
        reason = "SessionTerminated: SIGTERM received" if name == "sigterm" else "KeyboardInterrupt"
        own = f"rank {rank} was still running when the pytest process stopped the test ({reason}"
        assert interrupted.message.startswith(own), interrupted
        # The evidence a cancelled CI job needs: where each rank was (faulthandler's dump).
        assert re.search(r'File ".*test_stopped\.py", line \d+ in test_2_running', interrupted.text), interrupted.text
        if rank == 0:  # the hang inside torch.distributed, down to the call
            assert re.search(r"line \d+ in recv\n", interrupted.text), interrupted.text
        # The rank's own time in the test, measured by the parent up to the stop, not 0 (the file
        # rounds to milliseconds).
        assert interrupted.time_s > 0 and interrupted.time_s >= run.ran_before_signal_s - 0.001, (interrupted, run)


def test_a_second_sigint_does_not_cut_the_clean_up_short(stopped: dict[str, Stopped]) -> None:
    assert "received while the session is ending" in stopped["second_sigint"].output


def test_sigterm_says_what_happened(stopped: dict[str, Stopped]) -> None:
    assert "SessionTerminated: SIGTERM received: the session ends" in stopped["sigterm"].output


def test_a_killed_session_writes_nothing_but_leaves_nothing(stopped: dict[str, Stopped]) -> None:
    run = stopped["sigkill"]
    assert run.returncode == -signal.SIGKILL
    assert not run.inner.junit(0).exists()  # reports are written at the end, which never came
    # Ranks die with the zygote, the zygote with pytest; the ranks' children are the reaper's.
    assert wait_for_no_leftovers(run.inner.marker) == []
    deadline = time.monotonic() + 10
    while run.inner.run_dirs() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert run.inner.run_dirs() == []


@pytest.mark.parametrize("name", ["sigint", "second_sigint", "sigterm", "sigkill"])
def test_no_process_and_no_run_directory_survive(stopped: dict[str, Stopped], name: str) -> None:
    run = stopped[name]
    assert wait_for_no_leftovers(run.inner.marker) == []
    assert still_running(run.children) == []
    assert run.inner.run_dirs() == []


def test_the_next_session_sweeps_what_a_dead_session_left(tmp_path: Path) -> None:
    dead = tmp_path / f"{run_dir_name('deadbeef0000')}abc"
    dead.mkdir()
    hold_run_dir(str(dead)).close()  # its owner is gone: the lock is free
    alive = tmp_path / f"{run_dir_name('a11ve0000000')}abc"
    alive.mkdir()
    owner = hold_run_dir(str(alive))
    env = dict(os.environ, **{procfs.SESSION_ENV: "deadbeef0000"})
    orphan = subprocess.Popen(["sleep", "300"], env=env, start_new_session=True)
    try:
        # Until it has exec'd, the child shows the parent's environment (no marker): under load
        # the sweep could run in that window and rightly miss it.
        marker = f"{procfs.SESSION_ENV}=deadbeef0000".encode()
        deadline = time.monotonic() + 10
        while marker not in Path(f"/proc/{orphan.pid}/environ").read_bytes().split(b"\0"):
            assert time.monotonic() < deadline, "the orphan never showed its session marker"
            time.sleep(0.01)
        swept = sweep_stale_run_dirs(str(tmp_path))
        assert swept == [str(dead)]
        assert orphan.wait(timeout=10) == -signal.SIGKILL
        assert not dead.exists() and alive.exists()
    finally:
        orphan.kill()
        owner.close()


def test_the_state_and_flags_of_a_process_are_read_from_its_stat_line() -> None:
    # /proc/<pid>/stat lines: a sleeping process; the same one killed, still unmapping its memory
    # (state R, PF_EXITING 0x4 in the flags field, which `reap_children` does not count as a
    # survivor); a command name with ") " in it.
    sleeping = "4242 (python) S 1 4242 4242 0 -1 4194560 900 0 0 0 3 1 0 0 20 0 1 0"
    exiting = "4242 (python) R 1 4242 4242 0 -1 4194564 900 0 0 0 3 1 0 0 20 0 1 0"
    odd_name = "4242 (a) S (b) Z 1 4242 4242 0 -1 4194560 900 0 0 0 3 1 0 0 20 0 1 0"
    assert procfs.state_and_flags(sleeping) == ("S", 4194560)
    state, flags = procfs.state_and_flags(exiting)
    assert state == "R" and flags & 0x4
    assert procfs.state_and_flags(odd_name) == ("Z", 4194560)
    assert procfs.state_and_flags("garbage") is None


def test_a_killed_child_that_turns_zombie_between_two_looks_is_still_reaped(monkeypatch) -> None:
    # The race behind a CI failure: `reap_children` polled waitpid (nothing exited yet), the
    # killed child became a zombie, and the next look saw no live process and returned, leaving
    # the zombie's PID in /proc for the next test to find. Replayed deterministically: the child
    # is already a zombie when the first waitpid is made to answer "nothing exited".
    child = os.fork()
    if child == 0:
        os._exit(0)
    deadline = time.monotonic() + 10
    while procfs.state_and_flags(Path(f"/proc/{child}/stat").read_text())[0] != "Z":
        assert time.monotonic() < deadline, "the forked child never exited"
        time.sleep(0.001)
    real_waitpid = os.waitpid
    answers = iter([(0, 0)])
    monkeypatch.setattr(os, "waitpid", lambda pid, options: next(answers, None) or real_waitpid(pid, options))
    assert procfs.reap_children(wait_for=[child]) == []
    assert not os.path.exists(f"/proc/{child}"), "the zombie was left unreaped"
