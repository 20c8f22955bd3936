"""harness.tools.trace_script: a plain torchrun script traced and diffed without any pytest test.

One torchrun run (2 ranks): the ranks reduce two same-shaped tensors in swapped order from different
lines, then rank 1 runs an extra all-reduce that rank 0 never issues. The one-sided wait is stopped
in seconds (not at the collective timeout) and the diff names the swap; `--diff` reads it again.
The ranks also dump torch's Flight Recorder (gloo), which harness.tools.flight_recorder diffs the same way.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
import torch

from conftest import InnerSession
from harness.tools import flight_recorder, trace_script
from harness.trace.divergence import first_divergence

SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
loss_sum, correct = torch.ones(8, 8), torch.ones(8, 8)
if rank == 0:
    dist.all_reduce(loss_sum)
    dist.all_reduce(correct)
else:
    dist.all_reduce(correct)
    dist.all_reduce(loss_sum)
import os, torch._C._distributed_c10d as c10d  # Flight Recorder's dump, for harness.tools.flight_recorder
with open(f"fr/trace_rank_{rank}", "wb") as dump:  # gloo has a Flight Recorder from torch 2.7
    dump.write(c10d._dump_fr_trace(True, True, False) if hasattr(c10d, "_dump_fr_trace") else b"")
if rank == 1:
    dist.all_reduce(torch.ones(4))  # an extra batch on rank 1: rank 0 has finished
"""
SWAP = (
    "ranks issued divergent collectives: collective #1 on group [0, 1]: "
    "rank 0 all_reduce 64 float32 at train.py:7 vs rank 1 all_reduce 64 float32 at train.py:10"
)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_torchrun_script_is_traced_diffed_and_its_one_sided_wait_stopped(inner: InnerSession, capsys) -> None:
    inner.write("train.py", SCRIPT)
    (inner.directory / "fr").mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    command += ["-m", "harness.tools.trace_script", "--trace-dir", "traces", "train.py"]
    started = time.monotonic()
    env = {**inner.env(), "TORCH_FR_BUFFER_SIZE": "64"}  # Flight Recorder on, as a user would for a hang
    result = subprocess.run(
        command, cwd=inner.directory, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    elapsed = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "harness.tools.trace_script: stopped: waited alone in collective #3 on group [0, 1]" in output, output
    assert SWAP in output and "unfinished collectives: rank 1 in collective #3" in output, output
    assert elapsed < 60, f"{elapsed:.0f} s: the one-sided wait should not last the collective timeout"
    table = (inner.directory / "traces" / "diff.txt").read_text()
    assert "rank 1: 3 collectives" in table and "train.py:16" in table, table
    assert SWAP in trace_script.diff_directory(inner.directory / "traces")
    if not hasattr(torch._C._distributed_c10d, "_dump_fr_trace"):
        why = (
            f"the script's trace and diff passed; torch {torch.__version__} has no Flight Recorder for gloo "
            "(_dump_fr_trace, torch >= 2.7), so its dumps are not read here"
        )
        pytest.skip(reason=why)
    # The same swap, from torch's own Flight Recorder dumps: they carry the call sites too.
    dumps = flight_recorder.read_dumps([inner.directory / "fr"])
    assert sorted(dumps) == [0, 1] and [r.op for r in dumps[1]] == ["all_reduce", "all_reduce"], dumps
    sites = {rank: [r.site for r in records] for rank, records in dumps.items()}
    assert sites == {0: ["train.py:7", "train.py:8"], 1: ["train.py:10", "train.py:11"]}, sites
    divergence = first_divergence(dumps, [0, 1])
    assert divergence is not None and divergence.describe() == SWAP.removeprefix("ranks issued divergent collectives: ")
    assert flight_recorder.main([str(inner.directory / "fr")]) == 0
    assert SWAP in capsys.readouterr().out
