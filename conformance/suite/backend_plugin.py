"""pytest plugin: ``--backend`` selection, backend parametrization, expected-failure outcomes.

Loaded through the package's ``pytest11`` entry point wherever the package is installed (and by
this repository's root conftest), so ``python -m pytest --pyargs conformance --backend ...`` runs
from any directory; what the ranks need comes from ``pytest_harness_rank_modules``.
This module holds the options and ``pytest_configure``, which resolves every ``--backend`` once
into a :class:`SelectedBackend` (its selection, adapter name, ``module:attr`` target, adapter
class, expectations, origin, and the gate's refusal) and registers the run's one
:class:`ConformanceRun`: it owns the run's state (the selected backends, the matrix, what ran,
what skipped, the stale entries) and every other hook is its method. Every test that takes a
``backend`` argument runs once per admitted backend: the parameter is a
``registry.BackendParam`` (the selection as given, carrying the name and the target), which the
rank-side fixture (``conformance.suite.backend_fixture``) opens from its target, resolving
nothing again; the test id, the matrix column, the JUnit ``backend`` property and the
expectations are the adapter's ``name``. Expected failures are matched by scenario id and
run context (device, torch version, world size); entries that describe nothing the run checked
are reported as stale, and fail the run under ``--strict-expectations``.

The conformance matrix is a report plugin like the harness's own: a distributed scenario's entry
comes from the harness's result (``pytest_harness_test_result``: the verdict as pytest reported
it, why it failed, its REPRO line and collective traces, as data), with what this plugin's
expectations made of it; pytest's reports fill in only what the harness never publishes (tests
without ranks). Every selected test is planned in its cell, so one that never ran is "not run".
"""

from __future__ import annotations

import dataclasses
import fnmatch
import shlex
import sys
import sysconfig
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import conformance
import harness
from conformance.protocol import BackendAdapter, versions
from conformance.report.html import render_html
from conformance.report.matrix import Matrix, RunDetails, classify, classify_status, render_markdown
from conformance.report.trace_view import TraceView
from conformance.suite import expectations, gate, generation, library_sites, registry
from harness import skip_reason as skip_reason_of

# Scenarios are distributed tests: the harness must be there (loading it twice is a no-op).
pytest_plugins = ["harness.plugin"]

_RUN = pytest.StashKey["ConformanceRun"]()
_JUDGED = pytest.StashKey["Judged"]()  # a distributed test's call phase, as the expectations judged it


@dataclass(frozen=True)
class SelectedBackend:
    """One ``--backend`` selection, resolved once in pytest: everything the run needs of it."""

    selection: str
    """As the user gave it (the REPRO line's ``--backend``)."""
    name: str
    """The adapter's ``name``: test ids, reports and expectations."""
    target: str
    """The ``module:attr`` it resolved to (what a rank imports)."""
    adapter_cls: type[BackendAdapter]
    expectations: expectations.Expectations
    origin: str
    """Where it came from (``registry.origin``), for the header."""
    refusal: str | None = None
    """Why it cannot run in this session (``conformance.suite.gate``; only one ``all`` brought in:
    a refused backend the user named stops the run)."""

    @property
    def param(self) -> registry.BackendParam:
        """The value the backend's tests are parametrized with."""
        return registry.BackendParam(self.selection, self.name, self.target)


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


def pytest_harness_rank_modules(config: pytest.Config) -> harness.RankModules:
    """What every rank needs for the scenarios, from the plugin itself (no ini lines of the user's,
    so an installed suite runs from any directory): the ``backend`` rank fixture, the reference
    engine's collective labels, and, in a session that runs the suite, the zygote's preloads."""
    selections = config.getoption("backend") or []
    preload: tuple[str, ...] = ()
    if _session_reaches_suite(config):
        # Imported by the zygote once rather than by each of a run's ~30 ranks (~2 s of CPU each):
        # Dynamo comes with the first optimizer step (torch.optim's `_disable_dynamo`).
        preload = ("torch._dynamo",)
    if any(selection == registry.ALL or "deepspeed" in selection.lower() for selection in selections):
        # DeepSpeed's Muon module calls torch.compile at import (~1 s of CPU per rank). An adapter
        # named by import path that wraps DeepSpeed without saying so costs its ranks that import,
        # never a verdict.
        preload = (*preload, "torch._inductor.compile_fx")
    return harness.RankModules(
        fixtures=("conformance.suite.backend_fixture",),
        label_providers=("engine.collectives:current_label",),
        preload=preload,
    )


