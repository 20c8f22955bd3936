"""Every kind of rank fault fails only its own test, with the cause per rank; the next test passes.

One inner pytest session runs a fault followed by a healthy test, for each fault; the outer test
checks outcomes, failure texts, the per-rank JUnit files and that no rank process survived.
"""

from __future__ import annotations

import re
import signal
import time
import xml.etree.ElementTree as ET

from conftest import SCHEMA, InnerSession, leftover_processes
from harness.testing import failure_sections

FAULTS = """
import ctypes, os, signal, sys, time
import pytest, torch, torch.distributed as dist

def healthy(rank, world_size):
    t = torch.full((4,), float(rank))
    dist.all_reduce(t)
    assert t.tolist() == [float(sum(range(world_size)))] * 4

@pytest.mark.world_size(2)
def test_a_raise(rank):
    print(f"rank {rank} about to fail")
    if rank == 1:
        raise ValueError("boom on rank 1")

@pytest.mark.world_size(2)
def test_a_ok(rank, world_size): healthy(rank, world_size)

@pytest.mark.world_size(2)
def test_b_sys_exit(rank):
    if rank == 1:
        sys.exit(3)

@pytest.mark.world_size(2)
def test_b_ok(rank, world_size): healthy(rank, world_size)

@pytest.mark.world_size(2)
def test_c_os_exit(rank):
    if rank == 1:
        os._exit(7)
    dist.barrier()

@pytest.mark.world_size(2)
def test_c_ok(rank, world_size): healthy(rank, world_size)

@pytest.mark.world_size(2)
def test_d_sigkill(rank):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()

@pytest.mark.world_size(2)
def test_d_ok(rank, world_size): healthy(rank, world_size)

@pytest.mark.world_size(2)
def test_e_segfault(rank):
    if rank == 0:
        ctypes.string_at(0)
    dist.barrier()

@pytest.mark.world_size(2)
def test_e_ok(rank, world_size): healthy(rank, world_size)

@pytest.mark.world_size(2)
def test_f_gloo_size_mismatch(rank):
    dist.all_reduce(torch.ones(4 if rank == 0 else 8))

@pytest.mark.world_size(2)
def test_f_ok(rank, world_size): healthy(rank, world_size)

@pytest.mark.world_size(2)
def test_g_hang_in_collective(rank):
    if rank == 0:
        dist.all_reduce(torch.ones(2))

@pytest.mark.world_size(2)
def test_g_ok(rank, world_size): healthy(rank, world_size)

@pytest.mark.world_size(2)
def test_h_hang_in_python(rank):
    if rank == 1:
        while True:
            time.sleep(0.05)
    dist.barrier()

@pytest.mark.world_size(2)
def test_h_ok(rank, world_size): healthy(rank, world_size)

@pytest.mark.world_size(2)
def test_i_every_rank_hangs(rank):
    while True:
        time.sleep(0.05)

@pytest.mark.world_size(2)
def test_i_ok(rank, world_size): healthy(rank, world_size)
"""

COLLECTIVE_TIMEOUT = 5
TEST_TIMEOUT = 15
EXPECTED_CAUSE = {
    "test_a_raise": r"rank 1 failed.*ValueError: boom on rank 1",
    "test_b_sys_exit": r"rank 1 failed.*SystemExit: 3",
    "test_c_os_exit": r"rank 1 exited with code 7",
    "test_d_sigkill": r"rank 1 was killed by SIGKILL",
    "test_e_segfault": r"rank 0 was killed by SIGSEGV.*Fatal Python error: Segmentation fault",
    "test_f_gloo_size_mismatch": r"was killed by SIGABRT",
    "test_g_hang_in_collective": r"rank 0 failed.*(timed out|Timed out)",
    "test_h_hang_in_python": r"rank 1 hung.*--- rank 1 Python stacks ---.*in test_h_hang_in_python",
    "test_i_every_rank_hangs": r"rank 0 hung: no result within the 15 s.*rank 1 hung.*in test_i_every_rank_hangs",
}


