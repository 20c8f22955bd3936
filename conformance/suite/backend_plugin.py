"""pytest plugin: ``--backend`` selection, backend parametrization, expected-failure outcomes.

Loaded by the root conftest (``pytest_plugins = ["harness.plugin", "conformance.suite.backend_plugin"]``).
Every test that takes a ``backend`` argument runs once per selected backend: the parameter is
the selection as given (the rank-side fixture in ``conformance.suite.backend_fixture`` loads it in each
rank), the test id, the matrix column, the JUnit ``backend`` property and the expectations are
the adapter's ``name`` (``registry.name_of``). Expected failures are matched by scenario id and
run context (device, torch version, world size); entries that describe nothing the run checked
are reported as stale, and fail the run under ``--strict-expectations``.

The conformance matrix is a report plugin like the harness's own: a distributed scenario's entry
comes from the harness's result (``pytest_harness_test_result``: the verdict as pytest reported
it, why it failed, its REPRO line and collective traces, as data), with what this plugin's
expectations made of it; pytest's reports fill in only what the harness never publishes (tests
without ranks). Every selected test is planned in its cell, so one that never ran is "not run".
"""

from __future__ import annotations

import fnmatch
import shlex
import sys
import sysconfig
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import harness
from conformance.protocol import versions
from conformance.report.html import render_html
from conformance.report.matrix import Matrix, RunDetails, classify, classify_status, render_markdown
from conformance.report.trace_view import TraceView
from conformance.suite import expectations, gate, generation, registry
from harness import skip_reason as skip_reason_of

# Scenarios are distributed tests: the harness must be there (loading it twice is a no-op).
pytest_plugins = ["harness.plugin"]

_STATE = pytest.StashKey["BackendSelection"]()
_MATRIX = pytest.StashKey[Matrix]()
_RUN = pytest.StashKey[expectations.RunRecord]()
_STALE = pytest.StashKey["list[expectations.StaleEntry]"]()
_SKIPS = pytest.StashKey["dict[str, list[str]]"]()  # backend name -> skip reasons of its tests
_REFUSED = pytest.StashKey["dict[str, str]"]()  # backend name -> why `all` left it out
_INCOMPLETE = pytest.StashKey[
    "str | None"
]()  # why the run stopped early (harness.incomplete_reason), at session finish
_JUDGED = pytest.StashKey["Judged"]()  # a distributed test's call phase, as the expectations judged it


@dataclass(frozen=True)
class BackendSelection:
    backends: list[str]  # selections, in the order given: the parametrize values
    names: dict[str, str]  # selection -> the adapter's name: test ids, reports, expectations
    expected: dict[str, expectations.Expectations]  # name -> that backend's entries
    origins: dict[str, str]  # name -> where it came from (registry.origin), for the header

    def name(self, selection: str) -> str:
        return self.names[selection]


@dataclass(frozen=True)
class Judged:
    """What the expectations made of a test's call phase, kept on a distributed test's item until
    the harness publishes its result (`pytest_harness_test_result`)."""

    entry: expectations.ExpectedFailure | None
    """The one entry that describes the test here, if any."""
    message: str | None
    """The expectations' own failure ("unexpected pass: ...", "... failed differently ..."), if they failed the test."""


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
        "--backend-path",
        action="append",
        default=[],
        metavar="DIR",
        help=(
            "directory put at the front of sys.path (here and in the ranks) before --backend "
            "'package.module:attr' is imported; it must exist; REPRO lines carry it (default: none)"
        ),
    )
    group.addoption(
        "--expectations-dir",
        default=None,
        metavar="DIR",
        help=(
            "read every backend's expected failures from DIR/<name>.toml (default: the file an "
            f"adapter carries, else {expectations.EXPECTATIONS_DIR}/<name>.toml)"
        ),
    )
    group.addoption(
        "--strict-expectations",
        action="store_true",
        help=(
            "fail the run when an expected-failure entry is stale: its scenario matches no "
            "collected test of a file collected whole, its file does not exist or is no test file, "
            "or its test was skipped (default: stale entries are listed, the run does not fail)"
        ),
    )
    generation.add_options(group)


