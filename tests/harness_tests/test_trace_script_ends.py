"""harness.tools.trace_script always reports and always ends (issue #39), each as a user meets it: a
plain train.py under a real torchrun with 2 ranks, the bug switched on with BUG=1.

* gloo's size-mismatch abort kills rank 0 (SIGABRT; rank 0 is the rank that only reported before):
  the surviving rank 1 prints the diff;
* a stuck job is sent SIGTERM (torchrun forwards it; a CI cancel), or torchrun SIGKILL (a CI's
  kill after its grace): rank 1 blocks in an all-reduce rank 0 never joins while rank 0 blocks in
  gloo's recv, so no Python handler can run; every process (torchrun, both ranks, and a
  SIGTERM-ignoring child each rank started) is gone within 5 s, with the report;
* every rank dies (SIGKILL) after a divergent pair of all-reduces: torchrun's failure summary says
  how to get the diff, and the next run on the same directory prints it before it starts;
* the same scripts with the bug fixed: "no divergence", exit status 0.

Each verdict comes within 20 s of the script's start: the time from the script's first line (it
writes it) to the report file.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import InnerSession, running, still_running
from harness.tools import trace_script
from harness.trace.records import read_trace_or_empty

VERDICT_S = 20

ABORT = """
import os, time, torch, torch.distributed as dist
open(f"started-{os.environ['RANK']}", "w").write(repr(time.time()))
dist.init_process_group("gloo")
rank, bug = dist.get_rank(), os.environ["BUG"] == "1"
dist.all_reduce(torch.ones(8))  # a first batch both ranks agree on
numel = 212 if bug and rank == 1 else 4  # the bug: rank 1 reduces another bucket
dist.all_reduce(torch.ones(numel))  # gloo aborts the rank that receives more than it expects: rank 0
if bug and rank == 0:
    os.abort()  # should gloo ever let rank 0 return from that call
"""

STUCK = """
import os, subprocess, sys, time, torch, torch.distributed as dist
open(f"started-{os.environ['RANK']}", "w").write(repr(time.time()))
dist.init_process_group("gloo")
rank, bug = dist.get_rank(), os.environ["BUG"] == "1"
ignores_sigterm = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
helper = subprocess.Popen([sys.executable, "-c", ignores_sigterm])  # a child the script started
open(f"pids-{rank}", "w").write(f"{os.getpid()} {helper.pid}")
dist.all_reduce(torch.ones(8))
if rank == 1 or not bug:
    dist.all_reduce(torch.ones(4))  # rank 1's extra batch
else:
    dist.recv(torch.ones(4), src=1)  # the bug: rank 0 waits for a message rank 1 never sends
helper.kill()
"""

ALL_DIE = """
import os, signal, time, torch, torch.distributed as dist
open(f"started-{os.environ['RANK']}", "w").write(repr(time.time()))
dist.init_process_group("gloo")
rank, bug = dist.get_rank(), os.environ["BUG"] == "1"
loss_sum, correct = torch.ones(8), torch.ones(8)
if rank == 0 or not bug:
    dist.all_reduce(loss_sum)
    dist.all_reduce(correct)
else:  # the bug: rank 1 reduces them the other way round (same shapes: gloo pairs them silently)
    dist.all_reduce(correct)
    dist.all_reduce(loss_sum)