def pytest_harness_repro_options() -> dict[str, harness.ReproPolicy]:
    """What a failed test's reproduction does with each option above (tests/harness_tests/test_repro.py
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


def _backend_path_args(item: pytest.Item) -> list[str]:
    return _run_of(item.config).backend_path_args(item)


def _backend_args(item: pytest.Item) -> list[str]:
    return _run_of(item.config).backend_args(item)


def _expectations_dir_args(item: pytest.Item) -> list[str]:
    return _run_of(item.config).expectations_dir_args(item)


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
        selected = select_backends(config)
    except (registry.BackendSelectionError, expectations.ExpectationsError, gate.BackendRefused) as error:
        raise pytest.UsageError(str(error)) from None
    run = config.stash[_RUN] = ConformanceRun(config, selected)
    config.pluginmanager.register(run, "conformance-run")


def _run_of(config: pytest.Config) -> ConformanceRun:
    return config.stash[_RUN]


def _require_harness(config: pytest.Config) -> None:
    """The scenarios run on the harness's rank processes and this plugin reads its options."""
    if config.pluginmanager.is_blocked("harness.plugin") or not config.pluginmanager.has_plugin("harness.plugin"):
        raise pytest.UsageError(
            "the conformance plugin needs the harness plugin, which this session disabled "
            "(-p no:harness.plugin): the scenarios run on the harness's rank processes; drop "
            "-p no:harness.plugin, or also pass -p no:conformance.suite.backend_plugin to run only tests that "
            "need neither"
        )


def select_backends(config: pytest.Config) -> list[SelectedBackend]:
    """Every ``--backend`` selection resolved once (``registry.resolve``), with its expectations
    and the gate's verdict for the device kinds this session's worlds get: one the user named
    that cannot run is a usage error (``gate.BackendRefused``), one `all` brought in is kept with
    its refusal, left out of the run and named in the header."""
    requested = config.getoption("backend") or [registry.DEFAULT]
    explicit = config.getoption("expectations_dir")
    selected: list[SelectedBackend] = []
    for selection, target, adapter_cls in registry.resolve(requested):
        name = adapter_cls.name if ":" in selection else selection
        other = next((backend for backend in selected if backend.name == name), None)
        if other is not None:
            if other.target == target:
                continue  # the same adapter selected twice, by name and by import path
            raise registry.BackendSelectionError(
                f"backends {other.selection!r} and {selection!r} are both named {name!r}; test ids, "
                "reports and expectations are keyed by the adapter's name, so give one of "
                "them another `name`"
            )
        selected.append(
            SelectedBackend(
                selection,
                name,
                target,
                adapter_cls,
                _expectations(adapter_cls, name, explicit),
                registry.origin(selection, target),
            )
        )
    named = [s for s in requested if s != registry.ALL]
    refused = gate.refused_backends(
        {backend.selection: backend.adapter_cls for backend in selected},
        named,
        gate.session_devices(config),
        torch.__version__,
    )
    selected = [dataclasses.replace(backend, refusal=refused.get(backend.selection)) for backend in selected]
    if all(backend.refusal is not None for backend in selected):
        raise gate.BackendRefused("no selected backend can run here: " + "; ".join(refused.values()))
    return selected


def _expectations(adapter_cls: type[BackendAdapter], name: str, explicit: str | None) -> expectations.Expectations:
    """``--expectations-dir`` when given, else the adapter's own file, else the built-in one."""
    if explicit is not None:
        return expectations.load(name, Path(explicit))
    own = expectations.adapter_file(adapter_cls)
    if own is None:
        return expectations.load(name)
    if not own.exists():
        raise expectations.ExpectationsError(
            f"backend {name!r} declares its expectations file {own} (EXPECTATIONS), which does "
            "not exist; ship it with the adapter or drop the attribute"
        )
    return expectations.load_file(name, own)


@pytest.fixture(name="generation")
def generation_fixture(request: pytest.FixtureRequest, backend: str) -> Iterator[generation.Generation]:
    """The session's side of ``conformance/test_generated.py`` for this backend: budget, seed,
    known findings, REPRO lines, progress (``conformance.suite.generation``)."""
    selected = _run_of(request.config).backend_of(request.node)
    if selected is None:
        raise LookupError("the generation fixture serves tests the conformance plugin parametrized with a backend")
    yield from generation.backend_generation(request, backend, selected.name, selected.expectations)