def pytest_harness_repro_options() -> dict[str, harness.ReproPolicy]:
    """What a failed test's reproduction does with each option above (tests/harness/test_repro.py
    fails when an option is missing here); --backend-path comes first, so --backend can import."""
    return {
        "--backend-path": harness.Carried(_backend_path_args),
        "--backend": harness.Carried(_backend_args),
        "--expectations-dir": harness.Carried(_expectations_dir_args),
        "--strict-expectations": harness.NotCarried(
            "it judges the run's expectation entries as a whole (stale ones), not one test's verdict"
        ),
        **generation.repro_options(),
    }


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "smoke: an adapter's basics in under a minute (conformance/test_smoke.py; -k smoke or -m smoke)",
    )
    _require_harness(config)
    # Ranks take the parent's sys.path with every task, so this reaches them too.
    for directory in reversed(config.getoption("backend_path")):
        if not Path(directory).is_dir():
            raise pytest.UsageError(
                f"--backend-path {directory}: no such directory; pass the directory that holds "
                "the adapter's top-level package (the one 'package.module:attr' imports from)"
            )
        path = str(Path(directory).resolve())
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        config.stash[_STATE] = _admit(config, _select(config))
    except (registry.BackendSelectionError, expectations.ExpectationsError, gate.BackendRefused) as error:
        raise pytest.UsageError(str(error)) from None
    config.stash[_RUN] = expectations.RunRecord()
    config.stash[_SKIPS] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """Before the first test (the harness knows its reports directory only once configured):
    a matrix that could not be written would be lost at the end of the run."""
    directory = Path(harness.reports_dir(session.config))
    harness.require_writable(
        files=[("the conformance matrix", str(directory / name)) for name in ("conformance.md", "conformance.html")]
    )
    session.config.stash[_MATRIX] = Matrix(run=_run_details(session.config, session.config.stash[_STATE]))


def _require_harness(config: pytest.Config) -> None:
    """The scenarios run on the harness's rank processes and this plugin reads its options."""
    if config.pluginmanager.is_blocked("harness.plugin") or not config.pluginmanager.has_plugin("harness.plugin"):
        raise pytest.UsageError(
            "the conformance plugin needs the harness plugin, which this session disabled "
            "(-p no:harness.plugin): the scenarios run on the harness's rank processes; drop "
            "-p no:harness.plugin, or also pass -p no:conformance.suite.backend_plugin to run only tests that "
            "need neither"
        )


def _run_details(config: pytest.Config, state: BackendSelection) -> RunDetails:
    """What the matrix pages say about the run, above the matrix."""
    return RunDetails(
        command=f"cd {shlex.quote(str(config.invocation_params.dir))} && python -m pytest "
        + shlex.join(config.invocation_params.args),
        date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        seed=str(config.getoption("seed", None)),
        torch_version=torch.__version__,
        python_version=sys.version.split()[0],
        backends=dict(state.origins),
    )


def _select(config: pytest.Config) -> BackendSelection:
    backends: list[str] = []
    names: dict[str, str] = {}
    owners: dict[str, str] = {}  # name -> the selection that has it
    for selection in registry.select(config.getoption("backend") or [registry.DEFAULT]):
        name = registry.name_of(selection)
        other = owners.get(name)
        if other is not None:
            if registry.target_of(other) == registry.target_of(selection):
                continue  # the same adapter selected twice, by name and by import path
            raise registry.BackendSelectionError(
                f"backends {other!r} and {selection!r} are both named {name!r}; test ids, "
                "reports and expectations are keyed by the adapter's name, so give one of "
                "them another `name`"
            )
        owners[name] = selection
        backends.append(selection)
        names[selection] = name
    explicit = config.getoption("expectations_dir")
    expected = {names[selection]: _expectations(selection, names[selection], explicit) for selection in backends}
    origins = {names[selection]: registry.origin(selection) for selection in backends}
    return BackendSelection(backends, names, expected, origins)


