"""Through the real harness at the DEFAULT collective timeout (30 s): a rank that waits in a collective
no peer will ever match gets its verdict in seconds, and the diff says who stopped where.

Also end to end: a broadcast whose src differs between ranks, a dtype mismatch, a marked
asymmetric region that passes, and a test that waits alone on purpose (marked expect_divergence).
"""

from __future__ import annotations

import re

import torch

from conformance.adapters.torch_fsdp2 import TorchFSDP2Adapter
from conformance.suite import gate
from conftest import InnerSession, read_cases
from tests.support.pytest_output import failure_sections

ONE_SIDED = """
import pytest, torch, torch.distributed as dist
from torch import nn
import harness

@pytest.mark.world_size(4)
def test_uneven_batches(rank):
    batches = 3 if rank == 3 else 2  # the last rank got one batch more
    for _ in range(batches):
        dist.all_reduce(torch.ones(8))

@pytest.mark.world_size(2)
def test_broadcast_from_different_sources(rank):
    dist.broadcast(torch.ones(4), src=rank)
    dist.all_reduce(torch.ones(4))

@pytest.mark.world_size(2)
def test_dtype_mismatch(rank):
    dist.all_reduce(torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64))

@pytest.mark.world_size(2)
@pytest.mark.expect_divergence
def test_an_expected_timeout_is_left_to_the_collective_timeout(rank):
    import datetime
    if rank == 0:  # waits alone on purpose, for 2 s, on the default group (which stays up)
        with pytest.raises(RuntimeError, match="monitoredBarrier"):
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=2))

@pytest.mark.world_size(2)
def test_marked_asymmetric_region_passes(rank):
    total = torch.ones(8, 8)
    with harness.asymmetric():
        if rank == 0:
            dist.all_reduce(total)
        else:
            dist.all_reduce(total)
    assert total[0, 0].item() == 2
"""

FSDP2_CONDITIONAL = """
@pytest.mark.world_size(2)
def test_fsdp2_conditional_submodule(rank):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    for layer in model:
        fully_shard(layer)
    x = torch.ones(2, 8)
    x = model[0](x)
    if rank == 0:  # a data-dependent branch taken on one rank only
        x = model[1](x)
    x.sum().backward()
"""
# fully_shard runs on CPU only where the torch FSDP2 adapter declares it (conformance.suite.gate).
FSDP2_CANNOT_RUN = gate.unsupported(TorchFSDP2Adapter, "cpu", torch.__version__)

EXPECTED = {
    "test_uneven_batches": r"rank 3 failed.*stopped by the harness [\d.]+ s into the test: waited alone in "
    r"collective #3 on group \[0, 1, 2, 3\] \(all_reduce 8 float32 op=SUM at test_one_sided.py:\d+\).*"
    r"ranks issued divergent collectives: collective #3 on group \[0, 1, 2, 3\]: ranks 0, 1, 2 stopped early "
    r"after #2 all_reduce 8 float32 at test_one_sided.py:\d+ \(rank 3 issued all_reduce",
    "test_broadcast_from_different_sources": r"collective #1 on group \[0, 1\] at test_one_sided.py:\d+: "
    r"rank 0 broadcast 4 float32 root=0 vs rank 1 broadcast 4 float32 root=1",
    "test_fsdp2_conditional_submodule": r"ranks issued divergent collectives: collective #\d+ on group \[0, 1\]",
    "test_dtype_mismatch": r"collective #1 on group \[0, 1\] at test_one_sided.py:\d+: "
    r"rank 0 all_reduce 4 float32 vs rank 1 all_reduce 4 float64",
}
VERDICT_LIMIT_S = 10.0


def test_one_sided_collectives_fail_in_seconds_at_the_default_timeout(inner: InnerSession) -> None:
    expected = dict(EXPECTED)
    if FSDP2_CANNOT_RUN is None:
        inner.write("test_one_sided.py", ONE_SIDED + FSDP2_CONDITIONAL)
    else:  # the FSDP2 case is left out on this torch (its other cases still run)
        inner.write("test_one_sided.py", ONE_SIDED)
        del expected["test_fsdp2_conditional_submodule"]
    result = inner.run("-q")
    failures = failure_sections(result.stdout)
    assert sorted(failures) == sorted(expected), result.stdout
    for name, pattern in expected.items():
        assert re.search(pattern, failures[name], re.S), f"{name}:\n{failures[name]}"
    assert f"{len(expected)} failed, 2 passed" in result.stdout, result.stdout
    cases = read_cases(inner.junit(0))
    for name in expected:
        duration = cases[name].time_s
        assert duration < VERDICT_LIMIT_S, f"{name} took {duration:.1f} s (collective timeout: 30 s)"
