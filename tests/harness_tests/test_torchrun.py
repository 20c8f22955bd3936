"""torchrun mode: two torchrun agents on this machine act as two nodes (c10d rendezvous on loopback).

Every rank runs the same selection in lockstep; a failure on one rank fails that test on both
"nodes" without a hang, a rank waiting alone in a collective is stopped in seconds (not at the
collective timeout), and each rank writes its own rank-<r>.xml with every test pytest reported,
including those failed because an earlier test left the world unusable. Conformance scenarios run
(not skip) at a world size none of them lists (3). First, in process: the one reader of
torchrun's environment (harness.config.torchrun).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

from conftest import REPO, SCHEMA, InnerSession, read_cases
from harness.config.torchrun import TorchrunWorld, torchrun_world
from harness.process.rank_env import rank_environment

LAUNCHED = {"TORCHELASTIC_RUN_ID": "job"}


def test_the_torchrun_world_is_read_from_torchrun_s_variables() -> None:
    assert torchrun_world({"RANK": "0", "WORLD_SIZE": "2"}) is None  # no agent started this process
    environ = {**LAUNCHED, "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    world = torchrun_world(environ)
    assert world == TorchrunWorld(rank=5, local_rank=1, world_size=8, local_world_size=4)
    assert not world.on_one_host
    assert world.environment() == {name: environ[name] for name in world.environment()}


def test_a_missing_local_world_size_means_one_host() -> None:
    world = torchrun_world({**LAUNCHED, "RANK": "2", "WORLD_SIZE": "3"})
    assert world == TorchrunWorld(rank=2, local_rank=2, world_size=3, local_world_size=3)
    assert world.on_one_host


def test_the_pool_writes_the_contract_the_reader_reads() -> None:
    environ = {**rank_environment({}, rank=1, world_size=3, master_port=1), **LAUNCHED}
    assert torchrun_world(environ) == TorchrunWorld(rank=1, local_rank=1, world_size=3, local_world_size=3)


@pytest.mark.parametrize(
    "variables, message",
    [
        ({"RANK": "0"}, "but WORLD_SIZE is not: launch pytest with torchrun"),
        ({"WORLD_SIZE": "2"}, "but RANK is not"),
        ({"RANK": "0", "WORLD_SIZE": "two"}, "torchrun's WORLD_SIZE='two' is not a whole number"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "torchrun's RANK='2' is not below WORLD_SIZE (2)"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"}, "LOCAL_WORLD_SIZE='4' is more than WORLD_SIZE"),
        ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, "but LOCAL_RANK is not"),
        ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, "LOCAL_RANK='-1' is below 0"),
    ],
)
def test_a_malformed_torchrun_environment_names_the_variable(variables: dict[str, str], message: str) -> None:
    with pytest.raises(pytest.UsageError) as refused:
        torchrun_world({**LAUNCHED, **variables})
    assert message in str(refused.value)


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

@pytest.mark.world_size(2)
def test_f_leaves_a_collective_unfinished(rank):
    if rank == 0:
        dist.all_reduce(torch.ones(2))  # rank 1 never joins: rank 0 waits alone

@pytest.mark.world_size(2)
def test_g_after(rank):
    dist.barrier()

@pytest.mark.world_size(2)
def test_h_after(rank):
    dist.barrier()
"""

COLLECTIVE_TIMEOUT_S = 30  # far longer than the torchrun watch takes to stop a one-sided wait
WAITED_ALONE = (
    "rank 0 stopped by the harness {} s into the test: waited alone in collective #1 on group [0, 1] "
    "(all_reduce 2 float32 op=SUM at test_nodes.py:"
)

UNUSABLE = (
    "the torchrun world is unusable since test_nodes.py::test_f_leaves_a_collective_unfinished "
    "left a collective unfinished"
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_torchrun_nodes_run_in_lockstep(inner: InnerSession) -> None:
    inner.write("test_nodes.py", TESTS)
    # An earlier run's files: rank 1's is rewritten by its own process, rank 3's removed by rank 0's.
    junit = inner.junit(0).parent
    junit.mkdir(parents=True)
    for rank in (1, 3):
        (junit / f"rank-{rank}.xml").write_text('<testsuites name="an earlier run"/>')
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
            *inner.command("-q", f"--collective-timeout={COLLECTIVE_TIMEOUT_S}", "--straggler-grace=2")[3:],
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
    started = time.monotonic()
    outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    elapsed = time.monotonic() - started
    for agent, output in zip(agents, outputs):
        assert agent.returncode != 0, output  # tests failed, on both nodes
        assert "4 failed, 3 passed, 1 deselected" in output, output
        assert "only rank 1 disagrees" in output
        assert "1 deselected for their world size (torchrun WORLD_SIZE=2): 1 runs only at world size 4" in output
        assert output.count(UNUSABLE) >= 2, output
    # Each rank's process writes its own file into the shared directory (no "in use" renaming).
    assert inner.rank_files() == ["rank-0.xml", "rank-1.xml"], outputs[0]
    assert "removed per-rank files of an earlier run: rank-3.xml" in "".join(outputs), outputs
    for rank in (0, 1):
        cases = read_cases(inner.junit(rank))
        assert {name: case.status for name, case in cases.items()} == {
            "test_a_allreduce": "passed",
            "test_b_fails_on_rank_1": "failed",
            "test_c_world_still_usable": "passed",
            "test_f_leaves_a_collective_unfinished": "failed",
            "test_g_after": "failed",
            "test_h_after": "failed",
        }
        assert cases["test_b_fails_on_rank_1"].message.startswith(
            "AssertionError: only rank 1 disagrees" if rank == 1 else "failed on another rank (this rank: passed)"
        )
        for name in ("test_g_after", "test_h_after"):
            assert cases[name].message.startswith(UNUSABLE), cases[name]
    # Rank 0 waited alone: its own watch saw rank 1 finish without issuing the all-reduce and ended
    # the wait (~1 s: half a second stuck, then a poll); its file tells how, with its stack.
    one_sided = read_cases(inner.junit(0))["test_f_leaves_a_collective_unfinished"]
    assert one_sided.time_s < 10, one_sided
    seconds = one_sided.message.partition("stopped by the harness ")[2].partition(" ")[0]
    assert one_sided.message.startswith(WAITED_ALONE.format(seconds)), one_sided.message
    assert "--- rank 0 Python stacks ---" in one_sided.text, one_sided.text
    assert "in test_f_leaves_a_collective_unfinished" in one_sided.text, one_sided.text
    # No collective timeout: ~20 s on a quiet machine, most of it two interpreters importing
    # torch; the bound leaves room for a loaded one, not for a 30 s timeout.
    assert elapsed < 120, elapsed


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
