"""pytest-timeout's limit is a distributed test's deadline, enforced by the harness (issue #34).

pytest-timeout interrupts the pytest process; for a distributed test that process is starting the
pool or waiting for the ranks. So its limit for such a test (`--timeout`, `PYTEST_TIMEOUT`, the ini
file, `@pytest.mark.timeout(N)`) becomes the ranks' deadline, counted from the task's dispatch, and
its own timer (SIGALRM, or the `thread` method's os._exit of the whole session) is never armed while
the pool runs the test (`harness.config.deadlines`). Checked with both methods, from what a CI reads:
the verdicts, their times (pytest's own --junitxml), the per-rank files with the hung rank's stack,
the REPRO line; and that a test running in the pytest process keeps pytest-timeout's usual
behaviour, marker included.
"""

from __future__ import annotations

import re
import time

import pytest

from conftest import InnerSession, read_cases, wait_for_no_leftovers
from tests.support.warm_pytest import run_pytest

LIMIT_S = 3
SLOW_S = 20  # how long the slow test would take: far beyond every limit here
POOL_START_S = LIMIT_S + 1  # the pool's start is made longer than the limit, and charged to no test
WALL_S = 40  # the whole session: pool start, one passing test, one hung until the limit, restart, end

DISTRIBUTED = f"""
import time, pytest

@pytest.mark.world_size(2)
def test_a_passes(rank):
    pass

@pytest.mark.world_size(2)
def test_b_slow(rank):
    if rank == 1:
        time.sleep({SLOW_S})
"""

# Imported by the session's zygote before it forks the first ranks: the first pool's start takes
# longer than the limit.
SLOW_POOL_START = f"import time\ntime.sleep({POOL_START_S})\n"


@pytest.mark.parametrize("method", ["signal", "thread"])
def test_timeout_becomes_the_deadline_of_distributed_tests(inner: InnerSession, method: str) -> None:
    inner.write("test_distributed.py", DISTRIBUTED)
    inner.write("slow_pool_start.py", SLOW_POOL_START)
    started = time.monotonic()
    result = inner.run(
        f"--timeout={LIMIT_S}",
        f"--timeout-method={method}",
        "-o",
        "rank_preload_modules=slow_pool_start",
        "--junitxml=pytest.xml",
        "-q",
    )
    wall_s = time.monotonic() - started
    output = result.stdout + result.stderr
    # pytest-timeout never fired: with `thread` it would have ended the session with no summary.
    assert result.returncode == 1 and "1 failed, 1 passed" in output, output[-4000:]
    assert "from pytest-timeout" not in output and "+ Timeout +" not in output, output[-4000:]
    assert wall_s < WALL_S, (wall_s, output[-4000:])
    cases = read_cases(inner.directory / "pytest.xml")
    # The first test's call started the pool, longer than the limit, and still passed.
    assert cases["test_a_passes"].status == "passed" and cases["test_a_passes"].time_s > LIMIT_S, cases
    assert cases["test_b_slow"].status == "failed" and cases["test_b_slow"].time_s < SLOW_S, cases["test_b_slow"]
    for rank in (0, 1):
        assert read_cases(inner.junit(rank))["test_a_passes"].status == "passed", rank
    slow = read_cases(inner.junit(1))["test_b_slow"]
    assert slow.status == "failed", slow
    assert f"hung: no result within the {LIMIT_S} s test deadline (pytest-timeout --timeout {LIMIT_S})" in (
        slow.message
    ), slow.message
    assert re.search(r'File ".*test_distributed\.py", line \d+ in test_b_slow', slow.text), slow.text[-3000:]
    assert LIMIT_S <= slow.time_s < SLOW_S, slow.time_s  # from the dispatch to the stack dump
    repro = next(line for line in output.splitlines() if line.startswith("REPRO: "))
    assert f"--timeout={LIMIT_S} " in repro, repro  # a reproduction's ranks get the same deadline


# The two tests both methods' sessions hold: a marked distributed test that hangs past its marker's
# 2 s, and a test in the pytest process over the same marker's limit.
MARKED_DISTRIBUTED = f"""
@pytest.mark.world_size(2)
@pytest.mark.timeout(2)
def test_c_marked(rank):
    time.sleep({SLOW_S})
"""
MARKED_IN_THE_PYTEST_PROCESS = f"""
@pytest.mark.timeout(2)
def test_g_in_the_pytest_process():
    time.sleep({SLOW_S})
"""