def _admit(config: pytest.Config, state: BackendSelection) -> BackendSelection:
    """``state`` without the backends that cannot run on the device kinds this session's worlds
    get (conformance.suite.gate): one the user named is a usage error, one `all` brought in is
    left out and named in the header."""
    named = [s for s in config.getoption("backend") or [registry.DEFAULT] if s != registry.ALL]
    refused = gate.refused_backends(
        {selection: registry.load(selection) for selection in state.backends},
        named,
        gate.session_devices(config),
        torch.__version__,
    )
    config.stash[_REFUSED] = {state.names[s]: why for s, why in refused.items()}
    if not refused:
        return state
    kept = [s for s in state.backends if s not in refused]
    if not kept:
        raise gate.BackendRefused("no selected backend can run here: " + "; ".join(refused.values()))
    return BackendSelection(
        kept,
        {s: state.names[s] for s in kept},
        {state.names[s]: state.expected[state.names[s]] for s in kept},
        {state.names[s]: state.origins[state.names[s]] for s in kept},
    )


def _expectations(selection: str, name: str, explicit: str | None) -> expectations.Expectations:
    """``--expectations-dir`` when given, else the adapter's own file, else the built-in one."""
    if explicit is not None:
        return expectations.load(name, Path(explicit))
    own = expectations.adapter_file(registry.load(selection))
    if own is None:
        return expectations.load(name)
    if not own.exists():
        raise expectations.ExpectationsError(
            f"backend {name!r} declares its expectations file {own} (EXPECTATIONS), which does "
            "not exist; ship it with the adapter or drop the attribute"
        )
    return expectations.load_file(name, own)


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The backends, each with where it came from and its expectations file, and, for
    ``--backend all``, the optional built-ins it could not pick up."""
    state = config.stash[_STATE]
    lines = [f"conformance backends: {', '.join(state.names[s] for s in state.backends)}"]
    for selection in state.backends:
        name = state.names[selection]
        entries = state.expected[name]
        source = (
            f"{_shown_path(entries.source, config)} ({len(entries)} entries)"
            if entries.source is not None and entries.source.exists()
            else "none"
        )
        lines.append(f"  {name}: {state.origins[name]}; expected failures: {source}")
    if registry.ALL in (config.getoption("backend") or []):
        for name, install in registry.missing_optional().items():
            lines.append(f"  {name}: not installed, left out of 'all' (install: {install})")
    for name, why in config.stash.get(_REFUSED, {}).items():
        lines.append(f"  {name}: left out of 'all': {why}")
    return lines


def _shown_path(path: Path, config: pytest.Config) -> str:
    try:
        return str(path.resolve().relative_to(config.rootpath.resolve()))
    except ValueError:
        return str(path)


@pytest.hookimpl(tryfirst=True)  # first, so the backend leads the test id
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames and not _parametrizes_backend_itself(metafunc):
        state = metafunc.config.stash[_STATE]
        metafunc.parametrize("backend", state.backends, ids=[state.names[s] for s in state.backends])


def _parametrizes_backend_itself(metafunc: pytest.Metafunc) -> bool:
    """A test that parametrizes `backend` itself (a self-test) is left alone."""
    for marker in metafunc.definition.iter_markers("parametrize"):
        names = marker.args[0] if marker.args else marker.kwargs.get("argnames", "")
        if "backend" in ([n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)):
            return True
    return False


@pytest.fixture(name="generation")
def generation_fixture(request: pytest.FixtureRequest, backend: str) -> Iterator[generation.Generation]:
    """The session's side of ``conformance/test_generated.py`` for this backend: budget, seed,
    known findings, REPRO lines, progress (``conformance.suite.generation``)."""
    state = request.config.stash[_STATE]
    name = state.name(backend)
    yield from generation.backend_generation(request, backend, name, state.expected[name])


def _selection(item: Any) -> str | None:
    callspec = getattr(item, "callspec", None)
    if callspec is None or "backend" not in callspec.params:
        return None
    return callspec.params["backend"]


def _backend_name(item: Any) -> str | None:
    """The adapter name of a test parametrized by the plugin (None for any other test)."""
    selection = _selection(item)
    state = item.config.stash.get(_STATE, None)
    if selection is None or state is None or selection not in state.names:
        return None
    return state.name(selection)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """Note every test collected with a backend, before any deselection (-k, -m, --lf), and the
    file of every other test (an entry naming a test without a backend matches nothing)."""
    for node in report.result:
        name = _backend_name(node) if isinstance(node, pytest.Item) else None
        record = node.config.stash.get(_RUN, None)
        if record is None or not isinstance(node, pytest.Item):
            continue
        if name is not None:
            record.note_collected(name, expectations.scenario_id(node.nodeid, name))
        else:
            record.collected_files.add(node.nodeid.split("::", 1)[0])


def run_context(item: pytest.Item) -> expectations.RunContext:
    """Device, torch version and world size an item runs with (what ``when`` conditions test):
    the harness's own decision (``harness.run_context``), never a second one."""
    chosen = harness.run_context(item)
    return expectations.RunContext(device=chosen.device, torch_version=torch.__version__, world_size=chosen.world_size)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    selection = _backend_name(item)
    if selection is None:
        return report
    scenario = expectations.scenario_id(item.nodeid, selection)
    context = run_context(item)
    entry = None
    if report.when == "call":
        entries = item.config.stash[_STATE].expected.get(selection)
        matching = entries.matching(scenario, context) if entries else []
        if len(matching) > 1:
            judgement = expectations.ambiguous(matching)
        else:
            entry = matching[0] if matching else None
            judgement = expectations.judge(entry, report.outcome, report.longreprtext)
        if judgement is not None:
            report.outcome = judgement.outcome  # type: ignore[assignment]
            if judgement.xfail_reason is not None:
                report.wasxfail = judgement.xfail_reason
            if judgement.message is not None:
                original = report.longreprtext
                report.longrepr = f"{judgement.message}\n\n{original}" if original else judgement.message
        item.stash[_JUDGED] = Judged(entry, judgement.message if judgement is not None else None)
    # A distributed test's entry comes with the harness's result (pytest_harness_test_result).
    if context.world_size is None and (report.when == "call" or report.failed or report.skipped):
        _record(item, selection, report, entry)
    if report.skipped and not getattr(report, "wasxfail", None):
        item.config.stash[_SKIPS].setdefault(selection, []).append(skip_reason_of(report))
        # A test this machine cannot run (too few GPUs for --device cuda) says nothing about
        # the entry: only skips of a test that had its devices make an entry stale.
        if context.device is not None or context.world_size is None:
            item.config.stash[_RUN].note_skipped(selection, scenario, context, skip_reason_of(report) or "skipped")
    return report


