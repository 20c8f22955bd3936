"""harness.tools.trace_script on plain data-parallel scripts (issue #39), two bugs the script form
used to pass with "no divergence" and exit 0. A user's train.py under a real torchrun with 2 ranks,
the bug switched on with BUG=1:

* DDP, whose gradient reductions are issued from C++: each rank stops on its own loss (rank 0's
  data is easier), so rank 1 goes on alone into DDP's bucket all-reduce. The one-sided watch stops
  the run within 20 s of the script's start, naming DDP's bucket and each rank's line;
* replicas that drift: the ranks are seeded by their rank before the model is built, nothing
  broadcasts it, and a hand-written loop all-reduces the gradients: every collective matches, and
  the end-of-run replica check names each parameter, each rank's value and that it differed before
  the first step; the rank exits 4.

The fixes (the ranks agree on stopping; one seed) report no divergence, replicas that agree, exit 0.
"""

from __future__ import annotations

import re

from test_trace_script_ends import VERDICT_S, _run, _verdict_after_start_s

from conftest import InnerSession


def _buggy_output(inner: InnerSession, script: str) -> str:
    """What `script` prints run with its bug switched on (BUG=1); the run must fail."""
    result = _run(inner, script, bug=True)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    return output


def _assert_diagnosed_in_time(inner: InnerSession, output: str, *patterns: str) -> None:
    """Every one of `patterns` is in the buggy run's `output`, and its verdict came within VERDICT_S."""
    for pattern in patterns:
        assert re.search(pattern, output), output
    assert _verdict_after_start_s(inner) < VERDICT_S


def _assert_fixed_run_passes(inner: InnerSession, script: str, said: str) -> None:
    """`script` run with its fix (BUG=0) exits 0 and prints `said`."""
    result = _run(inner, script, bug=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert said in output, output


EARLY_STOP = """
import os, time, torch, torch.distributed as dist
from torch import nn
open(f"started-{os.environ['RANK']}", "w").write(repr(time.time()))
dist.init_process_group("gloo")
rank, bug = dist.get_rank(), os.environ["BUG"] == "1"
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 4)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
torch.manual_seed(rank)
scale = 0.1 if rank == 0 else 1.0  # rank 0's shard of the data is easier
for step in range(4):
    loss = model(torch.randn(4, 10) * scale).square().mean()
    converged = torch.tensor(float(loss.item() < 0.03))
    if not bug:  # the fix: every rank stops when any has converged
        dist.all_reduce(converged, op=dist.ReduceOp.MAX)
    if step >= 1 and converged.item():
        break
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
dist.destroy_process_group()
"""
FORWARD_LINE = 13  # loss = model(...)
BACKWARD_LINE = 19  # loss.backward()


def test_a_ddp_rank_that_stops_early_is_found_by_the_script_form(inner: InnerSession) -> None:
    lines = EARLY_STOP.splitlines()
    assert "loss = model(" in lines[FORWARD_LINE - 1] and "loss.backward()" in lines[BACKWARD_LINE - 1]
    output = _buggy_output(inner, EARLY_STOP)
    stopped = (
        r"waited alone in collective #\d+ on group \[0, 1\] \(all_reduce 244 float32(?: op=SUM)? "
        rf"at train.py:{BACKWARD_LINE}\)"
    )
    diverged = (
        rf"rank 0 stopped early after #\d+ [^\n]* at train.py:{FORWARD_LINE} \(rank 1 issued all_reduce "
        rf"\[DDP bucket 0 of 1 \[[\w., ]+\]\] 244 float32 async at train.py:{BACKWARD_LINE}\)"
    )
    _assert_diagnosed_in_time(inner, output, stopped, diverged)


def test_the_fixed_ddp_script_reports_no_divergence_and_exits_0(inner: InnerSession) -> None:
    _assert_fixed_run_passes(inner, EARLY_STOP, "no divergence between the collectives of ranks [0, 1]")


SEEDED = """
import os, time, torch, torch.distributed as dist
from torch import nn
open(f"started-{os.environ['RANK']}", "w").write(repr(time.time()))
dist.init_process_group("gloo")
rank, bug = dist.get_rank(), os.environ["BUG"] == "1"
torch.manual_seed(rank if bug else 0)  # the bug: each rank seeded by its rank, and no broadcast
model = nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    torch.manual_seed(100 + 10 * step + rank)  # each rank's own batch
    model(torch.randn(4, 8)).square().mean().backward()
    for parameter in model.parameters():
        dist.all_reduce(parameter.grad)
        parameter.grad /= dist.get_world_size()
    optimizer.step()
    optimizer.zero_grad()
dist.destroy_process_group()
"""


def test_replicas_seeded_apart_are_found_at_the_end_of_the_run(inner: InnerSession) -> None:
    output = _buggy_output(inner, SEEDED)
    assert "exitcode  : 4" in output, output
    assert "no divergence between the collectives of ranks [0, 1]" in output, output
    assert "ranks 0, 1: replicas drifted: 2 of 2 replicated tensors differ across ranks" in output, output
    drifted = [
        rf"  {name} \(parameter, float32 {re.escape(shape)}, replicated over ranks \[0, 1\]: its gradient was "
        r"all-reduced whole\): rank 0 sum -?[\d.]+ vs rank 1 sum -?[\d.]+; first differed before the first "
        r"optimizer step"
        for name, shape in (("weight", "[4, 8]"), ("bias", "[4]"))
    ]
    _assert_diagnosed_in_time(inner, output, *drifted)


def test_replicas_seeded_alike_agree_and_the_run_exits_0(inner: InnerSession) -> None:
    _assert_fixed_run_passes(inner, SEEDED, "ranks 0, 1: replicas agree: 2 replicated tensors on ranks 0, 1")