open(f"pid-{rank}.tmp", "w").write(str(os.getpid()))
os.rename(f"pid-{rank}.tmp", f"pid-{rank}")
if bug:  # then the whole job is killed (the OOM killer, a node lost), before any rank could report
    if rank == 0:
        while not os.path.exists("pid-1"):
            time.sleep(0.01)
        os.kill(int(open("pid-1").read()), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _command() -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    return [*command, "-m", "harness.tools.trace_script", "--trace-dir", "traces", "train.py"]


def _run(inner: InnerSession, script: str, bug: bool) -> subprocess.CompletedProcess[str]:
    inner.write("train.py", script)
    env = {**inner.env(), "BUG": "1" if bug else "0"}
    return subprocess.run(
        _command(), cwd=inner.directory, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def _verdict_after_start_s(inner: InnerSession, report: str = "diff.txt") -> float:
    """From the script's first line (its earliest rank) to the report file."""
    started = min(float((inner.directory / f"started-{rank}").read_text()) for rank in (0, 1))
    return (inner.directory / "traces" / report).stat().st_mtime - started


def test_gloo_abort_of_rank_0_is_reported_by_rank_1(inner: InnerSession) -> None:
    result = _run(inner, ABORT, bug=True)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "exitcode  : -6" in output, output  # rank 0 died of SIGABRT
    assert "rank 0 died (killed by a signal, or aborted" in output, output
    assert "(reported by rank 1)" in output, output
    assert (
        "ranks issued divergent collectives: collective #2 on group [0, 1] at train.py:8: "
        "rank 0 all_reduce 4 float32 vs rank 1 all_reduce 212 float32"
    ) in output, output
    assert (
        "unfinished collectives: rank 0 in collective #2 on group [0, 1]: all_reduce 4 float32 at train.py:8; "
        "rank 1 in collective #2 on group [0, 1]: all_reduce 212 float32 at train.py:8"
    ) in output, output
    assert _verdict_after_start_s(inner) < VERDICT_S


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill-as-ci-after-its-grace"])
def test_a_stuck_job_stopped_ends_with_everything_it_started_within_5_s_and_the_report(
    inner: InnerSession, tmp_path: Path, stop: signal.Signals
) -> None:
    """SIGTERM: torchrun forwards it to the ranks. SIGKILL: torchrun dies at once, forwarding nothing;
    the kernel sends each rank SIGTERM as its parent dies."""
    inner.write("train.py", STUCK)
    log = tmp_path / "torchrun.log"
    with log.open("w") as sink:
        torchrun = subprocess.Popen(
            _command(),
            cwd=inner.directory,
            env={**inner.env(), "BUG": "1"},
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # as a CI job's step: its own session, signalled alone
        )
    ranks_and_helpers: list[int] = []
    try:
        deadline = time.monotonic() + 90
        traces = inner.directory / "traces"
        while not all(len(read_trace_or_empty(str(traces / f"rank-{rank}.jsonl"))) >= 2 for rank in (0, 1)):
            assert time.monotonic() < deadline and torchrun.poll() is None, log.read_text()
            time.sleep(0.05)
        time.sleep(0.5)  # both ranks inside their calls (a record is written just before its call)
        ranks_and_helpers = [
            int(pid) for rank in (0, 1) for pid in (inner.directory / f"pids-{rank}").read_text().split()
        ]
        assert all(running(pid) for pid in ranks_and_helpers), ranks_and_helpers
        torchrun.send_signal(stop)
        signalled = time.time()
        left = still_running([torchrun.pid, *ranks_and_helpers], timeout_s=5)
        assert left == [], f"still running 5 s after {stop.name}: {left} (torchrun {torchrun.pid})\n{log.read_text()}"
    finally:  # on a failure, nothing of it is left behind (the ranks have sessions of their own)
        for pid in [torchrun.pid, *ranks_and_helpers]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        torchrun.wait(10)
    output = log.read_text()
    assert "rank 0 was ended by SIGTERM; rank 1 was ended by SIGTERM" in output, output
    assert (
        "ranks issued divergent collectives: p2p #1 from rank 1 to rank 0: rank 1 issued none "
        "(rank 0 issued recv 4 float32 at train.py:13)"
    ) in output, output
    assert (
        "unfinished collectives: rank 0 in collective #1 on group [0, 1]: recv 4 float32 at train.py:13; "
        "rank 1 in collective #2 on group [0, 1]: all_reduce 4 float32 at train.py:11"
    ) in output, output
    assert (inner.directory / "traces" / "diff.txt").stat().st_mtime - signalled < 5
    assert _verdict_after_start_s(inner) < VERDICT_S


def test_when_every_rank_dies_the_next_run_prints_the_diff(inner: InnerSession, tmp_path: Path, capsys) -> None:
    killed = _run(inner, ALL_DIE, bug=True)
    output = killed.stdout + killed.stderr
    # torchrun's failure summary lists each dead rank, or (torch 2.6's, when it saw one death
    # before the other's exit was reaped) only the first, having sent the other SIGTERM.
    deaths = output.count("exitcode  : -9")
    assert killed.returncode != 0 and deaths in (1, 2), output
    assert "ranks issued divergent collectives" not in output, output  # no rank was left to report
    hint = "else: python -m harness.tools.trace_script --diff traces"
    assert output.count(hint) == deaths, output  # in torchrun's failure summary, for each rank it lists
    swap = (
        "ranks issued divergent collectives: collective #1 on group [0, 1]: "
        "rank 0 all_reduce 8 float32 at train.py:8 vs rank 1 all_reduce 8 float32 at train.py:11"
    )
    copy = tmp_path / "copy-of-traces"  # the hint's command, on a copy (the next run reads the original)
    shutil.copytree(inner.directory / "traces", copy)
    assert trace_script.main(["--diff", str(copy)]) == 0
    assert swap in capsys.readouterr().out
    for rank in (0, 1):
        (inner.directory / f"pid-{rank}").unlink()
        (inner.directory / f"started-{rank}").unlink()
    fixed = _run(inner, ALL_DIE, bug=False)
    output = fixed.stdout + fixed.stderr
    previous = "harness.tools.trace_script: the previous run in traces was never reported (rank 0 died"
    assert fixed.returncode == 0 and output.count(previous) == 1 and output.count(swap) == 1, output
    assert output.index(swap) < output.index("no divergence between the collectives of ranks [0, 1]"), output
    assert _verdict_after_start_s(inner, "previous-diff.txt") < 0  # printed before this run's script started
    assert swap in (inner.directory / "traces" / "previous-diff.txt").read_text()


@pytest.mark.parametrize("script", [ABORT, STUCK], ids=["gloo-abort", "stuck"])
def test_the_fixed_scripts_report_no_divergence_and_exit_0(inner: InnerSession, script: str) -> None:
    result = _run(inner, script, bug=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "harness.tools.trace_script: the run ended: rank 0 returned; rank 1 returned" in output, output
    assert "no divergence between the collectives of ranks [0, 1] (4 recorded)" in output, output
    assert "unfinished" not in output and "exitcode" not in output, output
    assert _verdict_after_start_s(inner) < VERDICT_S


LEAVES = """
import atexit, os, sys, torch, torch.distributed as dist


class Finalized:
    def __del__(self):  # runs only in the interpreter's finalization
        print(f"rank {os.environ['RANK']}: finalized", flush=True)


KEPT = Finalized()  # a module global: released only when the interpreter tears itself down
atexit.register(lambda: print(f"rank {os.environ['RANK']}: atexit ran", flush=True))
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(4))  # the group is left alive, as many scripts leave theirs
if os.environ["BUG"] == "1":
    sys.exit("stopped on purpose")
"""


@pytest.mark.parametrize("bug", [False, True], ids=["returns", "sys-exit-with-a-message"])
def test_a_rank_leaves_as_the_interpreter_would_but_without_its_finalization(inner: InnerSession, bug: bool) -> None:
    """Where a process group outlives the script (left alive, or referenced past
    destroy_process_group()), gloo's worker thread can abort a rank that finalizes after its script
    ended well (exit -6 after the report). The rank leaves
    after the script's atexit handlers and its output, with the script's status, and no
    finalizer of the interpreter's teardown runs (what aborted)."""
    result = _run(inner, LEAVES, bug=bug)
    output = result.stdout + result.stderr
    assert (result.returncode != 0) == bug, output
    for rank in (0, 1):
        assert f"rank {rank}: atexit ran" in output, output
        assert f"rank {rank}: finalized" not in output, output
    if bug:
        assert output.count("stopped on purpose") == 2 and "exitcode  : 1" in output, output
    else:
        assert "no divergence between the collectives of ranks [0, 1]" in output, output