def pytest_harness_test_result(item: pytest.Item, result: harness.DistributedTestResult) -> None:
    """A distributed scenario's matrix entry: the harness's result (pytest's final verdict, why the
    ranks failed it, its REPRO line and traces) and what the expectations made of its call phase."""
    selection = _backend_name(item)
    if selection is None or _MATRIX not in item.config.stash:
        return
    judged = item.stash.get(_JUDGED, Judged(None, None))
    outcome = classify_status(result.outcome, result.message if result.outcome == "skipped" else "")
    reason = ""
    if outcome == "expected-fail" and judged.entry is not None:
        reason = judged.entry.reason
    elif outcome == "fail" and judged.message is not None:
        reason = harness.failure_reason(None, judged.message)  # the expectations' verdict, not the ranks'
    elif outcome == "fail":
        reason = harness.failure_reason(result.reason, result.message)
    failed = outcome == "fail"
    _enter(
        item,
        selection,
        outcome,
        result.message,
        reason,
        judged.entry,
        repro=result.repro if failed else "",
        trace=TraceView(result.nodeid, result.traces, result.divergence, result.diverged_at)
        if failed and result.traces
        else None,
    )


def _record(
    item: pytest.Item, selection: str, report: pytest.TestReport, entry: expectations.ExpectedFailure | None
) -> None:
    """The matrix entry of a test without ranks (the harness publishes none), from pytest's
    reports: the call phase, or the setup/teardown phase that failed or skipped."""
    skip_reason = skip_reason_of(report)
    outcome = classify(report.outcome, getattr(report, "wasxfail", None), skip_reason)
    text = skip_reason if outcome == "unsupported" else report.longreprtext
    reason = (
        entry.reason
        if outcome == "expected-fail" and entry
        else harness.failure_reason(None, text)
        if outcome == "fail"
        else ""
    )
    _enter(item, selection, outcome, text, reason, entry)


