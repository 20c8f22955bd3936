"""Hooks other plugins implement to extend the harness (registered by `harness.plugin`).

Reports: a distributed test's result reaches `pytest_harness_test_result` once, with every rank's
case, whoever decided it: the ranks, the trace diff, or the parent before any rank ran (a skip for
missing GPUs, a world that could not start). Not yet (issue #16): an argument that cannot be
pickled, lockstep's "world is unusable", and an interrupt (pytest-timeout, Ctrl-C) fail the test
before it is published. A new report format is a plugin implementing this hook and
`pytest_harness_write_reports`; the per-rank JUnit files (`harness.junit.JUnitReport`) are built
that way. See docs/architecture.md for a worked example.
"""

from __future__ import annotations

import pytest

from harness.reports import DistributedTestResult
from harness.repro import ReproPolicy


def pytest_harness_repro_options() -> dict[str, ReproPolicy]:
    """Every option this plugin registers (`--name` for command-line options, the bare name for
    ini options) and whether a failed test's reproduction carries it (`harness.repro.Carried`,
    optionally with the arguments for one test) or not (`harness.repro.NotCarried(reason)`).

    E.g. the conformance plugin carries `--backend` as the one backend the failed test ran with.
    The `REPRO:` line and `--repro` are built from these tables.
    """
    raise NotImplementedError  # a hook specification: pytest collects the implementations


def pytest_harness_repro_args(item: pytest.Item) -> list[str]:
    """Extra command-line arguments the reproduction line of a failed distributed test needs,
    beyond the declared options (`pytest_harness_repro_options`). Every implementation's list is
    appended.
    """
    raise NotImplementedError


def pytest_harness_suite_properties(item: pytest.Item) -> dict[str, str]:
    """Properties that sort this test into a report suite, besides its world size and device.

    E.g. the conformance plugin returns {"backend": "torch-fsdp2"}. Every implementation's dict is
    merged; tests with equal properties (and world size, device) share a suite, and the values
    name it (JUnit: `<values>-ws<N>-<device>-rank<r>`, properties listed on the suite).
    """
    raise NotImplementedError


def pytest_harness_test_result(item: pytest.Item, result: DistributedTestResult) -> None:
    """One distributed test's verdict and every rank's case, once per test, before pytest reports it."""
    raise NotImplementedError


def pytest_harness_write_reports(config: pytest.Config) -> list[str]:
    """The session is over: write what was collected; return the paths written.

    Called once, at the terminal summary when distributed tests ran (the paths are listed
    there), otherwise when pytest unconfigures.
    """
    raise NotImplementedError


def pytest_harness_summary_lines(config: pytest.Config) -> list[str]:
    """Lines this plugin adds at the top of the end-of-run summary (`harness.run_summary`), e.g.
    the conformance plugin's "backends: reference, torch-fsdp2". Called once, at the terminal
    summary; every implementation's lines are shown, one after the other."""
    raise NotImplementedError