def test_each_fault_fails_only_its_test(inner: InnerSession) -> None:
    inner.write("test_faults.py", FAULTS)
    started = time.monotonic()
    result = inner.run(
        f"--collective-timeout={COLLECTIVE_TIMEOUT}", f"--test-timeout={TEST_TIMEOUT}", "--straggler-grace=3", "-q"
    )
    elapsed = time.monotonic() - started
    out = result.stdout + result.stderr
    assert "9 failed, 9 passed" in out, out
    failures = failure_sections(result.stdout)
    assert sorted(failures) == sorted(EXPECTED_CAUSE), out
    for name, pattern in EXPECTED_CAUSE.items():
        assert re.search(pattern, failures[name], re.S), f"{name}:\n{failures[name]}"
        assert "REPRO: " in failures[name] and f"test_faults.py::{name}" in failures[name]
    # Two hangs wait for the collective timeout + grace, one for the test deadline; each of the nine
    # faults restarts the pool (a few seconds, up to ~15 s on a loaded 2-core machine). Far below
    # what waiting for the 120 s default deadline or the 30 min gloo default would take.
    assert elapsed < 2 * (COLLECTIVE_TIMEOUT + 15) + TEST_TIMEOUT + 9 * 20, elapsed

    for rank in (0, 1):
        path = inner.junit(rank)
        SCHEMA.validate(str(path))
        cases = {case.get("name"): case for case in ET.parse(path).iter("testcase")}
        assert len(cases) == 18
        for name in EXPECTED_CAUSE:
            assert name.replace("test_", "") and name in cases
        assert all(cases[n].find("failure") is None for n in cases if n.endswith("_ok"))
    rank1 = {case.get("name"): case for case in ET.parse(inner.junit(1)).iter("testcase")}
    assert "exited with code 7" in rank1["test_c_os_exit"].find("failure").get("message")
    assert "killed by SIGKILL" in rank1["test_d_sigkill"].find("failure").get("message")
    assert "rank 1 about to fail" in rank1["test_a_raise"].findtext("system-out")
    rank0 = {case.get("name"): case for case in ET.parse(inner.junit(0)).iter("testcase")}
    assert rank0["test_a_raise"].find("failure") is None  # rank 0 passed that test


def test_hang_is_reported_within_collective_timeout_plus_15s(inner: InnerSession) -> None:
    inner.write(
        "test_hang.py",
        FAULTS.split("@pytest.mark.world_size(2)\ndef test_a_raise")[0]
        + """
@pytest.mark.world_size(2)
def test_hang(rank):
    if rank == 1:
        time.sleep(3600)
    dist.barrier()
""",
    )
    started = time.monotonic()
    result = inner.run(f"--collective-timeout={COLLECTIVE_TIMEOUT}", "-q")
    elapsed = time.monotonic() - started
    assert "1 failed" in result.stdout, result.stdout
    assert "rank 1 Python stacks" in result.stdout and "in test_hang" in result.stdout
    pool_start_allowance = 20
    assert elapsed < COLLECTIVE_TIMEOUT + 15 + pool_start_allowance, elapsed


def test_interrupt_leaves_no_process(inner: InnerSession) -> None:
    flag = inner.directory / "running"
    inner.write(
        "test_slow.py",
        f"""
import pathlib, time, pytest
@pytest.mark.world_size(2)
def test_slow(rank):
    pathlib.Path({str(flag)!r} + str(rank)).touch()
    time.sleep(3600)
""",
    )
    process = inner.popen("-q")
    deadline = time.monotonic() + 120
    while not (flag.with_name("running0").exists() and flag.with_name("running1").exists()):
        assert time.monotonic() < deadline and process.poll() is None, process.communicate()[0]
        time.sleep(0.1)
    assert len(leftover_processes(inner.marker)) >= 3  # pytest and its two ranks while the test runs
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 2, output  # pytest's "interrupted"
    assert "KeyboardInterrupt" in output
    time.sleep(0.5)
    assert leftover_processes(inner.marker) == []
