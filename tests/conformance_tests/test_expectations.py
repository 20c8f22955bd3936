"""Expected-failure files: parsing, conditions, scenario ids, outcomes, and stale entries."""

from __future__ import annotations

from pathlib import Path

import pytest
from adapter_testing import run_inner_session  # tests/conformance_tests/adapter_testing.py

from conformance.suite import expectations
from conformance.suite.expectations import (
    Condition,
    Expectations,
    ExpectedFailure,
    Judgement,
    RunContext,
    RunRecord,
)

CPU2 = RunContext(device="cpu", torch_version="2.13.0+cpu", world_size=2)
CUDA2 = RunContext(device="cuda", torch_version="2.11.0+cu128", world_size=2)

ENTRY = ExpectedFailure(
    scenario="conformance/test_runtime.py::test_training[ws2-auto-HYBRID_SHARD]",
    failure="diverge from the single-process oracle",
    reason="known backend bug",
)


def write(directory: Path, backend: str, text: str) -> None:
    expectations.path_for(backend, directory).write_text(text)


@pytest.mark.parametrize(
    ("nodeid", "backend", "scenario"),
    [
        ("t.py::test_a[torch-fsdp2-ws2-auto-FULL_SHARD]", "torch-fsdp2", "t.py::test_a[ws2-auto-FULL_SHARD]"),
        ("t.py::test_a[ws2-torch-fsdp2-auto]", "torch-fsdp2", "t.py::test_a[ws2-auto]"),
        ("t.py::test_a[ws2-torch-fsdp2]", "torch-fsdp2", "t.py::test_a[ws2]"),
        ("t.py::test_a[reference]", "reference", "t.py::test_a"),
        ("t.py::C::test_a[pkg.mod:Cls-x]", "pkg.mod:Cls", "t.py::C::test_a[x]"),
    ],
)
def test_scenario_id_drops_only_the_backend(nodeid: str, backend: str, scenario: str) -> None:
    assert expectations.scenario_id(nodeid, backend) == scenario


def test_scenario_id_rejects_a_node_without_the_backend() -> None:
    with pytest.raises(ValueError, match="does not contain backend id"):
        expectations.scenario_id("t.py::test_a[ws2]", "reference")


def test_expected_failure_with_recorded_text_xfails() -> None:
    judgement = expectations.judge(ENTRY, "failed", "AssertionError: losses diverge from the single-process oracle")
    assert judgement == Judgement("skipped", xfail_reason="expected-fail: known backend bug")


def test_unexpected_pass_fails() -> None:
    judgement = expectations.judge(ENTRY, "passed", "")
    assert judgement is not None and judgement.outcome == "failed"
    assert "unexpected pass" in judgement.message and "remove the entry" in judgement.message


def test_failure_with_other_text_stays_a_failure() -> None:
    judgement = expectations.judge(ENTRY, "failed", "RuntimeError: NCCL timeout")
    assert judgement is not None and judgement.outcome == "failed"
    assert "failed differently" in judgement.message


@pytest.mark.parametrize("outcome", ["passed", "failed", "skipped"])
def test_unlisted_scenarios_and_skips_are_untouched(outcome: str) -> None:
    assert expectations.judge(None, outcome, "anything") is None
    assert expectations.judge(ENTRY, "skipped", "unsupported: x") is None


def test_load_reads_entries(tmp_path: Path) -> None:
    write(
        tmp_path,
        "torch-fsdp1",
        f'''
[[expected_failure]]
scenario = "{ENTRY.scenario}"
failure = "{ENTRY.failure}"
reason = "{ENTRY.reason}"
link = "https://example.invalid/issue/1"
''',
    )
    loaded = expectations.load("torch-fsdp1", tmp_path)
    assert loaded.entries == [ExpectedFailure(**{**vars(ENTRY), "link": "https://example.invalid/issue/1"})]
    assert loaded.matching(ENTRY.scenario, CPU2) == loaded.entries
    assert len(expectations.load("no-file-backend", tmp_path)) == 0


def test_when_limits_an_entry_to_the_runs_it_describes(tmp_path: Path) -> None:
    write(
        tmp_path,
        "torch-fsdp2",
        f'''
[[expected_failure]]
scenario = "{ENTRY.scenario}"
failure = "fp16"
reason = "on CUDA"
when = {{ device = "cuda", torch = ">=2.11, <2.14", world_size = [2, 4] }}

[[expected_failure]]
scenario = "{ENTRY.scenario}"
failure = "other text"
reason = "on CPU"
when = {{ device = "cpu" }}
''',
    )
    loaded = expectations.load("torch-fsdp2", tmp_path)
    cuda, cpu = loaded.entries
    assert cuda.when == Condition(("cuda",), ">=2.11, <2.14", (2, 4))
    assert loaded.matching(ENTRY.scenario, CUDA2) == [cuda]
    assert loaded.matching(ENTRY.scenario, CPU2) == [cpu]
    assert loaded.matching(ENTRY.scenario, RunContext("cuda", "2.14.0", 2)) == []
    assert loaded.matching(ENTRY.scenario, RunContext("cuda", "2.11.1", 8)) == []
    assert loaded.matching(ENTRY.scenario, RunContext(None, "2.11.1", 2)) == []
    assert str(cuda.when) == "device cuda, torch >=2.11, <2.14, world size 2 or 4"


