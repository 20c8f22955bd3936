"""A backend nobody here wrote an adapter for (tests/conformance_tests/tiny_fsdp: its own flat-parameter
name, its own ValueError refusals), through an adapter written from the docs alone: its smoke
scenarios and its misuse scenario pass on what it declares, and the same adapter without its
declared refusals fails that scenario naming what was raised and what was expected."""

from __future__ import annotations

from adapter_testing import run_inner_session

SCENARIOS = """
from conformance.test_smoke import *  # noqa: F403
from conformance.test_unshard_refusals import test_unshard_from_forward_raises  # noqa: F401
"""


def test_an_unseen_backend_is_judged_by_what_it_declares(tmp_path) -> None:
    result = run_inner_session(
        tmp_path,
        SCENARIOS,
        [
            "tests.conformance_tests.tiny_fsdp.adapter:TinyFSDPAdapter",
            "tests.conformance_tests.tiny_fsdp.adapter:TinyHeldToTheSeeds",
        ],
        "-k",
        "tiny-fsdp-undeclared and from_forward or not tiny-fsdp-undeclared",
    )
    output = result.stdout + result.stderr
    assert "5 passed" in output and "1 failed" in output, output
    assert "PASSED test_inner.py::test_unshard_from_forward_raises[tiny-fsdp-ws2]" in output
    assert "FAILED test_inner.py::test_unshard_from_forward_raises[tiny-fsdp-undeclared-ws2]" in output
    assert (
        "tiny-fsdp-undeclared raised ValueError: tiny_fsdp: cannot gather parameters while forward or backward "
        "runs; expected AssertionError matching 'Cannot manually unshard parameters during forward/backward'"
    ) in output
