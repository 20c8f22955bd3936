"""pytest plugin: ``--backend`` selection, backend parametrization, expected-failure outcomes.

Loaded by the root conftest (``pytest_plugins = ["harness.plugin", "conformance.plugin"]``).
Every test that takes a ``backend`` argument runs once per selected backend; the rank-side
fixture in ``conformance.rank_fixtures`` turns the name into an adapter inside each rank.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conformance import expectations, registry

_STATE = pytest.StashKey["BackendSelection"]()


@dataclass(frozen=True)
class BackendSelection:
    backends: list[str]  # selections, in the order given: parametrize values and ids
    expected: dict[str, dict[str, expectations.ExpectedFailure]]  # selection -> scenario -> entry


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("conformance", "FSDP conformance suite")
    group.addoption(
        "--backend",
        action="append",
        default=None,
        metavar="NAME",
        help=(
            "backend to run the conformance scenarios against; repeat for several, 'all' for "
            f"every known one, or 'package.module:attr' for an adapter class (default: "
            f"{registry.DEFAULT}; built-in: {', '.join(registry.BUILTIN)})"
        ),
    )
    group.addoption(
        "--expectations-dir",
        default=str(expectations.EXPECTATIONS_DIR),
        metavar="DIR",
        help="where <backend>.toml expected-failure files are read (default: %(default)s)",
    )


def pytest_configure(config: pytest.Config) -> None:
    try:
        backends = registry.select(config.getoption("backend") or [registry.DEFAULT])
        directory = Path(config.getoption("expectations_dir"))
        expected = {
            selection: expectations.load(registry.expectations_name(selection), directory)
            for selection in backends
        }
    except (registry.BackendSelectionError, expectations.ExpectationsError) as error:
        raise pytest.UsageError(str(error)) from None
    config.stash[_STATE] = BackendSelection(backends, expected)


def pytest_report_header(config: pytest.Config) -> str:
    return f"conformance backends: {', '.join(config.stash[_STATE].backends)}"


@pytest.hookimpl(tryfirst=True)  # first, so the backend leads the test id
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames:
        backends = metafunc.config.stash[_STATE].backends
        metafunc.parametrize("backend", backends, ids=backends)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    callspec = getattr(item, "callspec", None)
    if report.when != "call" or callspec is None or "backend" not in callspec.params:
        return report
    selection = callspec.params["backend"]
    entries = item.config.stash[_STATE].expected.get(selection, {})
    entry = entries.get(expectations.scenario_id(item.nodeid, selection))
    judgement = expectations.judge(entry, report.outcome, report.longreprtext)
    if judgement is not None:
        report.outcome = judgement.outcome  # type: ignore[assignment]
        if judgement.xfail_reason is not None:
            report.wasxfail = judgement.xfail_reason
        if judgement.message is not None:
            original = report.longreprtext
            report.longrepr = f"{judgement.message}\n\n{original}" if original else judgement.message
    return report
