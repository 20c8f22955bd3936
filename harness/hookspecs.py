"""Hooks other plugins implement to extend the harness (registered by `harness.plugin`).

Reports: a distributed test's result reaches `pytest_harness_test_result` once, with every rank's
case, when pytest's reports of all its phases are final, whoever decided it: the ranks, the trace
diff, the parent before or instead of any rank (a skip for missing GPUs, a world that could not
start, an argument that cannot be pickled, torchrun mode's "world is unusable", a fixture error), an
interrupt (Ctrl-C, SIGTERM, pytest-timeout under torchrun: published as failed, then the interrupt goes on), and
what other plugins made of the outcome (xfail markers, the conformance expectations). A test that
never started is not published (pytest does not report it either). A new report format is a
plugin implementing this hook and `pytest_harness_write_reports`; the built-in ones are built that
way: the per-rank JUnit files (`harness.report.junit.JUnitReport`), the trace files
(`harness.report.trace_tables.TraceFiles`) and the conformance matrix (`conformance.suite.backend_plugin`). See
docs/architecture.md for a worked example.

Order (pluggy's): implementations are called last registered first, `tryfirst` / `trylast`
aside. The built-in report objects are registered in `harness.plugin`'s `pytest_configure`, after
the plugin modules and the conftest files pytest loads at start, before the conftest files it
finds while collecting; so the call order is: conftest files found while collecting, the trace
files, JUnit, then the plugin modules and initial conftest files, latest loaded first.
The hooks returning values collect every implementation's non-None value in that call order; how
each is merged is said below.
"""

from __future__ import annotations

import pytest

from harness.config.rank_modules import RankModules
from harness.config.repro import ReproPolicy
from harness.report.results import DistributedTestResult


@pytest.hookspec
def pytest_harness_repro_options() -> dict[str, ReproPolicy]:
    """Every option this plugin registers (`--name` for command-line options, the bare name for
    ini options) and whether a failed test's reproduction carries it (`harness.Carried`,
    optionally with the arguments for one test) or not (`harness.NotCarried(reason)`).

    E.g. the conformance plugin carries `--backend` as the one backend the failed test ran with.
    The `REPRO:` line and `--repro` are built from these tables; the arguments of carried options
    follow the call order (the conformance plugin's `--backend-path` before its `--backend`).
    """
    raise NotImplementedError  # a hook specification: pytest collects the implementations


@pytest.hookspec
def pytest_harness_rank_modules(config: pytest.Config) -> RankModules | None:
    """The modules this plugin's tests need in every rank (`harness.RankModules`: rank fixture
    modules, collective label providers, zygote preloads), as the `rank_fixture_modules`,
    `collective_label_providers` and `rank_preload_modules` ini options list a project's own.

    A plugin shipped in a package returns them here, so that it works from any directory without
    ini lines of the user's (the conformance plugin registers its `backend` rank fixture this way).
    Called once, in the harness's `pytest_configure`; the ini file's entries come first, then every
    implementation's in call order, each entry once (`harness.config.rank_modules`). A failed
    test's reproduction loads the same plugins, so these need no carrying.
    """
    raise NotImplementedError


@pytest.hookspec
def pytest_harness_repro_args(item: pytest.Item) -> list[str]:
    """Extra command-line arguments the reproduction line of a failed distributed test needs,
    beyond the declared options (`pytest_harness_repro_options`). Every implementation's list is
    appended, in call order.
    """
    raise NotImplementedError


@pytest.hookspec
def pytest_harness_suite_properties(item: pytest.Item) -> dict[str, str]:
    """Properties that sort this test into a report suite, besides its world size and device.

    E.g. the conformance plugin returns {"backend": "torch-fsdp2"}. Every implementation's dict is
    merged, the first registered plugin's keys first and a later-called value never overriding an
    earlier-called one's; tests with equal properties (and world size, device) share a suite, and
    the values name it (JUnit: `<values>-ws<N>-<device>-rank<r>`, properties listed on the suite).
    """
    raise NotImplementedError


@pytest.hookspec
def pytest_harness_known_failures(item: pytest.Item) -> list[str]:
    """The texts of the failures this plugin expects of a distributed test (the conformance suite:
    its expectations entry's texts). A check of the test (`harness.check`) whose assertion fails
    with one of them is recorded and the test goes on past it; a later failure that none of them
    names fails the rank as a defect behind the known failure (`harness.rank.known_checks`).
    Every implementation's list is concatenated, in call order; an empty list (or none) leaves
    every check as it is written."""
    raise NotImplementedError


@pytest.hookspec
def pytest_harness_test_result(item: pytest.Item, result: DistributedTestResult) -> None:
    """One distributed test's result (`harness.report.results.DistributedTestResult`: pytest's final verdict,
    every rank's case as its per-rank report shows it, the ranks' traces and where they diverged,
    why the ranks failed it and its REPRO line, as data), once per test, after pytest's reports of
    its phases are final. Report plugins serialize it; they do not judge it
    again (the per-rank reconciliation is the harness's, `harness.report.results.rank_cases`)."""
    raise NotImplementedError


@pytest.hookspec
def pytest_harness_write_reports(config: pytest.Config) -> list[str]:
    """The session is over: write what was collected; return the paths written.

    Called once, at the terminal summary when distributed tests ran (the paths are listed
    there, every implementation's list concatenated in call order), otherwise when pytest
    unconfigures; always after `pytest_sessionfinish`.
    """
    raise NotImplementedError


def pytest_harness_summary_lines(config: pytest.Config) -> list[str]:
    """Lines this plugin adds at the top of the end-of-run summary (`harness.report.run_summary`), e.g.
    the conformance plugin's "backends: reference, torch-fsdp2". Called once, at the terminal
    summary; every implementation's lines are shown, one after the other."""
    raise NotImplementedError
