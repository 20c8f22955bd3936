"""torchrun mode: two torchrun agents on this machine act as two nodes (c10d rendezvous on loopback).

Every rank runs the same selection in lockstep; a failure on one rank fails that test on both
"nodes" without a hang, and each rank writes its own rank-<r>.xml. Conformance scenarios run
(not skip) at a world size none of them lists (3).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import xml.etree.ElementTree as ET

from conftest import REPO, SCHEMA, InnerSession

TESTS = """
import pytest, torch, torch.distributed as dist

@pytest.mark.world_size(2)
def test_a_allreduce(rank, world_size):
    t = torch.ones(2) * (rank + 1)
    dist.all_reduce(t)
    assert t.tolist() == [3.0, 3.0]

@pytest.mark.world_size(2)
def test_b_fails_on_rank_1(rank):
    assert rank == 0, "only rank 1 disagrees"

@pytest.mark.world_size(2)
def test_c_world_still_usable(rank):
    dist.barrier()

@pytest.mark.world_size(4)
def test_d_needs_four(rank):
    pass

def test_e_plain():
    pass
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_torchrun_nodes_run_in_lockstep(inner: InnerSession) -> None:
    inner.write("test_nodes.py", TESTS)
    port = _free_port()
    agents = []
    for _ in range(2):  # two agents, one per "node"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=selftest",
            "--max-restarts=0",
            "-m",
            "pytest",
            *inner.command("-q", "--collective-timeout=20")[3:],
        ]
        agents.append(
            subprocess.Popen(
                command,
                cwd=inner.directory,
                env=inner.env(),
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    for agent, output in zip(agents, outputs):
        assert agent.returncode != 0, output  # one test failed, on both nodes
        assert "1 failed, 3 passed, 1 deselected" in output, output
        assert "only rank 1 disagrees" in output
        assert "1 deselected for their world size (torchrun WORLD_SIZE=2): 1 runs only at world size 4" in output
    for rank in (0, 1):
        SCHEMA.validate(str(inner.junit(rank)))
        cases = {c.get("name"): c for c in ET.parse(inner.junit(rank)).iter("testcase")}
        assert set(cases) == {"test_a_allreduce", "test_b_fails_on_rank_1", "test_c_world_still_usable"}
        assert (cases["test_b_fails_on_rank_1"].find("failure") is not None) == (rank == 1)


SCENARIOS_AT_THREE = [
    "conformance/test_runtime.py::test_unshard_reshard_order[reference-ws3-auto]",
    # HYBRID_SHARD on one host of 3 ranks: three shard groups of one rank, gradients all-reduced across them
    "conformance/test_runtime.py::test_training[reference-ws3-manual-HYBRID_SHARD-sgd]",
]


def test_conformance_scenarios_run_at_three_torchrun_ranks(inner: InnerSession) -> None:
    reports = inner.directory / "reports"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=3",
        "--max-restarts=0",
        "-m",
        "pytest",
        *SCENARIOS_AT_THREE,
        "--backend=reference",
        "--device=cpu",
        "-p",
        "no:cacheprovider",
        f"--reports-dir={reports}",
        "-q",
    ]
    result = subprocess.run(command, cwd=REPO, env=inner.env(), text=True, capture_output=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert output.count("2 passed in") == 3, output  # every rank ran both, none skipped
    for rank in range(3):
        SCHEMA.validate(str(reports / "junit" / f"rank-{rank}.xml"))
        cases = list(ET.parse(reports / "junit" / f"rank-{rank}.xml").iter("testcase"))
        assert sorted(c.get("name") for c in cases) == sorted(node.split("::")[1] for node in SCENARIOS_AT_THREE)
        assert all(len(c) == 0 or all(child.tag in ("system-out", "system-err") for child in c) for c in cases)
