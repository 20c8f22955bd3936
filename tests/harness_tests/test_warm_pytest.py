"""Inner sessions forked from the warm server behave as `python -m pytest` subprocesses do."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from tests.support.warm_pytest import WarmPytest

SESSION_BOUND_S = 300
"""A hang guard for one inner pytest session, not a speed claim: a cold one imports torch, which
took over 120 s on a loaded 2-core machine."""

PROBE = """
import os, sys, tempfile
import torch

def test_probe():
    print("PROBE", os.getcwd(), sys.path[0], tempfile.gettempdir(), os.environ["WARM_PROBE"], torch.get_num_threads())
    assert [1, 2] == [1, 3]
"""
SLEEPER = "import time\n\ndef test_sleep():\n    time.sleep(60)\n"


@pytest.fixture(scope="module")
def server() -> WarmPytest:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    warm = WarmPytest(env)
    yield warm
    warm.close()


def _env(server: WarmPytest, tmp_path: Path, **extra: str) -> dict[str, str]:
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return {**server.env, "TMPDIR": str(tmp_path / "tmp"), "WARM_PROBE": "yes", "OMP_NUM_THREADS": "3", **extra}


def _probe(stdout: str) -> list[str]:
    line = next(line for line in stdout.splitlines() if "PROBE " in line)  # after pytest's "test_probe.py "
    return line.partition("PROBE ")[2].split()


def test_a_forked_session_is_what_a_subprocess_would_be(server: WarmPytest, tmp_path: Path) -> None:
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = _env(server, tmp_path)
    args = ["-p", "no:cacheprovider", "-s", "test_probe.py"]
    forked_before = server.forked
    warm = server.run(args, cwd=tmp_path, env=env, timeout=SESSION_BOUND_S)
    assert server.forked == forked_before + 1, server.fallback_reason
    cold = subprocess.run(
        [sys.executable, "-m", "pytest", *args],
        cwd=tmp_path,
        env=env,
        text=True,
        capture_output=True,
        timeout=SESSION_BOUND_S,
    )
    assert (
        (warm.returncode, _probe(warm.stdout))
        == (cold.returncode, _probe(cold.stdout))
        == (
            1,
            [str(tmp_path), str(tmp_path), str(tmp_path / "tmp"), "yes", str(min(3, len(os.sched_getaffinity(0))))],
        )
    )
    for result in (warm, cold):  # assertion rewriting, and no "already imported" warning
        assert "At index 1 diff: 2 != 3" in result.stdout, result.stdout
        assert "PytestAssertRewriteWarning" not in result.stdout
        assert "1 failed in" in result.stdout


def test_a_timeout_kills_the_session_as_subprocess_run_does(server: WarmPytest, tmp_path: Path) -> None:
    (tmp_path / "test_sleep.py").write_text(SLEEPER)
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        server.run(["-p", "no:cacheprovider", "test_sleep.py"], cwd=tmp_path, env=_env(server, tmp_path), timeout=3)
    assert time.monotonic() - started < 20
    # The server reaped the killed session and serves the next one.
    (tmp_path / "test_probe.py").write_text(PROBE)
    again = server.run(["-p", "no:cacheprovider", "-s", "test_probe.py"], cwd=tmp_path, env=_env(server, tmp_path))
    assert again.returncode == 1 and _probe(again.stdout)[3] == "yes"


def test_another_interpreter_configuration_runs_as_a_real_subprocess(server: WarmPytest, tmp_path: Path) -> None:
    (tmp_path / "test_probe.py").write_text(PROBE)
    forked_before = server.forked
    env = _env(server, tmp_path, PYTHONHASHSEED="7")
    result = server.run(
        ["-p", "no:cacheprovider", "-s", "test_probe.py"], cwd=tmp_path, env=env, timeout=SESSION_BOUND_S
    )
    assert server.forked == forked_before
    assert "PYTHON* variables differ" in server.fallback_reason
    assert result.returncode == 1 and _probe(result.stdout)[3] == "yes"