def _enter(
    item: pytest.Item,
    selection: str,
    outcome: str,
    text: str,
    reason: str,
    entry: expectations.ExpectedFailure | None,
    **failure: Any,
) -> None:
    """Record one test in its matrix cell, with where it ran (`failure`: its REPRO line and trace view)."""
    context = run_context(item)
    item.config.stash[_MATRIX].record(
        _scenario(item),
        selection,
        item.nodeid,
        outcome,
        text,
        reason=reason,
        link=entry.link if entry else None,
        device=context.device,
        world_size=context.world_size,
        **failure,
    )


def _scenario(item: pytest.Item) -> str:
    """The matrix row of a test: its file's name and function, without parameters."""
    module, _, function = item.nodeid.partition("::")
    return f"{module.rsplit('/', 1)[-1]}::{function.split('[')[0]}"


def pytest_collection_finish(session: pytest.Session) -> None:
    """Every selected test is planned in its matrix cell: one that never reports is "not run"."""
    matrix = session.config.stash.get(_MATRIX, None)
    if matrix is None:
        return
    for item in session.items:
        name = _backend_name(item)
        if name is not None:
            matrix.plan(_scenario(item), name)


def _backend_path_args(item: pytest.Item) -> list[str]:
    """What makes the failed test's import-path backend importable (when plain pytest would not find it)."""
    selection = _selection(item)
    if _backend_name(item) is None or selection is None:
        return []
    return [arg for directory in _import_directories(selection, item.config) for arg in ("--backend-path", directory)]


def _backend_args(item: pytest.Item) -> list[str]:
    """The one backend the failed test ran with, as it was given."""
    selection = _selection(item)
    if _backend_name(item) is None or selection is None:
        return []
    return ["--backend", selection]


def _expectations_dir_args(item: pytest.Item) -> list[str]:
    """The expectations directory when one was given, absolute (the re-run starts in the root directory)."""
    directory = item.config.getoption("expectations_dir")
    if _backend_name(item) is None or directory is None:
        return []
    return ["--expectations-dir", str(Path(directory).resolve())]


def _import_directories(selection: str, config: pytest.Config) -> list[str]:
    """For a ``module:attr`` selection, the sys.path entry its module was found in, unless a
    plain ``python -m pytest`` in the root directory finds it anyway (the root directory
    itself, the interpreter's own and site-packages directories)."""
    if ":" not in selection:
        return []
    module = sys.modules.get(selection.partition(":")[0])
    location = getattr(module, "__file__", None)
    if location is None:
        return []
    # A.B.C lives in <entry>/A/B/C.py or <entry>/A/B/C/__init__.py.
    levels = selection.partition(":")[0].count(".") + (Path(location).name == "__init__.py")
    entry = Path(location).resolve().parents[levels]
    standard = {Path(p).resolve() for p in sysconfig.get_paths().values()}
    if entry == config.rootpath.resolve() or entry in standard:
        return []
    return [str(entry)]


def pytest_harness_suite_properties(item: pytest.Item) -> dict[str, str]:
    """Per-rank reports group the scenarios by backend (JUnit: one suite per backend name)."""
    name = _backend_name(item)
    return {} if name is None else {"backend": name}


def _covered_files(config: pytest.Config) -> set[Path]:
    """Files and directories the run asked for whole (a ``file::test`` argument covers nothing)."""
    covered = set()
    for arg in config.args:
        if "::" in arg:
            continue
        covered.add((config.invocation_params.dir / arg.split("[", 1)[0]).resolve())
    return covered