@pytest.mark.parametrize(
    ("condition", "version", "matches"),
    [
        (">=2.11", "2.13.0+cpu", True),
        ("<2.13", "2.13.0+cpu", False),
        ("<2.14", "2.14.0a0+git1234", True),  # a 2.14 pre-release comes before 2.14
        ("==2.13.*", "2.13.1+cu121", True),
        ("==2.13.*", "2.14.0", False),
        ("!=2.12.*", "2.12.0", False),
        (">2.6, !=2.9.0, <=2.10", "2.9.0", False),
        (">2.6, !=2.9.0, <=2.10", "2.10.0+cpu", True),
    ],
)
def test_torch_conditions_compare_public_versions(condition: str, version: str, matches: bool) -> None:
    assert expectations.torch_matches(condition, version) is matches


def test_several_matching_entries_fail_the_test() -> None:
    entries = [ENTRY, ExpectedFailure(**{**vars(ENTRY), "when": Condition(devices=("cpu",))})]
    judgement = expectations.ambiguous(entries)
    assert judgement.outcome == "failed" and "matches 2 expected-failure entries" in judgement.message


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('[[expected_failure]]\nscenario = "a"\nreason = "r"\n', r"missing \['failure'\]"),
        ('[[expected_failure]]\nscenario = "a"\nfailure = "f"\nreason = "r"\nwhy = "w"\n', r"unknown \['why'\]"),
        ('[[expected_failure]]\nscenario = "a"\nfailure = ""\nreason = "r"\n', "non-empty string"),
        ('[[expected_failure]]\nscenario = "a"\nfailure = "f"\nreason = "r"\n' * 2, "listed twice"),
        (
            '[[expected_failure]]\nscenario = "a"\nfailure = "f"\nreason = "r"\nwhen = { device = "cpu" }\n' * 2,
            r"listed twice with the same condition",
        ),
        (
            '[[expected_failure]]\nscenario = "a"\nfailure = "f"\nreason = "r"\nwhen = { device = "tpu" }\n',
            r"when.device \['tpu'\] is not one of",
        ),
        (
            '[[expected_failure]]\nscenario = "a"\nfailure = "f"\nreason = "r"\nwhen = { torch = "2.13" }\n',
            "not a version comparison",
        ),
        (
            '[[expected_failure]]\nscenario = "a"\nfailure = "f"\nreason = "r"\nwhen = { torch = ">=2.*" }\n',
            r"'\.\*' only goes with == or !=",
        ),
        (
            '[[expected_failure]]\nscenario = "a"\nfailure = "f"\nreason = "r"\nwhen = { world_size = 0 }\n',
            "positive int",
        ),
        (
            '[[expected_failure]]\nscenario = "a"\nfailure = "f"\nreason = "r"\nwhen = { gpu = "h100" }\n',
            r"unknown keys \['gpu'\]",
        ),
        ('[[expected_failure]]\nscenario = "a"\nfailure = "f"\nreason = "r"\nwhen = {}\n', "non-empty table"),
        ('[[expected_fail]]\nscenario = "a"\n', "entries go in"),
        ("[[expected_failure]\n", "not valid TOML"),
    ],
)
def test_load_rejects_bad_files(tmp_path: Path, text: str, error: str) -> None:
    write(tmp_path, "vendor", text)
    with pytest.raises(expectations.ExpectationsError, match=error):
        expectations.load("vendor", tmp_path)


def test_reference_may_not_expect_failures(tmp_path: Path) -> None:
    write(tmp_path, "reference", '[[expected_failure]]\nscenario = "a"\nfailure = "f"\nreason = "r"\n')
    with pytest.raises(expectations.ExpectationsError, match="may not have expected failures"):
        expectations.load("reference", tmp_path)


def test_shipped_expectation_files_are_valid() -> None:
    for path in sorted(expectations.EXPECTATIONS_DIR.glob("*.toml")):
        for entry in expectations.load(path.stem):
            assert "::" in entry.scenario, f"{path}: {entry.scenario} is not a scenario id"
            assert (Path(__file__).parents[2] / entry.file).exists(), f"{path}: {entry.file}"


def _record(*collected: str, skipped: tuple[str, RunContext] | None = None) -> RunRecord:
    record = RunRecord()
    for scenario in collected:
        record.note_collected("torch-fsdp2", scenario)
    if skipped is not None:
        record.note_skipped("torch-fsdp2", skipped[0], skipped[1], "unsupported: x: y")
    return record