MIXED = f"""
import time, pytest

@pytest.fixture
def slow_parent_fixture():
    time.sleep({SLOW_S})
{MARKED_DISTRIBUTED}
@pytest.mark.world_size(2)
def test_d_under_the_session_limit(rank):
    time.sleep(3)  # over the marked test's 2 s, under the session's 5 s: the marker is per test

@pytest.mark.world_size(2)
def test_e_over_the_session_limit(rank):
    time.sleep({SLOW_S})

@pytest.mark.world_size(2)
@pytest.mark.timeout(2)
def test_f_hangs_in_a_parent_fixture(rank, slow_parent_fixture):
    pass
{MARKED_IN_THE_PYTEST_PROCESS}"""
SESSION_LIMIT_S = 5


def test_marker_and_environment_limits_and_pytest_timeout_s_own_behaviour_in_the_parent(
    inner: InnerSession,
) -> None:
    """Signal method: each distributed test gets its own limit (marker over `PYTEST_TIMEOUT`) as its
    ranks' deadline; a parent-side fixture and a non-distributed test get pytest-timeout's own
    SIGALRM, as without the harness."""
    inner.write("test_mixed.py", MIXED)
    env = {**inner.env(), "PYTEST_TIMEOUT": str(SESSION_LIMIT_S)}
    result = run_pytest(
        inner.command("--test-timeout=60", "--junitxml=pytest.xml", "-q"), cwd=inner.directory, env=env, timeout=600
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "3 failed, 1 passed, 1 error" in output, output[-4000:]
    cases = read_cases(inner.directory / "pytest.xml")
    marked = read_cases(inner.junit(0))["test_c_marked"]
    assert "hung: no result within the 2 s test deadline (pytest-timeout @pytest.mark.timeout(2))" in marked.message
    assert cases["test_d_under_the_session_limit"].status == "passed", cases["test_d_under_the_session_limit"]
    over = read_cases(inner.junit(1))["test_e_over_the_session_limit"]
    source = f"pytest-timeout PYTEST_TIMEOUT={SESSION_LIMIT_S}"
    assert f"hung: no result within the {SESSION_LIMIT_S} s test deadline ({source})" in over.message, over.message
    assert SESSION_LIMIT_S <= over.time_s < SLOW_S, over.time_s
    # A REPRO line carries no environment: the environment's limit travels as the option.
    repro = next(line for line in output.splitlines() if line.startswith("REPRO: ") and "test_e_over" in line)
    assert f"--timeout={SESSION_LIMIT_S} " in repro, repro
    # In the pytest process: pytest-timeout's own timer, the marker's 2 s, as it always is.
    for name in ("test_f_hangs_in_a_parent_fixture", "test_g_in_the_pytest_process"):
        assert cases[name].status == "failed" and re.search(r"Timeout \(?>2\.0s", cases[name].message), cases[name]
        assert cases[name].time_s < SLOW_S, cases[name]


THREAD = f"""
import time, pytest
{MARKED_DISTRIBUTED}
@pytest.mark.world_size(2)
def test_d_unlimited(rank):
    time.sleep(3)
{MARKED_IN_THE_PYTEST_PROCESS}"""


def test_thread_method_ends_the_session_only_for_a_test_in_the_pytest_process(inner: InnerSession) -> None:
    """Thread method: a marked distributed test fails by its deadline and the session goes on; the
    next non-distributed test over its limit gets pytest-timeout's usual end: stacks, os._exit(1)."""
    inner.write("test_thread.py", THREAD)
    result = inner.run("--timeout-method=thread", "--test-timeout=60", "-v")
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-4000:]
    assert re.search(r"test_c_marked FAILED.*test_d_unlimited PASSED", output, re.S), output[-4000:]
    # pytest-timeout's thread dumped the parent's stacks, inside the non-distributed test, and exited.
    timeout_banner = output.index("+ Timeout +")
    assert "time.sleep" in output[timeout_banner:] and "passed" not in output[timeout_banner:], output[-4000:]
    assert wait_for_no_leftovers(inner.marker) == []  # the reaper ended the warm ranks it left
