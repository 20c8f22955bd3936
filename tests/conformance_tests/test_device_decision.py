"""One device decision: what the harness ran a test on is what the conformance plugin judges by.

Under torchrun the harness counts GPUs per node (LOCAL_WORLD_SIZE): a world of 4 ranks on 2 nodes
of 2 GPUs runs on CUDA. An expected failure limited to `when = {device = "cuda"}` must match
there; it did not while the conformance plugin made a device decision of its own (4 ranks, 2
visible GPUs: "no device").

The torchrun world is simulated in an in-process pytester session: torchrun's environment, two
visible GPUs, torch.distributed's setup calls and the rank's runner replaced (every rank fails
with the known defect), so nothing starts a process group or touches a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness.config import devices
from harness.messages import RankOutcome
from harness.session import torchrun_session

pytest_plugins = ["pytester"]

SCENARIO = """
import pytest

@pytest.mark.world_size(4)
def test_scenario(backend, rank):
    pass  # never runs here: the simulated ranks report the known defect
"""

ENTRY = """
[[expected_failure]]
scenario = "test_scenario.py::test_scenario"
failure = "a known defect"
reason = "a defect of the CUDA path only"
when = {device = "cuda"}
"""


class KnownDefectRunner:
    """Stands in for `harness.rank.runner.TestRunner` in a rank of the simulated world."""

    def __init__(self, rank: int, *args: object) -> None:
        self.rank = rank

    def run(self, task: object) -> RankOutcome:
        defect = "AssertionError: a known defect"
        return RankOutcome(self.rank, "failed", 0.01, defect, defect)


def _every_rank_sends_the_same(output: list[object], value: object, group: object = None) -> None:
    output[:] = [value] * len(output)


@pytest.fixture
def two_nodes_of_two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process is rank 0 of a torchrun world of 4 ranks, 2 per node, with 2 GPUs here."""
    for name, value in {
        "TORCHELASTIC_RUN_ID": "simulated",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(devices, "visible_gpu_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "new_group", lambda **kwargs: object())
    monkeypatch.setattr(dist, "all_gather_object", _every_rank_sends_the_same)
    monkeypatch.setattr(torchrun_session, "TestRunner", KnownDefectRunner)


@pytest.mark.usefixtures("two_nodes_of_two_gpus")
def test_a_cuda_expectation_matches_a_multi_node_torchrun_world_on_cuda(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_scenario=SCENARIO)
    pytester.mkdir("expectations")
    (pytester.path / "expectations" / "torch-fsdp2.toml").write_text(ENTRY)
    result = pytester.runpytest(
        *("-p", "harness.plugin", "-p", "conformance.suite.backend_plugin", "-p", "no:cacheprovider", "-rxf"),
        *("--backend", "torch-fsdp2", "--device", "cuda", "--reports-dir", str(pytester.path / "reports")),
        *("--expectations-dir", str(pytester.path / "expectations")),
    )
    # Before the one decision it failed: the conformance plugin planned no device for 4 ranks on 2 GPUs.
    result.assert_outcomes(xfailed=1)
    result.stdout.fnmatch_lines(["*XFAIL*test_scenario*a defect of the CUDA path only*"])
    junit = (pytester.path / "reports" / "junit" / "rank-0.xml").read_text()
    assert '<property name="device" value="cuda" />' in junit, junit