def test_an_entry_matching_no_collected_test_is_stale_only_if_its_file_was_covered() -> None:
    expected = {"torch-fsdp2": Expectations("torch-fsdp2", [ENTRY])}
    sibling = "conformance/test_runtime.py::test_training[ws4-auto-FULL_SHARD]"
    other_file = "conformance/test_checkpoint.py::test_full_state_dict[ws2-root]"
    stale = expectations.stale_entries(expected, _record(sibling), lambda file: True)
    assert [(s.entry, s.why) for s in stale] == [(ENTRY, "matches no collected test")]
    assert expectations.stale_entries(expected, _record(sibling), lambda file: False) == []
    assert expectations.stale_entries(expected, _record(other_file), lambda file: True) == []
    assert expectations.stale_entries(expected, _record(ENTRY.scenario), lambda file: True) == []


def test_an_entry_no_run_can_collect_is_stale_whatever_the_run_covered() -> None:
    short = ExpectedFailure(**{**vars(ENTRY), "scenario": ENTRY.scenario.removeprefix("conformance/")})
    expected = {"torch-fsdp2": Expectations("torch-fsdp2", [ENTRY, short])}
    record = _record("conformance/test_runtime.py::test_training[ws4-auto-FULL_SHARD]")

    def never_collected(file: str) -> str | None:
        return None if file.startswith("conformance/") else f"its file {file} does not exist"

    stale = expectations.stale_entries(expected, record, lambda file: False, never_collected)
    assert [s.entry for s in stale] == [short]
    assert stale[0].why == (
        "its file test_runtime.py does not exist; a scenario id starts with the test file's path "
        f"from the root directory: {ENTRY.scenario}"
    )


def test_an_entry_copied_from_a_test_id_names_the_scenario_id_to_write() -> None:
    copied = ExpectedFailure(**{**vars(ENTRY), "scenario": ENTRY.scenario.replace("[", "[torch-fsdp2-")})
    expected = {"torch-fsdp2": Expectations("torch-fsdp2", [copied])}
    stale = expectations.stale_entries(expected, _record(ENTRY.scenario), lambda file: True)
    assert [s.why for s in stale] == [
        f"matches no collected test; a scenario id leaves out the backend: {ENTRY.scenario}"
    ]


def test_an_entry_whose_test_was_skipped_is_stale_when_its_condition_held() -> None:
    cuda_only = ExpectedFailure(**{**vars(ENTRY), "when": Condition(devices=("cuda",))})
    for entry, context, is_stale in ((ENTRY, CPU2, True), (cuda_only, CPU2, False), (cuda_only, CUDA2, True)):
        expected = {"torch-fsdp2": Expectations("torch-fsdp2", [entry])}
        record = _record(ENTRY.scenario, skipped=(ENTRY.scenario, context))
        stale = expectations.stale_entries(expected, record, lambda file: True)
        assert [s.why for s in stale] == (["its test was skipped (unsupported: x: y)"] if is_stale else [])


# -- the rank's stderr: what a rank that dies in C++ says -------------------------------------
STDERR_TESTS = """
import os
import sys

import pytest


@pytest.mark.world_size(2)
def test_raises_after_saying_why(backend, rank):
    sys.stderr.write(f"rank {rank}: the library says: Received data size doesn't match expected size\\n")
    sys.stderr.flush()
    raise AssertionError("the step failed")


@pytest.mark.world_size(2)
def test_dies_after_saying_why(backend, rank):
    # What gloo does on a size mismatch: a message from C++ on stderr, then abort().
    os.write(2, b"terminate called: [enforce fail] Received data size doesn't match expected size\\n")
    os.abort()
"""


STDERR_REASON = "the library says so on stderr"


def _stderr_entries(failure: str) -> str:
    return "".join(
        f'[[expected_failure]]\nscenario = "test_inner.py::{name}"\nfailure = "{failure}"\n'
        f'reason = "{STDERR_REASON}"\n\n'
        for name in ("test_raises_after_saying_why", "test_dies_after_saying_why")
    )


@pytest.mark.parametrize(
    ("failure", "in_stderr"),
    [("Received data size doesn't match", True), ("a text no rank wrote", False)],
    ids=["in-stderr", "nowhere"],
)
def test_an_expected_failure_text_is_matched_against_the_ranks_stderr(
    tmp_path: Path, failure: str, in_stderr: bool
) -> None:
    """A rank that says why only on stderr (a Python rank printing a library's message, a rank
    gloo aborts) still meets its expected-failure entry, reported with the entry's reason; a
    text found nowhere stays a failure that says where it was looked for."""
    (tmp_path / "expectations").mkdir()
    (tmp_path / "expectations" / "torch-zero.toml").write_text(_stderr_entries(failure))
    done = run_inner_session(tmp_path, STDERR_TESTS, ["torch-zero"], "--straggler-grace=2")
    output = done.stdout + done.stderr
    if in_stderr:  # both tests known failures, each reported with the entry's reason
        assert "2 xfailed" in output and output.count(f"expected-fail: {STDERR_REASON}") >= 2, output
    else:
        assert "2 failed" in output, output
        assert "is not in the failure nor in the stderr of ranks [0, 1]" in output, output
