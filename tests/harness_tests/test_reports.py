"""Report hooks: a plugin of a few lines receives every distributed test's result with every rank's case.

This is the worked example of docs/architecture.md ("Where a new report format plugs in"): the
inner session's conftest.py is a complete report plugin.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from conftest import SCHEMA, InnerSession

REPORT_PLUGIN = """
import json, os

def pytest_harness_suite_properties(item):
    return {"flavour": "vanilla"}

def pytest_harness_test_result(item, result):
    entry = {
        "nodeid": result.nodeid,
        "outcome": result.outcome,
        "suite": [result.suite.world_size, result.suite.device, [list(p) for p in result.suite.properties]],
        "own_ranks": list(result.own_ranks),
        "cases": {rank: [case.status, case.message, case.stdout] for rank, case in result.cases.items()},
    }
    with open(os.path.join(str(item.config.rootpath), "results.jsonl"), "a") as handle:
        handle.write(json.dumps(entry) + "\\n")

def pytest_harness_write_reports(config):
    path = os.path.join(str(config.rootpath), "written.txt")
    with open(path, "w") as handle:
        handle.write("done\\n")
    return [path]
"""

TESTS = """
import os, pytest

@pytest.mark.world_size(2)
def test_a_pass(rank):
    print(f"hello from rank {rank}")

@pytest.mark.world_size(2)
def test_b_fails_on_rank_1(rank):
    assert rank == 0, "rank 1 disagrees"

@pytest.mark.world_size(2)
def test_c_rank_1_exits(rank):
    if rank == 1:
        os._exit(3)

@pytest.mark.world_size(2)
def test_d_skipped(rank):
    pytest.skip("not today")

def test_e_not_distributed():
    pass
"""


def test_a_report_plugin_receives_every_rank_of_every_distributed_test(inner: InnerSession) -> None:
    inner.write("conftest.py", REPORT_PLUGIN)
    inner.write("test_reported.py", TESTS)
    result = inner.run("-q")
    assert "2 failed, 2 passed, 1 skipped" in result.stdout, result.stdout
    assert "written.txt" in result.stdout  # the paths a report plugin returns are listed in the summary

    entries = [json.loads(line) for line in (inner.directory / "results.jsonl").read_text().splitlines()]
    by_test = {entry["nodeid"].split("::")[1]: entry for entry in entries}
    assert sorted(by_test) == ["test_a_pass", "test_b_fails_on_rank_1", "test_c_rank_1_exits", "test_d_skipped"]
    assert len(entries) == 4  # once per test
    for entry in entries:
        assert entry["suite"] == [2, "cpu", [["flavour", "vanilla"]]]
        assert entry["own_ranks"] == [0, 1]
        assert sorted(entry["cases"]) == ["0", "1"]
    assert by_test["test_a_pass"]["outcome"] == "passed"
    assert by_test["test_a_pass"]["cases"]["1"][2].strip() == "hello from rank 1"
    failed = by_test["test_b_fails_on_rank_1"]
    assert failed["outcome"] == "failed"
    # Every rank's case carries the verdict; what the rank itself did is its message.
    assert failed["cases"]["0"][0] == "failed"
    assert failed["cases"]["0"][1].startswith("failed on another rank (this rank: passed): distributed test failed")
    assert failed["cases"]["1"][0] == "failed" and "rank 1 disagrees" in failed["cases"]["1"][1]
    lost = by_test["test_c_rank_1_exits"]["cases"]["1"]
    assert lost[0] == "failed" and lost[1] == "rank 1 exited with code 3 while running the test"
    assert by_test["test_d_skipped"]["outcome"] == "skipped"
    assert by_test["test_d_skipped"]["cases"]["0"][:2] == ["skipped", "not today"]
    assert (inner.directory / "written.txt").read_text() == "done\n"

    # The built-in JUnit report got the same results and the plugin's suite property.
    for rank in (0, 1):
        SCHEMA.validate(str(inner.junit(rank)))
        (suite,) = ET.parse(inner.junit(rank)).iter("testsuite")
        assert suite.get("name") == f"vanilla-ws2-cpu-rank{rank}"
        properties = {p.get("name"): p.get("value") for p in suite.iter("property")}
        assert properties["flavour"] == "vanilla" and properties["rank"] == str(rank)
        assert "backend" not in properties
        assert suite.get("tests") == "4"
