"""An NCCL watchdog timeout, simulated on CPU + gloo (no GPU here): a rank's collective that its peer
never joins, the Flight Recorder dumps the watchdog writes (TORCH_NCCL_DUMP_ON_TIMEOUT, torch's
real dumps: Flight Recorder records gloo too), the watchdog's line on the rank's stderr and its
SIGABRT. The failed test names the watchdog as that rank's cause, carries NCCL's own account from
the dumps (here: the all-reduce rank 0 never completed), and the pool is replaced.

What only a GPU can prove: that NCCL's watchdog writes the dumps to the pool's location
(`TORCH_FR_DUMP_TEMP_FILE`, set by the pool) and its line as matched here.
"""

from __future__ import annotations

import re

import pytest
import torch

from conftest import InnerSession
from harness.config.gpu_count import visible_gpu_count
from tests.support.pytest_output import failure_sections
from tests.support.warm_pytest import run_pytest

FLIGHT_RECORDER_DUMPS_GLOO = hasattr(torch._C._distributed_c10d, "_dump_fr_trace_json")
"""Whether this torch dumps Flight Recorder's entries for every backend, gloo included (not 2.6)."""

TESTS = """
import os, sys, time
import pytest, torch, torch.distributed as dist
import torch._C._distributed_c10d as c10d_C

WATCHDOG = (
    "[rank0]:[E1206 04:00:00.000000000 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation "
    "timeout: WorkNCCL(SeqNum=2, OpType=ALLREDUCE, NumelIn=8, NumelOut=8, Timeout(ms)=30000) ran for 30010 "
    "milliseconds before timing out."
)

def _dump(rank):
    # What NCCL's watchdog does on a timeout, on every rank: write Flight Recorder's entries (a
    # torch without Flight Recorder's JSON dump for every backend, 2.6, writes none).
    if not hasattr(c10d_C, "_dump_fr_trace_json"):
        return
    with open(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + str(rank), "wb") as handle:
        handle.write(c10d_C._dump_fr_trace_json(includeCollectives=True))

@pytest.mark.world_size(2)
def test_a_watchdog_timeout(rank):
    dist.all_reduce(torch.ones(4))
    if rank == 0:
        work = dist.all_reduce(torch.ones(8), async_op=True)  # rank 1 never joins
        time.sleep(0.3)
    _dump(rank)
    if rank == 0:
        sys.stderr.write(WATCHDOG + "\\n")
        sys.stderr.flush()
        os.abort()
    time.sleep(60)

@pytest.mark.world_size(2)
def test_the_next_test_gets_a_fresh_pool(rank):
    dist.all_reduce(torch.ones(1))
"""


def test_a_watchdog_timeout_names_its_cause_and_carries_the_flight_recorder_account(inner: InnerSession) -> None:
    inner.write("test_watchdog.py", TESTS)
    env = {**inner.env(), "TORCH_FR_BUFFER_SIZE": "200"}
    env.pop("TORCH_FR_DUMP_TEMP_FILE", None)
    result = run_pytest(inner.command("-q", "--straggler-grace", "1"), cwd=inner.directory, env=env, timeout=300)
    output = result.stdout + result.stderr
    assert "1 failed, 1 passed" in output, output
    section = failure_sections(result.stdout)["test_a_watchdog_timeout"]
    assert re.search(
        r"rank 0 was aborted by NCCL's watchdog: WorkNCCL\(SeqNum=2, OpType=ALLREDUCE, NumelIn=8, NumelOut=8, "
        r"Timeout\(ms\)=30000\) timed out \(was killed by SIGABRT \(6\)\)",
        section,
    ), section
    # The harness's own trace says the same, first: the divergence comes before the consequences.
    assert "ranks issued divergent collectives" in section, section
    assert "pool starts" in output and re.search(r"2 pool starts", output), output
    if not FLIGHT_RECORDER_DUMPS_GLOO:
        # torch 2.6: no dump to read; the report must not invent an account (the main leg proves it).
        assert "Flight Recorder dumps written during the test" not in section, section
        return
    # NCCL's own account, from the dumps the ranks wrote into the pool's directory.
    assert re.search(r"Flight Recorder dumps written during the test \([^)]*flight-recorder/rank_0", section), section
    account = section[section.index("Flight Recorder dumps written during the test") :]
    assert re.search(r"rank 1 stopped early after #1 .*\(rank 0 issued all_reduce\b[^\n]*8", account), account
    assert "each rank's last 8 entries:" in account and "rank 1: 1 collectives" in account, account


REAL_TIMEOUT = """
import pytest, torch, torch.distributed as dist

@pytest.mark.world_size(2)
def test_rank_0_all_reduces_alone(rank, device):
    if rank == 0:
        dist.all_reduce(torch.ones(8, device=device))
        torch.cuda.synchronize()  # NCCL's call returns once queued: wait for the kernel that never ends
"""


@pytest.mark.skipif(visible_gpu_count() < 2, reason="needs 2 GPUs: NCCL refuses two ranks on one GPU")
def test_a_real_nccl_watchdog_timeout_is_reported_with_the_dumps(inner: InnerSession) -> None:
    """The same on NCCL, for real (scripts/gpu_check.sh runs it on a machine with 2 GPUs or more)."""
    inner.write("test_real_timeout.py", REAL_TIMEOUT)
    env = {key: value for key, value in inner.env().items() if not key.startswith("TORCH_FR_")}
    command = inner.command("-q", "--device", "cuda", "--collective-timeout", "10", "--straggler-grace", "2")
    result = run_pytest(command, cwd=inner.directory, env=env, timeout=300)
    section = failure_sections(result.stdout)["test_rank_0_all_reduces_alone"]
    assert "aborted by NCCL's watchdog: WorkNCCL(" in section or "stopped by the harness" in section, section
    assert "Flight Recorder dumps written during the test" in section or "stopped by the harness" in section, section
