"""Expected-failure files: parsing, scenario ids, and how outcomes change."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance import expectations
from conformance.expectations import ExpectedFailure, Judgement

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
    write(tmp_path, "torch-fsdp1", f'''
[[expected_failure]]
scenario = "{ENTRY.scenario}"
failure = "{ENTRY.failure}"
reason = "{ENTRY.reason}"
link = "https://example.invalid/issue/1"
''')
    loaded = expectations.load("torch-fsdp1", tmp_path)
    assert loaded == {ENTRY.scenario: ExpectedFailure(**{**vars(ENTRY), "link": "https://example.invalid/issue/1"})}
    assert expectations.load("no-file-backend", tmp_path) == {}


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('[[expected_failure]]\nscenario = "a"\nreason = "r"\n', r"missing \['failure'\]"),
        ('[[expected_failure]]\nscenario = "a"\nfailure = "f"\nreason = "r"\nwhy = "w"\n', r"unknown \['why'\]"),
        ('[[expected_failure]]\nscenario = "a"\nfailure = ""\nreason = "r"\n', "non-empty string"),
        ('[[expected_failure]]\nscenario = "a"\nfailure = "f"\nreason = "r"\n' * 2, "listed twice"),
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
        entries = expectations.load(path.stem)
        for entry in entries.values():
            assert "::" in entry.scenario, f"{path}: {entry.scenario} is not a scenario id"