def _stale(config: pytest.Config) -> list[expectations.StaleEntry]:
    roots = _covered_files(config)

    def covered(file: str) -> bool:
        path = (config.rootpath / file).resolve()
        return any(path == root or root in path.parents for root in roots)

    def never_collected(file: str) -> str | None:
        path = config.rootpath / file
        if not path.is_file():
            return f"its file {file} does not exist (under {config.rootpath})"
        patterns = config.getini("python_files")
        if not any(fnmatch.fnmatch(path.name, pattern) for pattern in patterns):
            return f"its file {file} is not a test file (python_files: {' '.join(patterns)})"
        return None

    return expectations.stale_entries(config.stash[_STATE].expected, config.stash[_RUN], covered, never_collected)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    if _STATE not in config.stash:
        return
    stale = config.stash[_STALE] = _stale(config)
    matrix = config.stash.get(_MATRIX, None)
    if matrix is not None:  # the matrix is written later (pytest_harness_write_reports), without the session
        config.stash[_INCOMPLETE] = harness.incomplete_reason(
            session, sum(sum(c.values()) for c in matrix.cells.values())
        )
    if stale and config.getoption("strict_expectations") and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_harness_write_reports(config: pytest.Config) -> list[str]:
    """The conformance matrix, a report plugin like the harness's own (after ``pytest_sessionfinish``
    has found the stale entries it lists and whether the run stopped early)."""
    matrix = config.stash.get(_MATRIX, None)
    stale = config.stash.get(_STALE, [])
    if matrix is None or not (matrix.cells or matrix.planned or stale):
        return []
    matrix.stale = [str(entry) for entry in stale]
    matrix.incomplete = config.stash.get(_INCOMPLETE, None)
    directory = Path(harness.reports_dir(config))
    linked = [failure.test_id for failures in matrix.failures.values() for failure in failures]
    linked += [expected.test_id for expected in matrix.expected_failures]
    matrix.traces = {test_id: path for test_id in linked if (path := harness.trace_report_file(config, test_id))}
    written = []
    for name, text in (
        ("conformance.md", render_markdown(matrix)),
        ("conformance.html", render_html(matrix, str(directory))),
    ):
        (directory / name).write_text(text, encoding="utf-8")
        written.append(str(directory / name))
    return written


def pytest_harness_summary_lines(config: pytest.Config) -> list[str]:
    """The backends this run tested, first in the end-of-run summary (-q hides the header)."""
    state = config.stash.get(_STATE, None)
    return [] if state is None else [f"backends: {', '.join(state.name(s) for s in state.backends)}"]


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    _warn_older_protocols(terminalreporter, config)
    _summarise_stale(terminalreporter, config)


def _warn_older_protocols(terminalreporter: Any, config: pytest.Config) -> None:
    """One warning per backend written for an older protocol: what it does not declare of what
    came later, and how many of this run's scenarios that cost (conformance.protocol.versions)."""
    state = config.stash.get(_STATE, None)
    if state is None:
        return
    lines = []
    for selection in state.backends:
        name = state.name(selection)
        shortfall = versions.shortfall(registry.load(selection))
        if shortfall is not None:
            cost = sum(shortfall.costs(reason) for reason in config.stash[_SKIPS].get(name, []))
            lines.append(shortfall.describe(name, cost))
    if lines:
        terminalreporter.section("protocol versions", sep="=", yellow=True)
        for line in lines:
            terminalreporter.write_line(line, yellow=True)


def _summarise_stale(terminalreporter: Any, config: pytest.Config) -> None:
    stale = config.stash.get(_STALE, [])
    if not stale:
        return
    strict = config.getoption("strict_expectations")
    terminalreporter.section("stale expectations", sep="=", red=strict, yellow=not strict)
    for entry in stale:
        terminalreporter.write_line(str(entry))
    terminalreporter.write_line(
        f"{len(stale)} stale expected-failure entr{'y' if len(stale) == 1 else 'ies'}: remove "
        "or fix them" + ("; --strict-expectations fails the run" if strict else "")
    )
    if strict:
        # pytest's last line counts every key of its stats: a strict run that fails for stale
        # entries alone must not end in "4 passed" with exit status 1.
        noun = "stale expectation" if len(stale) == 1 else "stale expectations"
        terminalreporter.stats.setdefault(f"{noun} (--strict-expectations: run failed)", []).extend(stale)
