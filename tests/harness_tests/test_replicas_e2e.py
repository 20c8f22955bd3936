"""Through the real plugin: replicas that drift silently fail the test, written as users write the bug.

One inner session with `--check-replicas` (one pool): ranks seeded differently before building
the model and a hand-written data-parallel loop (every collective matches), the same loop fixed
two ways, a drift that starts at a given optimizer step, DDP with `broadcast_buffers=False` and
BatchNorm statistics of per-rank batches, a test that fails for its own reason and also drifts,
the marker's opt-out, and sharding backends whose shards legitimately differ (the reference
engine's FULL_SHARD, FSDP2's fully_shard), which must pass. The rules themselves are
tests/harness_tests/test_replicas.py.
"""

from __future__ import annotations

import re
import time

import torch

from conformance.adapters.torch_fsdp2 import TorchFSDP2Adapter
from conformance.suite import gate
from conftest import InnerSession, read_cases
from tests.support.pytest_output import failure_sections

USER_TESTS = """
import pytest, torch, torch.distributed as dist
from torch import nn


def train(model, rank, steps=3, grad_scale=lambda step: 1.0):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, steps + 1):
        model(torch.full((2, 4), float(rank))).sum().backward()
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad)
            parameter.grad *= grad_scale(step) / dist.get_world_size()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.world_size(2)
def test_seeded_drift(rank):
    torch.manual_seed(rank)  # the bug: each rank builds other weights, and nothing broadcasts them
    train(nn.Linear(4, 3), rank)


@pytest.mark.world_size(2)
def test_same_seed(rank):
    torch.manual_seed(0)
    train(nn.Linear(4, 3), rank)


@pytest.mark.world_size(2)
def test_seeded_but_broadcast(rank):
    torch.manual_seed(rank)
    model = nn.Linear(4, 3)
    for parameter in model.parameters():
        dist.broadcast(parameter.data, src=0)
    train(model, rank)


@pytest.mark.world_size(2)
def test_drift_from_step_2(rank):
    # The bug: from step 2 on, rank 1 scales its gradients otherwise (a loss scale out of sync).
    train(nn.Linear(4, 3), rank, grad_scale=lambda step: 2.0 if step >= 2 and rank == 1 else 1.0)


@pytest.mark.world_size(2)
def test_ddp_buffers_not_broadcast(rank):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), broadcast_buffers=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(8, 4) + rank).sum().backward()  # each rank's batch statistics
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.world_size(2)
def test_fails_and_drifts(rank):
    torch.manual_seed(rank)
    train(nn.Linear(4, 3), rank, steps=1)
    assert rank == 0, "rank 1 disagrees"


@pytest.mark.world_size(2)
@pytest.mark.check_replicas(False)
def test_opted_out(rank):
    torch.manual_seed(rank)
    train(nn.Linear(4, 3), rank)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def train_sharded(model, rank):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(4, 8) + rank).sum().backward()  # per-rank batches
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.world_size(2)
def test_reference_engine_full_shard(rank):
    import engine

    torch.manual_seed(0)
    train_sharded(engine.fully_shard(Net(), strategy=engine.ShardingStrategy.FULL_SHARD), rank)


@pytest.mark.world_size(2)
def test_fsdp2_fully_shard(rank):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net()
    fully_shard(model.fc1)
    train_sharded(fully_shard(model), rank)
"""

SUM = r"sum -?[0-9.e+-]+"
FAILED = {
    "test_seeded_drift": rf"replicas drifted: weight: rank 0 {SUM} vs rank 1 {SUM}, first differed before the first "
    r"optimizer step; and 1 more tensor$",
    "test_drift_from_step_2": rf"replicas drifted: weight: rank 0 {SUM} vs rank 1 {SUM}, first differed after "
    r"optimizer step 2 \(equal after step 1\); and 1 more tensor$",
    "test_ddp_buffers_not_broadcast": rf"replicas drifted: 1.running_mean: rank 0 {SUM} vs rank 1 {SUM}, first "
    r"differed before the first optimizer step$",  # its first forward's statistics; running_var agrees
    "test_fails_and_drifts": r"rank 1: AssertionError: rank 1 disagrees",
}
VERDICT_S = 15.0
# fully_shard runs on CPU only where the torch FSDP2 adapter declares it (conformance.suite.gate).
FSDP2_CANNOT_RUN = gate.unsupported(TorchFSDP2Adapter, "cpu", torch.__version__)


def test_replicas_that_drift_fail_their_test_naming_the_tensor_each_rank_s_value_and_the_step(
    inner: InnerSession, monkeypatch
) -> None:
    monkeypatch.setenv("COLUMNS", "300")  # pytest fits the FAILED line to the terminal's width
    passing = 5
    if FSDP2_CANNOT_RUN is not None:  # the FSDP2 case is left out on this torch (the others still run)
        inner.write("test_user.py", USER_TESTS.split("\n\n@pytest.mark.world_size(2)\ndef test_fsdp2_fully_shard")[0])
        passing = 4
    else:
        inner.write("test_user.py", USER_TESTS)
    started = time.monotonic()
    result = inner.run("--check-replicas", "-q", "-rf")
    elapsed = time.monotonic() - started
    output = result.stdout
    assert f"4 failed, {passing} passed" in output, output
    lines = dict(re.findall(r"^FAILED test_user.py::(\w+) - (.*)$", output, re.M))
    assert sorted(lines) == sorted(FAILED), output
    for name, pattern in FAILED.items():
        assert re.search(pattern, lines[name]), f"{name}: {lines[name]}"
    sections = failure_sections(output)
    seeded = sections["test_seeded_drift"]
    assert re.search(
        rf"replicas drifted: 2 of 2 replicated tensors differ across ranks\n  weight \(parameter, float32 \[3, 4\], "
        rf"replicated over ranks \[0, 1\]: its gradient was all-reduced whole\): rank 0 {SUM} vs rank 1 {SUM}; "
        r"first differed before the first optimizer step\n  bias \(parameter, float32 \[3\], ",
        seeded,
    ), seeded
    assert "REPRO:" in seeded and "--check-replicas" in seeded  # the re-run checks replicas too
    ddp = sections["test_ddp_buffers_not_broadcast"]
    assert "1.running_mean (buffer, float32 [4], replicated over ranks [0, 1]: DDP with broadcast_buffers=False" in ddp
    # The test's own failure first, the drift after it.
    own = sections["test_fails_and_drifts"]
    assert own.index("AssertionError: rank 1 disagrees") < own.index("replicas drifted: 2 of 2")
    # Every rank's file says the test failed on the drift, within the verdict's time.
    cases = [read_cases(inner.junit(rank)) for rank in (0, 1)]
    for case in (by_name["test_seeded_drift"] for by_name in cases):
        assert (case.status, case.message) == (
            "failed",
            "replicas drifted: 2 of 2 replicated tensors differ across ranks",
        )
        assert case.time_s < VERDICT_S, case.time_s
    assert elapsed < 120, elapsed
