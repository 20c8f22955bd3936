"""Through the real harness: each kind of rank divergence fails with the first divergent collective.

Covers what the issue lists: skipped collective, reordered collectives, same-shape swap (passes
every torch check, caught only by the trace diff), size mismatch (gloo aborts), early exit and
hang; plus the opt-outs (`expect_divergence`, fault injection on a passing test).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from conftest import SYNCING_LAYERS, InnerSession
from tests.support.pytest_output import failure_sections

DIVERGENT = (
    """
import os, time
import pytest, torch, torch.distributed as dist
from torch import nn
from harness import faults

class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Linear(6, 6)
        self.layer2 = nn.Linear(6, 6)

"""
    + SYNCING_LAYERS
    + """
@pytest.mark.world_size(2)
def test_same_shape_swap(rank):
    order = ["layer1", "layer2"] if rank == 0 else ["layer2", "layer1"]
    Model()(torch.ones(1), order)

@pytest.mark.world_size(2)
def test_skipped_collective(rank):
    faults.inject(rank=1, at=1, action="skip", op="all_reduce")
    Model()(torch.ones(1), ["layer1", "layer2"])

@pytest.mark.world_size(2)
def test_reordered_ops(rank):
    a, b = torch.ones(4), torch.ones(4)
    if rank == 0:
        dist.all_reduce(a); dist.broadcast(b, src=0)
    else:
        dist.broadcast(b, src=0); dist.all_reduce(a)

@pytest.mark.world_size(2)
def test_size_mismatch(rank):
    dist.all_reduce(torch.ones(4))
    dist.all_reduce(torch.ones(4 if rank == 0 else 8))

@pytest.mark.world_size(2)
def test_early_exit(rank):
    dist.all_reduce(torch.ones(4))
    if rank == 1:
        os._exit(0)
    dist.all_reduce(torch.ones(4))

@pytest.mark.world_size(2)
def test_hang_at_collective(rank):
    faults.inject(rank=1, at=2, action="hang")
    for _ in range(3):
        dist.all_reduce(torch.ones(4))

@pytest.mark.world_size(2)
@pytest.mark.expect_divergence
def test_declared_divergence_passes(rank):
    order = ["layer1", "layer2"] if rank == 0 else ["layer2", "layer1"]
    Model()(torch.ones(1), order)

@pytest.mark.world_size(2)
def test_injected_delay_is_expected(rank):
    faults.inject(rank=0, at=0, action="delay", seconds=0.2)
    dist.all_reduce(torch.ones(4))

@pytest.mark.world_size(2)
def test_agreeing_ranks_pass(rank):
    Model()(torch.ones(1), ["layer1", "layer2"])
"""
)

EXPECTED = {
    "test_same_shape_swap": r"collective #1 on group \[0, 1\] at test_divergent.py:\d+: rank 0 all_reduce "
    r"\[layer1\] 36 float32 of layer1.weight vs rank 1 all_reduce \[layer2\] 36 float32 of layer2.weight",
    "test_skipped_collective": r"collective #2 on group \[0, 1\].*rank 1 (stopped|did not issue)",
    "test_reordered_ops": r"collective #1 on group \[0, 1\]: rank 0 all_reduce .* vs rank 1 broadcast",
    "test_size_mismatch": r"collective #2 on group \[0, 1\] at test_divergent.py:\d+: rank 0 all_reduce \S* ?4 float32 "
    r"vs rank 1 all_reduce \S* ?8 float32",
    "test_early_exit": r"collective #2 on group \[0, 1\].*rank 1 stopped",
    "test_hang_at_collective": r"rank 1 hung.*--- rank 1 Python stacks ---.*in _hang.*unfinished collectives: "
    r"rank 0 in collective #3 on group \[0, 1\]: all_reduce 4 float32 at \S+; "
    r"rank 1 in collective #3 on group \[0, 1\]: all_reduce 4 float32 at \S+ "
    r"\(injected fault: ",
}
COLLECTIVE_TIMEOUT = 3


def test_every_divergence_names_its_first_collective(inner: InnerSession) -> None:
    inner.write("test_divergent.py", DIVERGENT)
    started = time.monotonic()
    result = inner.run(f"--collective-timeout={COLLECTIVE_TIMEOUT}", "--straggler-grace=2", "-q")
    elapsed = time.monotonic() - started
    failures = failure_sections(result.stdout)
    assert sorted(failures) == sorted(EXPECTED), result.stdout
    for name, pattern in EXPECTED.items():
        assert re.search(pattern, failures[name], re.S), f"{name}:\n{failures[name]}"
    assert "6 failed, 3 passed" in result.stdout
    traces = inner.directory / "reports" / "traces"
    assert (traces / "test_divergent.py_test_same_shape_swap.txt").exists(), list(traces.iterdir())
    junit = Path(inner.junit(0)).read_text()
    assert "rank 0 all_reduce [layer1] 36 float32 of layer1.weight vs rank 1 all_reduce [layer2]" in junit
    # Each divergence costs at most one collective timeout plus the grace; a pool restart follows.
    assert elapsed < 6 * (COLLECTIVE_TIMEOUT + 15) + 60, elapsed
