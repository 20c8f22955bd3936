"""How the session's zygote starts: forked from pytest where that gives what a cold start gives,
a new interpreter otherwise (see [Note: a zygote forked from pytest] in harness.process.zygote_fork).

Each inner session leaves state behind in pytest before its first distributed test (a module
global, a signal handler, an open file); a rank must see none of it, however its zygote started.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.process import zygote_fork
from tests.harness_tests.conftest import REPO, InnerSession

# The ranks read their zygote's log through its stderr (fd 2): its first line says how it started.
_SCENARIO = """
import logging
import os
import signal

import pytest

STATE = {}
# A logger that does not propagate, as torch's c10d loggers are: pytest >= 9.1 attaches its
# capture handlers to it while a test runs, the test that forks the zygote included.
QUIET = logging.getLogger("scenario.non-propagating")
QUIET.propagate = False
QUIET.setLevel(logging.DEBUG)
# A logger this module gives a file, as a user's conftest may: each import adds the handler.
USER_LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "user.log")
USER = logging.getLogger("scenario.user")
USER.addHandler(logging.FileHandler(USER_LOG))


def test_0_pytest_changes_its_own_state(tmp_path):
    STATE["changed by pytest"] = True
    signal.signal(signal.SIGUSR2, lambda signum, frame: None)
    STATE["open file"] = open(tmp_path / "held-open", "w")


@pytest.mark.world_size(2)
def test_1_ranks_see_none_of_it(rank, tmp_path):
    zygote = os.getppid()
    with open(os.readlink(f"/proc/{zygote}/fd/2")) as log:
        print("ZYGOTE LOG:", log.readline().strip())
    assert STATE == {}, "the rank sees pytest's copy of this module"
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    held = [os.readlink(f"/proc/{zygote}/fd/{fd}") for fd in os.listdir(f"/proc/{zygote}/fd")]
    assert not [path for path in held if path.endswith("held-open")], held
    assert os.getsid(zygote) == zygote, "the zygote leads its own session"
    # pytest's handlers hold the parent's streams by fd number; the rank closed those fds, and the
    # files it opens reuse the numbers: a record logged now must reach none of them.
    files = [open(tmp_path / f"file-{index}", "w") for index in range(32)]
    QUIET.debug("RECORD-FOR-PYTEST")
    for handle in files:
        handle.close()
    assert not [path.name for path in tmp_path.iterdir() if "RECORD-FOR-PYTEST" in path.read_text()]
    kinds = [type(handler).__module__ for handler in QUIET.handlers]
    assert not [kind for kind in kinds if kind.startswith("_pytest")], kinds
    # This module, imported anew in the rank, gave the logger its file once; the parent's handler
    # (its fd closed in the rank) is not there beside it.
    targets = [os.readlink(f"/proc/self/fd/{handler.stream.fileno()}") for handler in USER.handlers]
    assert targets == [USER_LOG], targets
