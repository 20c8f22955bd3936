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
from conformance.matrix import Matrix, classify, render_html, render_markdown
from harness.plugin import reports_dir

# Scenarios are distributed tests: the harness must be there (loading it twice is a no-op).
pytest_plugins = ["harness.plugin"]

_STATE = pytest.StashKey["BackendSelection"]()
_MATRIX = pytest.StashKey[Matrix]()


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
    config.stash[_MATRIX] = Matrix()


def pytest_report_header(config: pytest.Config) -> str:
    return f"conformance backends: {', '.join(config.stash[_STATE].backends)}"


@pytest.hookimpl(tryfirst=True)  # first, so the backend leads the test id
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames and not _parametrizes_backend_itself(metafunc):
        backends = metafunc.config.stash[_STATE].backends
        metafunc.parametrize("backend", backends, ids=backends)


def _parametrizes_backend_itself(metafunc: pytest.Metafunc) -> bool:
    """A test that parametrizes `backend` itself (a self-test) is left alone."""
    for marker in metafunc.definition.iter_markers("parametrize"):
        names = marker.args[0] if marker.args else marker.kwargs.get("argnames", "")
        if "backend" in ([n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)):
            return True
    return False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    callspec = getattr(item, "callspec", None)
    if callspec is None or "backend" not in callspec.params:
        return report
    selection = callspec.params["backend"]
    if report.when == "call":
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
    if report.when == "call" or report.failed or report.skipped:
        _record(item, selection, report)
    return report


def _record(item: pytest.Item, selection: str, report: pytest.TestReport) -> None:
    """One matrix entry per test: the call phase, or the setup/teardown phase that failed or skipped."""
    skip_reason = report.longrepr[2] if report.skipped and isinstance(report.longrepr, tuple) else ""
    skip_reason = skip_reason.removeprefix("Skipped: ")
    outcome = classify(report.outcome, getattr(report, "wasxfail", None), skip_reason)
    module, _, function = item.nodeid.partition("::")
    scenario = f"{module.rsplit('/', 1)[-1]}::{function.split('[')[0]}"
    text = skip_reason if outcome == "unsupported" else report.longreprtext
    item.config.stash[_MATRIX].record(scenario, selection, item.nodeid, outcome, text)


def pytest_harness_repro_args(item: pytest.Item) -> list[str]:
    callspec = getattr(item, "callspec", None)
    if callspec is None or "backend" not in callspec.params:
        return []
    args = ["--backend", callspec.params["backend"]]
    directory = item.config.getoption("expectations_dir")
    if Path(directory).resolve() != expectations.EXPECTATIONS_DIR.resolve():
        args += ["--expectations-dir", directory]
    return args


def pytest_harness_suite_properties(item: pytest.Item) -> dict[str, str]:
    """Per-rank reports group the scenarios by backend (JUnit: one suite per backend)."""
    callspec = getattr(item, "callspec", None)
    if callspec is None or "backend" not in callspec.params:
        return {}
    return {"backend": str(callspec.params["backend"])}


def pytest_sessionfinish(session: pytest.Session) -> None:
    matrix = session.config.stash.get(_MATRIX, None)
    if matrix is None or not matrix.cells:
        return
    directory = Path(reports_dir(session.config))
    (directory / "conformance.md").write_text(render_markdown(matrix), encoding="utf-8")
    (directory / "conformance.html").write_text(render_html(matrix), encoding="utf-8")