def run_context(item: pytest.Item) -> expectations.RunContext:
    """Device, torch version and world size an item runs with (what ``when`` conditions test):
    the harness's own decision (``harness.run_context``), never a second one."""
    chosen = harness.run_context(item)
    return expectations.RunContext(device=chosen.device, torch_version=torch.__version__, world_size=chosen.world_size)


def _parametrizes_backend_itself(metafunc: pytest.Metafunc) -> bool:
    """A test that parametrizes `backend` itself (a self-test) is left alone."""
    for marker in metafunc.definition.iter_markers("parametrize"):
        names = marker.args[0] if marker.args else marker.kwargs.get("argnames", "")
        if "backend" in ([n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)):
            return True
    return False


# The directory that holds the installed `conformance` package (this repository's root in a clone).
_SUITE_ROOT = Path(conformance.__file__).resolve().parent.parent
_SCENARIO_MODULE_PREFIX = "conformance.test_"


def scenario_file_id(item: pytest.Item) -> str:
    """The file a test is named by in scenario ids, the matrix and expectations: a scenario's own
    module (``conformance/test_x.py``) wherever it was collected from (``--pyargs conformance`` from
    an installed package, a backend repository's ``from conformance.suite.scenarios import *``);
    any other test's file as pytest names it (its path from the root directory)."""
    module_name = getattr(getattr(item, "function", None), "__module__", None) or ""
    if module_name.startswith(_SCENARIO_MODULE_PREFIX):
        return module_name.replace(".", "/") + ".py"
    return item.nodeid.split("::", 1)[0]


def suite_nodeid(item: pytest.Item) -> str:
    """``item.nodeid`` with its file named by :func:`scenario_file_id`."""
    return f"{scenario_file_id(item)}::{item.nodeid.partition('::')[2]}"


def _file_path(file: str, config: pytest.Config) -> Path:
    """Where an expectations entry's file is: under the root directory, else (a scenario module of
    an installed suite) in the installed package."""
    path = config.rootpath / file
    if not path.exists() and file.startswith("conformance/") and (_SUITE_ROOT / file).exists():
        return _SUITE_ROOT / file
    return path


def _scenario(item: pytest.Item) -> str:
    """The matrix row of a test: its file's name and function, without parameters."""
    function = item.nodeid.partition("::")[2]
    return f"{scenario_file_id(item).rsplit('/', 1)[-1]}::{function.split('[')[0]}"


def _shown_path(path: Path, config: pytest.Config) -> str:
    try:
        return str(path.resolve().relative_to(config.rootpath.resolve()))
    except ValueError:
        return str(path)


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


def _covered_files(config: pytest.Config) -> set[Path]:
    """Files and directories the run asked for whole (a ``file::test`` argument covers nothing);
    under ``--pyargs``, a module or package name stands for its file or directory."""
    covered = set()
    for arg in config.args:
        if "::" in arg:
            continue
        path = (config.invocation_params.dir / arg.split("[", 1)[0]).resolve()
        if not path.exists() and config.getoption("pyargs", False):
            path = _module_location(arg) or path
        covered.add(path)
    return covered


def _session_reaches_suite(config: pytest.Config) -> bool:
    """Whether the session selects backends (``--backend``) or its arguments reach the scenario
    modules (the directory of the installed ``conformance`` package, or one holding it)."""
    if config.getoption("backend"):
        return True
    suite = (_SUITE_ROOT / "conformance").resolve()
    for arg in config.args:
        path = (config.invocation_params.dir / arg.split("::", 1)[0].split("[", 1)[0]).resolve()
        if not path.exists() and config.getoption("pyargs", False):
            path = _module_location(arg.split("::", 1)[0]) or path
        if path == suite or suite in path.parents or path in suite.parents:
            return True
    return False


