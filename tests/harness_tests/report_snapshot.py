"""Write the report files of one run with failures, with what varies between runs masked.

    python tests/harness_tests/report_snapshot.py REPO OUT

runs an inner pytest session of the code in REPO (its harness and conformance plugins) on a
fixed set of distributed tests (a pass, an SPMD failure on one rank, a rank that dies, one that
dies while its peer passes, a same-shape divergence, a skip, an xfail marker, conformance
scenarios that fail, lose a rank, or fail as expected) and copies every report file it wrote
(JUnit per rank, traces, conformance.md/.html) to OUT with timestamps, durations, host names,
process ids, line numbers and temporary paths replaced by placeholders. Run it on two trees and
`diff -r` the outputs to show that a refactoring of the report path changed no report. Not a
self-test: report contents change on purpose (the HTML matrix, message wording), so a stored
snapshot would fail for the wrong reasons.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = """
import os
import pytest, torch, torch.distributed as dist
from torch import nn


class Syncing(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(36))
    def forward(self, x):
        dist.all_reduce(self.weight.data)
        return x


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = Syncing()
        self.layer2 = Syncing()
    def forward(self, x, order):
        for name in order:
            x = getattr(self, name)(x)
        return x


@pytest.mark.world_size(2)
def test_passes(rank):
    print(f"rank {rank} passes")


@pytest.mark.world_size(2)
def test_fails_on_rank_1(rank):
    dist.barrier()
    assert rank != 1, "rank 1 disagrees"


@pytest.mark.world_size(2)
def test_rank_1_dies(rank):
    if rank == 1:
        print("rank 1 about to die", file=__import__("sys").stderr, flush=True)
        os._exit(3)
    dist.barrier()


@pytest.mark.world_size(2)
def test_rank_1_dies_alone(rank):
    if rank == 1:
        print("rank 1 leaves without a word to rank 0", file=__import__("sys").stderr, flush=True)
        os._exit(4)


@pytest.mark.world_size(2)
def test_scenario_loses_rank_1(backend, rank):
    if rank == 1:
        os._exit(5)


@pytest.mark.world_size(2)
def test_swaps_layers(rank):
    Model()(torch.ones(1), ["layer1", "layer2"] if rank == 0 else ["layer2", "layer1"])


@pytest.mark.world_size(2)
def test_skips(rank):
    pytest.skip("nothing to do here")


@pytest.mark.xfail(reason="known to fail on rank 0")
@pytest.mark.world_size(2)
def test_xfail_marker(rank):
    assert rank != 0, "rank 0 fails as expected"


@pytest.mark.world_size(2)
def test_scenario(backend, rank):
    assert rank != 0, "the scenario fails on rank 0"


@pytest.mark.world_size(2)
def test_expected(backend, rank):
    assert False, "a known defect"
"""

EXPECTATIONS = """
[[expected_failure]]
scenario = "test_inner.py::test_expected"
reason = "known defect, tracked elsewhere"
failure = "a known defect"
"""

# What differs between two runs of the same tests (or between two machines): masked.
_MASKS = (
    (re.compile(r'(time|timestamp)="[^"]*"'), r'\1="*"'),
    (re.compile(r"\b\d+\.\d+ ?s\b"), "*s"),
    (re.compile(r"\bpid \d+"), "pid *"),
    (re.compile(r"(line |:)\d+\b"), r"\1*"),
    (re.compile(r"0x[0-9a-f]+"), "0x*"),
    (re.compile(r"Thread 0x\*.*"), "Thread *"),
    # gloo words a peer's death as a read error or a closed connection, whichever it sees first.
    (re.compile(r"\[[^\]\n]*gloo/transport[^\]\n]*\][^\n\"<]*"), "<gloo: the peer went away>"),
)


def mask(text: str, directory: Path, repo: Path) -> str:
    text = text.replace(str(directory), "<dir>").replace(str(repo), "<repo>").replace(socket.gethostname(), "<host>")
    for pattern, replacement in _MASKS:
        text = pattern.sub(replacement, text)
    return text


def run(repo: Path, out: Path) -> subprocess.CompletedProcess[str]:
    directory = Path(tempfile.mkdtemp(prefix="report-snapshot-"))
    try:
        (directory / "test_inner.py").write_text(TESTS)
        (directory / "expectations").mkdir()
        (directory / "expectations" / "torch-fsdp2.toml").write_text(EXPECTATIONS)
        command = [
            sys.executable,
            "-m",
            "pytest",
            "test_inner.py",
            "-c",
            str(repo / "pyproject.toml"),
            "--rootdir",
            str(directory),
            "-p",
            "harness.plugin",
            "-p",
            conformance_plugin(repo),
            "-p",
            "no:cacheprovider",
            "--reports-dir",
            str(directory / "reports"),
            "--expectations-dir",
            str(directory / "expectations"),
            "--backend",
            "torch-fsdp2",
            "-q",
        ]
        env = {**os.environ, "PYTHONPATH": str(repo)}
        completed = subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True, timeout=600)
        shutil.rmtree(out, ignore_errors=True)
        for path in sorted((directory / "reports").rglob("*")):
            if path.is_file() and not path.name.startswith("."):
                target = out / path.relative_to(directory / "reports")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(mask(path.read_text(encoding="utf-8"), directory, repo), encoding="utf-8")
        return completed
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def conformance_plugin(repo: Path) -> str:
    """The conformance plugin's module in `repo` (it moved into `conformance.suite` in the layered tree)."""
    if (repo / "conformance" / "suite" / "backend_plugin.py").exists():
        return "conformance.suite.backend_plugin"
    return "conformance.plugin"


if __name__ == "__main__":
    completed = run(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve())
    sys.stdout.write(completed.stdout[-3000:])
    sys.exit(0 if completed.returncode == 1 else 1)  # the run must have failed tests, and only that
