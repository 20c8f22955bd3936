"""A known finding never hides a defect behind it (issue 40, item 6).

In process: the rank's ledger (`harness.rank.known_checks`) goes on past a check that fails with
a known text, stops at a library's exception, and turns a later unknown failure into
`DefectBehindKnownFailure`; the expectations judge fails that whatever the entry says, and
insists on every `also` text. End to end: the real `test_optim_state_dict_round_trip` against a
backend whose optimizer state dict has wrongly named keys (recorded as its known failure) is an
expected failure; its twin that also ignores the loaded state (FairScale's no-op load, which the
first failed check hid before) fails, naming the read-back check.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.suite import expectations
from harness import DEFECT_BEHIND_KNOWN_FAILURE, DefectBehindKnownFailure, KnownFailuresSeen, check
from harness.rank import known_checks
from tests.conformance_tests.adapter_testing import run_inner_session

KNOWN = "optimizer state keyed by"


def _scenario(*failures: str) -> list[str]:
    """Three checks in a row, the ones named in ``failures`` failing; what ran after each."""
    ran = []
    for name in ("first", "second", "third"):
        with check(name):
            ran.append(name)
            assert name not in failures, f"{name}: {KNOWN} the wrong names" if name == "first" else f"{name} broke"
    return ran


def test_without_known_texts_a_check_raises_as_written() -> None:
    with pytest.raises(AssertionError, match="first: optimizer state keyed by"):
        _scenario("first")


def test_a_known_failure_is_gone_past_and_reported_at_the_end() -> None:
    with known_checks.known_failures((KNOWN,)):
        assert _scenario("first") == ["first", "second", "third"]
        with pytest.raises(KnownFailuresSeen, match="check 'first' failed as expected: first: optimizer state"):
            known_checks.finish_body(None)


def test_an_unknown_failure_behind_a_known_one_is_a_defect() -> None:
    with known_checks.known_failures((KNOWN,)), pytest.raises(DefectBehindKnownFailure) as raised:
        _scenario("first", "third")
    text = str(raised.value)
    assert DEFECT_BEHIND_KNOWN_FAILURE in text and "third broke" in text and "check 'first'" in text, text


def test_an_unknown_failure_with_nothing_known_before_stays_itself() -> None:
    with known_checks.known_failures((KNOWN,)), pytest.raises(AssertionError, match="second broke") as raised:
        _scenario("second")
    assert not isinstance(raised.value, DefectBehindKnownFailure)


def test_a_library_exception_is_not_gone_past() -> None:
    """A KeyError in a check stops the test (its peers may be mid-collective); after a known
    check it is a defect unless its text is known too."""
    with known_checks.known_failures((KNOWN,)):
        with pytest.raises(KeyError), check("load"):
            raise KeyError(f"{KNOWN} nothing")
        with check("first"):
            raise AssertionError(f"{KNOWN} the wrong names")
        error = KeyError("exp_avg")
        with pytest.raises(DefectBehindKnownFailure, match="KeyError: 'exp_avg'"):
            known_checks.finish_body(error)
    with known_checks.known_failures((KNOWN, "'exp_avg'")):
        with check("first"):
            raise AssertionError(f"{KNOWN} the wrong names")
        with pytest.raises(KnownFailuresSeen, match="then, as expected, it stopped at: KeyError: 'exp_avg'"):
            known_checks.finish_body(KeyError("exp_avg"))


ENTRY = expectations.ExpectedFailure(
    scenario="f.py::t", failure=KNOWN, reason="renames its optimizer state keys", also=("read back",)
)


def test_the_judge_fails_a_defect_behind_whatever_the_entry_says() -> None:
    text = f"{KNOWN} x\nread back y\n{DEFECT_BEHIND_KNOWN_FAILURE}: z"
    judgement = expectations.judge(ENTRY, "failed", text)
    assert judgement is not None and judgement.outcome == "failed"
    assert "went on past it and failed again" in (judgement.message or "")


def test_the_judge_wants_every_also_text() -> None:
    seen = expectations.judge(ENTRY, "failed", f"{KNOWN} x\nread back y")
    assert seen is not None and seen.xfail_reason == f"expected-fail: {ENTRY.reason}", seen
    assert seen.outcome == "skipped"  # pytest's form of an xfail, with the entry's reason above
    unseen = expectations.judge(ENTRY, "failed", f"{KNOWN} x")
    assert unseen is not None and unseen.outcome == "failed"
    assert "['read back'] not in the failure" in (unseen.message or "")


def test_also_must_be_a_list_of_texts(tmp_path: Path) -> None:
    path = tmp_path / "b.toml"
    path.write_text('[[expected_failure]]\nscenario = "f.py::t"\nfailure = "x"\nreason = "r"\nalso = "y"\n')
    with pytest.raises(expectations.ExpectationsError, match="'also' must be a list of non-empty texts"):
        expectations.load_file("b", path)


# -- end to end: the round trip scenario ------------------------------------------------------
ADAPTERS = '''
from typing import Any

from conformance.adapters.reference import ReferenceAdapter

PREFIX = "renamed."


class KeyedOptimAdapter(ReferenceAdapter):
    """Its optimizer state dict names every parameter with a prefix (the known bug) and its load
    takes the prefix off again: the round trip itself is right."""

    name = "keyed-optim"

    def _optim_state_dict(self, model, optim, kind) -> dict[str, Any]:
        state = super()._optim_state_dict(model, optim, kind)
        return {**state, "state": {PREFIX + fqn: value for fqn, value in state["state"].items()}}

    def _load_optim_state_dict(self, model, optim, state_dict, kind) -> None:
        plain = {fqn[len(PREFIX):]: value for fqn, value in state_dict["state"].items()}
        super()._load_optim_state_dict(model, optim, {**state_dict, "state": plain}, kind)


class KeyedNoOpLoadAdapter(KeyedOptimAdapter):
    """The same, and its load does nothing (the defect behind the known one)."""

    name = "keyed-optim-noop-load"

    def _load_optim_state_dict(self, model, optim, state_dict, kind) -> None:
        return None
'''

SCENARIO = "from conformance.test_checkpoint import test_optim_state_dict_round_trip  # noqa: F401\n"
CASE = "ws2-auto-full-no_param_offload-FULL_SHARD"
REASON = "names its optimizer state with a prefix"


def _entry(backend: str) -> str:
    return (
        f'[[expected_failure]]\nscenario = "conformance/test_checkpoint.py::test_optim_state_dict_round_trip[{CASE}]"\n'
        f'failure = "{KNOWN}"\nreason = "{REASON}"\n'
    )


@pytest.mark.parametrize(
    ("adapter", "name", "hidden"),
    [("KeyedOptimAdapter", "keyed-optim", False), ("KeyedNoOpLoadAdapter", "keyed-optim-noop-load", True)],
    ids=["known-only", "defect-behind"],
)
def test_a_known_failure_no_longer_hides_a_no_op_load(tmp_path: Path, adapter: str, name: str, hidden: bool) -> None:
    """Before the ledger both were 'expected failures': the key check failed first and the
    scenario stopped. Now the scenario goes on past it: the backend with only the known bug is
    still one, the one whose load does nothing fails at the optimizer state read back."""
    (tmp_path / "known_adapters.py").write_text(ADAPTERS)
    (tmp_path / "expectations").mkdir()
    (tmp_path / "expectations" / f"{name}.toml").write_text(_entry(name))
    done = run_inner_session(
        tmp_path,
        SCENARIO,
        [f"known_adapters:{adapter}"],
        "--backend-path",
        str(tmp_path),
        "-k",
        CASE,
    )
    output = done.stdout + done.stderr
    if not hidden:
        assert f"expected-fail: {REASON}" in output, output  # the entry's reason, then the count
        assert "1 xfailed" in output, output
        # The rank went on past the key check to the end (its per-rank report says so).
        rank_report = (tmp_path / "reports" / "junit" / "rank-0.xml").read_text()
        assert "check &apos;optimizer state keyed by parameter FQNs&apos; failed as expected" in rank_report or (
            "check 'optimizer state keyed by parameter FQNs' failed as expected" in rank_report
        ), rank_report
    else:
        assert "1 failed" in output, output
        assert "went on past it and failed again" in output, output
        assert "optimizer state read back after loading" in output, output