def _module_location(name: str) -> Path | None:
    """The file or package directory of an importable module name (``--pyargs`` arguments)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    origin = Path(spec.origin).resolve()
    return origin.parent if spec.submodule_search_locations else origin


@dataclass(eq=False)  # a plugin is registered by identity
class ConformanceRun:
    """The conformance plugin's state for one pytest run, and its hooks (registered by
    ``pytest_configure`` as the plugin ``conformance-run``)."""

    config: pytest.Config
    selected: list[SelectedBackend]
    """Every selection, in the order given, refused ones included (with their refusal)."""
    record: expectations.RunRecord = field(default_factory=expectations.RunRecord)
    matrix: Matrix | None = None
    skips: dict[str, list[str]] = field(default_factory=dict)
    """Backend name -> the skip reasons of its tests."""
    stale: list[expectations.StaleEntry] = field(default_factory=list)
    library_hints: list[str] = field(default_factory=list)
    """Divergences seen inside a library the adapter's BACKEND_MODULES does not declare (the end-of-run hints)."""
    collected_paths: dict[str, set[Path]] = field(default_factory=dict)
    """A test file id (:func:`scenario_file_id`) -> the files its tests were collected from."""
    incomplete: str | None = None
    """Why the run stopped early (``harness.incomplete_reason``), at session finish."""
    backends: list[SelectedBackend] = field(init=False)
    """The backends that run: the selected ones the gate admitted."""
    _by_name: dict[str, SelectedBackend] = field(init=False)  # asked per test, per phase

    def __post_init__(self) -> None:
        self.backends = [backend for backend in self.selected if backend.refusal is None]
        self._by_name = {backend.name: backend for backend in self.backends}

    def backend_of(self, item: Any) -> SelectedBackend | None:
        """The backend a test was parametrized with by this plugin (None for any other test, a
        self-test that parametrizes ``backend`` itself included)."""
        callspec = getattr(item, "callspec", None)
        value = None if callspec is None else callspec.params.get("backend")
        return self._by_name.get(value.name) if isinstance(value, registry.BackendParam) else None

    def _name(self, item: Any) -> str | None:
        backend = self.backend_of(item)
        return None if backend is None else backend.name

    # -- the session ------------------------------------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        """Before the first test (the harness knows its reports directory only once configured):
        a matrix that could not be written would be lost at the end of the run."""
        directory = Path(harness.reports_dir(self.config))
        harness.require_writable(
            files=[("the conformance matrix", str(directory / name)) for name in ("conformance.md", "conformance.html")]
        )
        self.matrix = Matrix(run=self._run_details())

    def _run_details(self) -> RunDetails:
        """What the matrix pages say about the run, above the matrix."""
        config = self.config
        return RunDetails(
            command=f"cd {shlex.quote(str(config.invocation_params.dir))} && python -m pytest "
            + shlex.join(config.invocation_params.args),
            date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            seed=str(config.getoption("seed", None)),
            torch_version=torch.__version__,
            python_version=sys.version.split()[0],
            backends={backend.name: backend.origin for backend in self.backends},
        )

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        """The suite's versions, the backends, each with where it came from and its expectations
        file, and, for ``--backend all``, the optional built-ins it could not pick up. Said when the
        session selects backends or reaches the scenarios: the plugin loads in every session of an
        environment that has the package, and a project's unrelated tests need none of this."""
        if not _session_reaches_suite(config):
            return []
        lines = [
            versions.version_line(),
            f"conformance backends: {', '.join(backend.name for backend in self.backends)}",
        ]
        for backend in self.backends:
            entries = backend.expectations
            source = (
                f"{_shown_path(entries.source, config)} ({len(entries)} entries)"
                if entries.source is not None and entries.source.exists()
                else "none"
            )
            lines.append(f"  {backend.name}: {backend.origin}; expected failures: {source}")
        if registry.ALL in (config.getoption("backend") or []):
            for name, install in registry.missing_optional().items():
                lines.append(f"  {name}: not installed, left out of 'all' (install: {install})")
        for backend in self.selected:
            if backend.refusal is not None:
                lines.append(f"  {backend.name}: left out of 'all': {backend.refusal}")
        return lines

    # -- collection -------------------------------------------------------------------------
    @pytest.hookimpl(tryfirst=True)  # first, so the backend leads the test id
    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "backend" in metafunc.fixturenames and not _parametrizes_backend_itself(metafunc):
            metafunc.parametrize(
                "backend", [backend.param for backend in self.backends], ids=[backend.name for backend in self.backends]
            )

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        """Note every test collected with a backend, before any deselection (-k, -m, --lf), and the
        file of every other test (an entry naming a test without a backend matches nothing)."""
        for node in report.result:
            if not isinstance(node, pytest.Item):
                continue
            name = self._name(node)
            self.collected_paths.setdefault(scenario_file_id(node), set()).add(node.path.resolve())
            if name is not None:
                self.record.note_collected(name, expectations.scenario_id(suite_nodeid(node), name))
            else:
                self.record.collected_files.add(scenario_file_id(node))

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """Every selected test is planned in its matrix cell: one that never reports is "not run"."""
        if self.matrix is None:
            return
        for item in session.items:
            name = self._name(item)
            if name is not None:
                self.matrix.plan(_scenario(item), name)

    # -- each test --------------------------------------------------------------------------
    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        backend = self.backend_of(item)
        if backend is None:
            return report
        name = backend.name
        scenario = expectations.scenario_id(suite_nodeid(item), name)
        context = run_context(item)
        entry = None
        if report.when == "call":
            matching = backend.expectations.matching(scenario, context)
            if len(matching) > 1:
                judgement = expectations.ambiguous(matching)
            else:
                entry = matching[0] if matching else None
                judgement = expectations.judge(
                    entry, report.outcome, report.longreprtext, harness.ranks_stderr(item) if entry else None
                )
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
            self._record(item, name, report, entry)
        if report.skipped and not getattr(report, "wasxfail", None):
            self.skips.setdefault(name, []).append(skip_reason_of(report))
            # A test this machine cannot run (too few GPUs for --device cuda) says nothing about
            # the entry: only skips of a test that had its devices make an entry stale.
            if context.device is not None or context.world_size is None:
                self.record.note_skipped(name, scenario, context, skip_reason_of(report) or "skipped")
        return report

    def pytest_harness_known_failures(self, item: pytest.Item) -> list[str]:
        """The texts of the one expectation entry describing this test, for its ranks' checks to go
        on past (``harness.check``); none when no entry, or several, describe it."""
        backend = self.backend_of(item)
        if backend is None:
            return []
        scenario = expectations.scenario_id(suite_nodeid(item), backend.name)
        matching = backend.expectations.matching(scenario, run_context(item))
        return list(matching[0].texts) if len(matching) == 1 else []

    def pytest_harness_test_result(self, item: pytest.Item, result: harness.DistributedTestResult) -> None:
        """A distributed scenario's matrix entry: the harness's result (pytest's final verdict, why the
        ranks failed it, its REPRO line and traces) and what the expectations made of its call phase."""
        name = self._name(item)
        if name is None or self.matrix is None:
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
        if failed and result.diverged_at:
            self._note_library_sites(item, name, result)
        self._enter(
            item,
            name,
            outcome,
            result.message,
            reason,
            judged.entry,
            repro=result.repro if failed else "",
            trace=TraceView(result.nodeid, result.traces, result.divergence, result.diverged_at)
            if failed and result.traces
            else None,
        )

    def _note_library_sites(self, item: pytest.Item, name: str, result: harness.DistributedTestResult) -> None:
        """A divergence seen inside a library the adapter does not declare: the hint to declare it."""
        backend = self.backend_of(item)
        if backend is None:
            return
        adapter = backend.adapter_cls
        sites = library_sites.undeclared_library_sites(
            library_sites.divergent_records(result),
            adapter.BACKEND_MODULES,
            adapter.__module__,
            self.config.invocation_params.dir,
        )
        if sites:
            self.library_hints.append(library_sites.describe(item.nodeid, name, adapter.__name__, sites))

    def _record(
        self, item: pytest.Item, name: str, report: pytest.TestReport, entry: expectations.ExpectedFailure | None
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
        self._enter(item, name, outcome, text, reason, entry)

    def _enter(
        self,
        item: pytest.Item,
        name: str,
        outcome: str,
        text: str,
        reason: str,
        entry: expectations.ExpectedFailure | None,
        **failure: Any,
    ) -> None:
        """Record one test in its matrix cell, with where it ran (`failure`: its REPRO line and trace view)."""
        if self.matrix is None:
            return
        context = run_context(item)
        self.matrix.record(
            _scenario(item),
            name,
            item.nodeid,
            outcome,
            text,
            reason=reason,
            link=entry.link if entry else None,
            device=context.device,
            world_size=context.world_size,
            **failure,
        )

    def pytest_harness_suite_properties(self, item: pytest.Item) -> dict[str, str]:
        """Per-rank reports group the scenarios by backend (JUnit: one suite per backend name)."""
        name = self._name(item)
        return {} if name is None else {"backend": name}

    # -- a failed test's REPRO line ---------------------------------------------------------
    def backend_path_args(self, item: pytest.Item) -> list[str]:
        """What makes the failed test's import-path backend importable: every ``--backend-path``
        the run was given (an adapter may import its backend, or a helper, from a second one), each
        absolute since the re-run starts in the root directory, then the adapter module's own
        ``sys.path`` entry when plain pytest would not find it there."""
        backend = self.backend_of(item)
        if backend is None:
            return []
        given = [str(Path(directory).resolve()) for directory in self.config.getoption("backend_path")]
        directories = list(dict.fromkeys([*given, *_import_directories(backend.selection, self.config)]))
        return [arg for directory in directories for arg in ("--backend-path", directory)]

    def backend_args(self, item: pytest.Item) -> list[str]:
        """The one backend the failed test ran with, as it was given."""
        backend = self.backend_of(item)
        return [] if backend is None else ["--backend", backend.selection]

    def expectations_dir_args(self, item: pytest.Item) -> list[str]:
        """The expectations directory when one was given, absolute (the re-run starts in the root directory)."""
        directory = self.config.getoption("expectations_dir")
        if self.backend_of(item) is None or directory is None:
            return []
        return ["--expectations-dir", str(Path(directory).resolve())]

    # -- the end of the run -----------------------------------------------------------------
    def _find_stale(self) -> list[expectations.StaleEntry]:
        config = self.config
        roots = _covered_files(config)

        def covered(file: str) -> bool:
            # Where its tests were collected from (a backend repository's file that star-imports the
            # scenarios covers them), else where the file is.
            paths = self.collected_paths.get(file) or {_file_path(file, config).resolve()}
            return any(path == root or root in path.parents for path in paths for root in roots)

        def never_collected(file: str) -> str | None:
            path = _file_path(file, config)
            if not path.is_file():
                return f"its file {file} does not exist (under {config.rootpath} or the installed suite, {_SUITE_ROOT})"
            patterns = config.getini("python_files")
            if not any(fnmatch.fnmatch(path.name, pattern) for pattern in patterns):
                return f"its file {file} is not a test file (python_files: {' '.join(patterns)})"
            return None

        expected = {backend.name: backend.expectations for backend in self.backends}
        return expectations.stale_entries(expected, self.record, covered, never_collected)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        stale = self.stale = self._find_stale()
        if self.matrix is not None:  # the matrix is written later (pytest_harness_write_reports), without the session
            self.incomplete = harness.incomplete_reason(
                session, sum(sum(c.values()) for c in self.matrix.cells.values())
            )
        if stale and self.config.getoption("strict_expectations") and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_harness_write_reports(self, config: pytest.Config) -> list[str]:
        """The conformance matrix, a report plugin like the harness's own (after ``pytest_sessionfinish``
        has found the stale entries it lists and whether the run stopped early)."""
        matrix = self.matrix
        if matrix is None or not (matrix.cells or matrix.planned or self.stale):
            return []
        matrix.stale = [str(entry) for entry in self.stale]
        matrix.incomplete = self.incomplete
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

    def pytest_harness_summary_lines(self, config: pytest.Config) -> list[str]:
        """The backends this run tested, first in the end-of-run summary (-q hides the header);
        nothing in a session that collected no scenario."""
        if not self.record.collected and not _session_reaches_suite(config):
            return []
        return [f"backends: {', '.join(backend.name for backend in self.backends)}"]

    def pytest_terminal_summary(self, terminalreporter: Any, config: pytest.Config) -> None:
        self._warn_older_protocols(terminalreporter)
        if self.library_hints:
            terminalreporter.section("call sites inside backend libraries", sep="=", yellow=True)
            for line in self.library_hints:
                terminalreporter.write_line(line, yellow=True)
        self._summarise_stale(terminalreporter)

    def _warn_older_protocols(self, terminalreporter: Any) -> None:
        """One warning per backend written for an older protocol: what it does not declare of what
        came later, and how many of this run's scenarios that cost (conformance.protocol.versions)."""
        lines = []
        for backend in self.backends:
            shortfall = versions.shortfall(backend.adapter_cls)
            if shortfall is not None:
                cost = sum(shortfall.costs(reason) for reason in self.skips.get(backend.name, []))
                lines.append(shortfall.describe(backend.name, cost))
        if lines:
            terminalreporter.section("protocol versions", sep="=", yellow=True)
            for line in lines:
                terminalreporter.write_line(line, yellow=True)

    def _summarise_stale(self, terminalreporter: Any) -> None:
        stale = self.stale
        if not stale:
            return
        strict = self.config.getoption("strict_expectations")
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
