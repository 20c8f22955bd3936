"""The FAILED line of a test whose ranks diverged names the divergent collective first, before its
consequences (a gloo abort, the timeouts of ranks left waiting), through the real plugin.

One inner session: an all-reduce of 212 elements on rank 0 and 4 on rank 1 (gloo aborts one rank
with SIGABRT), and a same-size swap that gloo pairs without complaint followed by a wait that only
the collective timeout ends. The one-line reason itself is checked in tests/harness_tests/test_replicas.py
(`failure_reason`) and tests/conformance_tests/test_run_summary.py.
"""

from __future__ import annotations

import re

from conftest import InnerSession
from tests.support.pytest_output import failure_sections

DIVERGING = """
import time
import pytest, torch, torch.distributed as dist
import harness


@pytest.mark.world_size(2)
def test_size_mismatch(rank):
    dist.all_reduce(torch.ones(212 if rank == 0 else 4))


@pytest.mark.world_size(2)
def test_swap_then_timeout(rank):
    loss, count = torch.ones(4), torch.ones(4)
    harness.name_tensor(loss, "loss")
    harness.name_tensor(count, "count")
    first, second = (loss, count) if rank == 0 else (count, loss)
    dist.all_reduce(first)  # the same size: gloo pairs them without complaint
    dist.all_reduce(second)
    if rank == 1:
        time.sleep(4)  # past the collective timeout: rank 0's barrier times out
    dist.barrier()
"""

FIRST = {
    "test_size_mismatch": r"ranks issued divergent collectives: collective #1 on group \[0, 1\] at "
    r"test_diverging.py:\d+: rank 0 all_reduce 212 float32 vs rank 1 all_reduce 4 float32; "
    r"then (rank \d failed first( \(by time: [^)]*\))?|ranks? [\d, ]+): was killed by SIGABRT",  # the consequence
    "test_swap_then_timeout": r"ranks issued divergent collectives: collective #1 on group \[0, 1\] at "
    r"test_diverging.py:\d+: rank 0 all_reduce 4 float32 of loss vs rank 1 all_reduce 4 float32 of count; "
    r"then ranks? 0",
}


def test_the_failed_line_names_the_divergent_collective_before_the_crash_it_caused(
    inner: InnerSession, monkeypatch
) -> None:
    monkeypatch.setenv("COLUMNS", "300")  # pytest fits the FAILED line to the terminal's width
    inner.write("test_diverging.py", DIVERGING)
    result = inner.run("--collective-timeout=2", "--straggler-grace=1", "-q", "-rf")
    output = result.stdout
    assert "2 failed" in output, output
    lines = dict(re.findall(r"^FAILED test_diverging.py::(\w+) - (.*)$", output, re.M))
    assert sorted(lines) == sorted(FIRST), output
    for name, pattern in FIRST.items():
        assert re.match(pattern, lines[name]), f"{name}: {lines[name]}"
    # The consequences are still all in the test's section.
    sections = failure_sections(output)
    assert "was killed by SIGABRT" in sections["test_size_mismatch"]
    assert re.search(r"[Tt]imed out|[Tt]imeout", sections["test_swap_then_timeout"])