"""


def _zygote_log_line(output: str) -> str:
    lines = [line for line in output.splitlines() if "ZYGOTE LOG:" in line]
    assert lines, output[-3000:]
    return lines[0].partition("ZYGOTE LOG:")[2].strip()


def test_a_single_threaded_session_with_torch_imported_forks_its_zygote(inner: InnerSession) -> None:
    inner.write("test_state.py", "import torch\n" + _SCENARIO)
    result = inner.run("-q", "-s", "-p", "no:faulthandler")
    assert "2 passed" in result.stdout, result.stdout[-3000:]
    assert _zygote_log_line(result.stdout).startswith("zygote: forked from pytest"), result.stdout[-3000:]


def test_a_session_with_a_thread_alive_starts_its_zygote_cold(inner: InnerSession) -> None:
    inner.write(
        "conftest.py",
        "import threading\nimport time\n\nthreading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n",
    )
    inner.write("test_state.py", "import torch\n" + _SCENARIO)
    result = inner.run("-q", "-s", "-p", "no:faulthandler")
    assert "2 passed" in result.stdout, result.stdout[-3000:]
    line = _zygote_log_line(result.stdout)
    assert line.startswith("zygote: started cold") and "threads" in line, line


def test_the_fork_is_refused_where_it_would_not_be_a_cold_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads, CUDA, other interpreter start-up variables: each makes the zygote start cold."""
    import torch

    env = dict(zygote_fork._START_ENV)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(zygote_fork, "_thread_count", lambda: 1)
    # This process's modules are whatever earlier tests imported: judged on their own below.
    monkeypatch.setattr(zygote_fork, "_modules_to_drop", lambda: (["pytest"], ""))
    assert zygote_fork.refusal(env) == ""
    monkeypatch.setattr(zygote_fork, "_modules_to_drop", lambda: (["pytest"], "torch.x (it refers to pytest)"))
    assert "torch.x (it refers to pytest), which must stay" in zygote_fork.refusal(env)
    monkeypatch.setattr(zygote_fork, "_modules_to_drop", lambda: (["pytest"], ""))
    assert "PYTHON* variables" in zygote_fork.refusal({**env, "PYTHONHASHSEED": "12345"})
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert "CUDA" in zygote_fork.refusal(env)
    monkeypatch.setattr(zygote_fork, "_thread_count", lambda: 2)
    assert "2 threads" in zygote_fork.refusal(env)
    assert zygote_fork._interpreter_options(["python", "-W", "error", "-X", "dev", "-u", "-m", "pytest", "-q"]) == [
        "-W",
        "error",
        "-X",
        "dev",
        "-u",
    ]
    assert zygote_fork._interpreter_options(["python", "-m", "pytest", "-W", "error"]) == []
    assert zygote_fork._interpreter_options(["python", "-c", "code", "-x"]) == []
    monkeypatch.setattr(zygote_fork, "_thread_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(sys, "orig_argv", ["python", "-O", "-m", "pytest"])
    assert "options a new one would not have (-O)" in zygote_fork.refusal(env)


def test_a_failed_fork_starts_the_zygote_cold(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No memory or process slot for a copy of pytest: the zygote starts as a new interpreter."""
    import errno

    from harness.process import launcher

    def no_fork() -> int:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    started: list[list[str]] = []

    class ColdStart:
        pid = 12345

        def __init__(self, args: list[str], **kwargs: object) -> None:
            started.append(args)

        def poll(self) -> int:
            return 0

    monkeypatch.setattr(zygote_fork, "refusal", lambda env: "")
    monkeypatch.setattr(zygote_fork.os, "fork", no_fork)
    monkeypatch.setattr(launcher.subprocess, "Popen", ColdStart)
    client = launcher._ZygoteClient(str(tmp_path), {}, ())
    client._sock.close()
    assert client.cold_reason.startswith("forking pytest failed") and "Cannot allocate memory" in client.cold_reason
    assert started and started[0][1:3] == ["-m", "harness.rank.zygote"]
    assert (tmp_path / "zygote.log").read_text().startswith("zygote: started cold, as a new interpreter: forking")


# CUDA's fork hazard: torch marks every fork of a process that asked the CUDA runtime anything
# (torch.cuda.is_available, device_count) as unable to use CUDA, while is_initialized() stays
# False. A tripwire on those entry points in the inner pytest process records any call there
# (it is what marks forks on a CUDA build; on a CPU build the call marks nothing, so the tripwire
# is what fails); the ranks themselves ask torch's own mark.
_CUDA_TRIPWIRE = """
import os
import traceback

import torch

CALLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda-calls.txt")
PYTEST_PID = os.getpid()


def _tripwire(name, function):
    def tripped(*args, **kwargs):
        if os.getpid() == PYTEST_PID:
            with open(CALLS, "a") as calls:
                calls.write(f"torch.cuda.{name} called in pytest:\\n" + "".join(traceback.format_stack(limit=6)))
        return function(*args, **kwargs)

    return tripped


for _name in ("is_available", "device_count", "init", "_lazy_init", "current_device", "set_device"):
    setattr(torch.cuda, _name, _tripwire(_name, getattr(torch.cuda, _name)))
if hasattr(torch._C, "_cuda_getDeviceCount"):
    torch._C._cuda_getDeviceCount = _tripwire("_C._cuda_getDeviceCount", torch._C._cuda_getDeviceCount)
"""

_RANKS_MAY_USE_CUDA = """
import os

import pytest
import torch


@pytest.mark.world_size(2)
def test_ranks_may_use_cuda(rank):
    in_bad_fork = torch.cuda._is_in_bad_fork()
    log = os.readlink(f"/proc/{os.getppid()}/fd/2")
    print("ZYGOTE LOG:", open(log).readline().strip() if os.path.isfile(log) else f"(the rank's parent logs to {log})")
    assert not in_bad_fork, "this rank is in torch's bad fork: its first CUDA call would raise"
"""


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda"])
def test_no_rank_is_in_a_bad_fork_for_cuda_and_pytest_never_asks_the_cuda_runtime(
    inner: InnerSession, device: str
) -> None:
    """With OMP_NUM_THREADS=1 (torchrun's and many CI set-ups' default) pytest is single-threaded
    and forks its zygote; the ranks must still be able to use CUDA. Runs for real on a CUDA build
    of torch (CI's torch 2.14.1 leg), where a call to the CUDA runtime in pytest marks them."""
    inner.write("conftest.py", _CUDA_TRIPWIRE)
    inner.write("test_cuda_fork.py", _RANKS_MAY_USE_CUDA)
    env = {**inner.env(), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        inner.command("-q", "-s", "-p", "no:faulthandler", f"--device={device}"),
        cwd=inner.directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    calls = inner.directory / "cuda-calls.txt"
    assert not calls.exists(), calls.read_text()
    if device == "cuda" and "1 skipped" in output:
        return  # no GPU here: the ranks never started, and pytest asked the runtime nothing
    assert "1 passed" in output, output[-3000:]
    assert _zygote_log_line(output).startswith("zygote: forked from pytest"), output[-3000:]


def test_a_self_test_that_asks_the_cuda_runtime_in_pytest_fails_even_on_a_cpu_build() -> None:
    """The same rule for the self-tests' own pytest process (tests/support/cuda_runtime_guard.py,
    installed by tests/conftest.py): a call is noted with its place, and the phase fails naming it."""
    import torch

    from tests.support import cuda_runtime_guard

    torch.cuda.device_count()
    noted = r"asked the CUDA runtime in pytest.s own process \(torch.cuda.device_count\(\) at .*zygote_start\.py:\d+"
    with pytest.raises(AssertionError, match=noted + r".*visible_gpu_count"):
        cuda_runtime_guard.check("call")
    cuda_runtime_guard.check("call")  # the calls are forgotten once reported


def test_a_fork_that_torch_would_mark_bad_makes_the_zygote_start_cold(monkeypatch: pytest.MonkeyPatch) -> None:
    env = dict(zygote_fork._START_ENV)
    monkeypatch.setattr(zygote_fork, "_thread_count", lambda: 1)
    monkeypatch.setattr(zygote_fork, "_modules_to_drop", lambda: (["pytest"], ""))
    monkeypatch.setattr(zygote_fork, "forks_are_marked_bad", lambda: True)
    assert "torch marks its forks unable to use CUDA" in zygote_fork.refusal(env)


def test_the_probe_sees_torchs_mark_and_counting_gpus_leaves_none() -> None:
    """In a fresh interpreter (this one's forks must stay clean): counting GPUs the harness's way
    marks no fork; asking torch's runtime does, on a CUDA build (a CPU build never marks one)."""
    import torch

    code = (
        "import torch\n"
        "from harness.config.gpu_count import visible_gpu_count\n"
        "from harness.process.fork_probe import forks_are_marked_bad\n"
        "count = visible_gpu_count()\n"
        "after_count = forks_are_marked_bad()\n"
        "torch.cuda.device_count()\n"
        "print(count, after_count, forks_are_marked_bad())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    count, after_count, after_runtime = done.stdout.split()
    assert int(count) >= 0 and after_count == "False", done.stdout + done.stderr
    cuda_build = bool(torch.version.cuda or getattr(torch.version, "hip", None))
    assert after_runtime == str(cuda_build), done.stdout + done.stderr
