"""The pytest side of the harness: options, markers, dispatch of distributed tests to warm pools.

Selection, parametrization and reporting stay in the parent, so `-k`, `-x`, `--lf`,
pytest-timeout and `--junitxml` keep working; only the body of a test marked
`@pytest.mark.world_size(N)` is shipped to the N ranks of a warm pool (pytest-timeout's limit for
such a test becomes its ranks' deadline: `harness.config.deadlines`).

Every distributed test pytest reports is published to the report hooks once its report is final
(`pytest_runtest_protocol` below), whatever decided it. SIGTERM ends the session like Ctrl-C
(`harness.config.signals`).

A test without the marker runs here, in the parent, and may still run functions on ranks: the
`spmd_world` fixture gives it parent-side SPMD calls on the same warm pools (`harness.session.spmd`).
"""

from __future__ import annotations

import atexit
import importlib
import os
import types
from collections.abc import Callable, Generator
from typing import Any

import pytest

from harness import hookspecs
from harness.config import devices, preflight, repro, world_sizes
from harness.config.deadlines import PYTEST_TIMEOUT_PLUGIN, PytestTimeoutBridge
from harness.config.devices import DEVICE_CHOICES, DevicePlan, DeviceTally, RunContext, visible_gpu_count
from harness.config.rank_modules import session_rank_modules
from harness.config.signals import SignalGuard
from harness.config.torchrun import torchrun_world
from harness.config.world_sizes import world_size_of  # also imported from here by other plugins
from harness.rank import rank_fixtures
from harness.report.junit import JUnitReport
from harness.report.run_summary import RunSummary
from harness.report.trace_tables import TraceFiles
from harness.session.flow import HarnessSession, session_properties, verdict_reason
from harness.session.pool_session import PoolSession
from harness.session.spmd import SpmdWorld, open_world

_SESSION = pytest.StashKey["HarnessSession"]()
_SIGNALS = pytest.StashKey[SignalGuard]()
_DEVICES = pytest.StashKey[DeviceTally]()
_PLAN = pytest.StashKey[DevicePlan]()  # per item: the device decision, made once
_JUNIT_PLUGIN = "harness-junit"
_TRACES_PLUGIN = "harness-traces"
_SUMMARY_PLUGIN = "harness-run-summary"
_PYTEST_TIMEOUT_BRIDGE = "harness-pytest-timeout"


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("harness", "distributed test harness (warm rank pools)")
    group.addoption(
        "--device",
        choices=DEVICE_CHOICES,
        default="auto",
        help="cuda: one GPU + NCCL per rank (skip when too few GPUs); cpu: gloo; "
        "auto: cuda when enough GPUs exist (default: %(default)s)",
    )
    group.addoption(
        "--world-sizes",
        metavar="N,M,...",
        default=None,
        help="run distributed tests at these world sizes, as far as each test's world_size marker allows "
        "(default: each test's own sizes; constrained tests without defaults run at 1,2,4 and, with CUDA, "
        "at the number of visible GPUs); under torchrun the world size is WORLD_SIZE",
    )
    group.addoption(
        "--seed", type=int, default=1234, help="seed every rank gets before each test (default: %(default)s)"
    )
    group.addoption(
        "--collective-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="process-group timeout: a rank stuck in a collective fails after it (default: %(default)s s)",
    )
    group.addoption(
        "--test-timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="parent deadline per distributed test, from the task's dispatch; hung ranks are stack-dumped and "
        "killed; pytest-timeout's limit for a test (--timeout, ini timeout, PYTEST_TIMEOUT, "
        "@pytest.mark.timeout) replaces it (default: %(default)s s)",
    )
    group.addoption(
        "--straggler-grace",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="how long the other ranks get to finish once one rank has failed (default: %(default)s s)",
    )
    group.addoption(
        "--repro",
        metavar="NODEID",
        default=None,
        help="re-run a distributed test that failed earlier with the same seed, world size, device, "
        "timeouts and plugin options (e.g. --backend), and print its collective traces (default: none)",
    )
    group.addoption(
        "--show-traces", action="store_true", help="print every rank's collective trace after each distributed test"
    )
    group.addoption(
        "--check-replicas",
        action="store_true",
        help="after each distributed test, compare across ranks what its models keep replicated (DDP, "
        "DTensor Replicate(), FSDP1 NO_SHARD / HYBRID_SHARD, plain parameters whose gradients were all-reduced "
        "whole) and fail a test whose replicas differ; per test: @pytest.mark.check_replicas (False opts out)",
    )
    group.addoption(
        "--fresh-groups",
        action="store_true",
        help="create every process group a test asks for anew and destroy it after the test (default: a warm "
        "rank keeps the groups and meshes a test created and hands them to later tests that request the same "
        "members and options, so a session does not create thousands of communicators)",
    )
    group.addoption(
        "--reports-dir",
        metavar="DIR",
        default=None,
        help="where the reports go: junit/rank-<r>.xml, traces/, conformance.md and .html (default: "
        "reports/ in the directory pytest was started from)",
    )
    parser.addini(
        "rank_fixture_modules",
        type="linelist",
        default=[],
        help="modules that register rank-side fixtures with harness.rank_fixture",
    )
    parser.addini(
        "rank_preload_modules",
        type="linelist",
        default=[],
        help="modules the session's zygote imports once before forking ranks (besides the rank fixture "
        "and label provider modules), so that no rank pays their import; their import-time code sees "
        "the session's environment, not a rank's",
    )
    parser.addini(
        "collective_label_providers",
        type="linelist",
        default=[],
        help="module:attr callables returning a label (e.g. unit FQNs) for the collective being issued",
    )


def pytest_harness_repro_options() -> dict[str, repro.ReproPolicy]:
    """What a failed test's reproduction does with each option above (tests/harness_tests/test_repro.py
    fails when an option is missing here)."""
    return {
        "--device": repro.Carried(),
        "--seed": repro.Carried(),
        "--collective-timeout": repro.Carried(),
        "--test-timeout": repro.Carried(),
        "--straggler-grace": repro.Carried(),
        "--world-sizes": repro.Carried(world_sizes.repro_args),  # the failed test's own size, if chosen
        "--repro": repro.NotCarried("it starts the reproduction; the re-run is the recorded command"),
        "--show-traces": repro.NotCarried("it only prints traces (a --repro re-run prints them anyway)"),
        "--check-replicas": repro.Carried(),  # a drift fails the test
        # A failure that only shows on a kept group (or only on a fresh one) reproduces either way:
        # a --repro re-run starts fresh ranks, and with the option it keeps nothing.
        "--fresh-groups": repro.Carried(),
        "--reports-dir": repro.NotCarried(
            "it only says where reports go; a --repro re-run writes to its own --reports-dir or "
            "reports/repro, never over the reports of the run it reproduces"
        ),
        "rank_fixture_modules": repro.CARRIED_BY_INI,
        "rank_preload_modules": repro.CARRIED_BY_INI,
        "collective_label_providers": repro.CARRIED_BY_INI,
    }


def pytest_configure(config: pytest.Config) -> None:
    preflight.refuse_parallel_workers(config)
    if config.option.repro:
        repro.reexec_recorded(config, config.option.repro)
    torchrun = torchrun_world()
    world_sizes.configure(config, visible_gpu_count(), torchrun)
    config.stash[_DEVICES] = DeviceTally(config.option.device)
    config.addinivalue_line("markers", "fresh_world: run the test on brand-new rank processes")
    config.addinivalue_line(
        "markers",
        "fresh_groups: the test's process groups are created anew and destroyed after it, and the groups earlier "
        "tests kept for reuse are destroyed with them (the default is --fresh-groups)",
    )
    config.addinivalue_line(
        "markers",
        "expect_divergence: ranks issue different collectives on purpose; the trace diff does not fail the test",
    )
    config.addinivalue_line(
        "markers",
        "check_replicas(enabled=True): after the body, compare across ranks what the test's models keep replicated "
        "and fail the test when replicas differ (the default is --check-replicas)",
    )
    for name in ("collective_timeout", "test_timeout", "straggler_grace"):
        value = getattr(config.option, name)
        if value <= 0:
            raise pytest.UsageError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {value}")
    modules = session_rank_modules(config)
    for module in modules.fixtures:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise pytest.UsageError(
                f"rank fixture module {module!r} (from the rank_fixture_modules ini option or a plugin's "
                f"pytest_harness_rank_modules) cannot be imported ({error}); fix the module name or make "
                "the module importable"
            ) from error
    _register_placeholders(config)
    reports_dir = preflight.reports_directory(config.getoption("reports_dir"), str(config.invocation_params.dir))
    preflight.require_writable(
        directories=[
            ("the per-rank JUnit files", os.path.join(reports_dir, "junit")),
            ("the collective traces of failed tests", os.path.join(reports_dir, "traces")),
        ]
    )
    session: HarnessSession
    if torchrun is not None:
        # Imported only here: a pool parent never loads the rank-side runner, nor through it
        # the module that patches torch.distributed.
        from harness.session.torchrun_session import TorchrunSession

        session = TorchrunSession(config, modules, reports_dir, torchrun)
    else:
        session = PoolSession(config, modules, reports_dir)
        if config.pluginmanager.has_plugin(PYTEST_TIMEOUT_PLUGIN):
            # Its limit for a distributed test becomes the ranks' deadline; its timer stays off
            # while the pool runs the test (under torchrun the body runs here: left as it is).
            config.pluginmanager.register(PytestTimeoutBridge(config), _PYTEST_TIMEOUT_BRIDGE)
    config.stash[_SESSION] = session
    atexit.register(session.kill_all)
    guard = SignalGuard()
    guard.install()
    config.stash[_SIGNALS] = guard
    # The built-in reports, registered like any other report plugin (as pytest registers junitxml).
    config.pluginmanager.register(
        JUnitReport(os.path.join(reports_dir, "junit"), session_properties(config), torchrun), _JUNIT_PLUGIN
    )
    config.pluginmanager.register(TraceFiles(os.path.join(reports_dir, "traces")), _TRACES_PLUGIN)
    config.pluginmanager.register(RunSummary(config, reports_dir, session.summary, verdict_reason), _SUMMARY_PLUGIN)


# -- the public API for other plugins (re-exported by `harness`) ---------------------------
def reports_dir(config: pytest.Config) -> str:
    """Where this session writes its reports (other plugins put theirs beside the JUnit files)."""
    return config.stash[_SESSION].reports_dir


def run_context(item: pytest.Item) -> RunContext:
    """The world size and device the harness chose for `item` (the ones its ranks run with)."""
    size = world_size_of(item)
    return RunContext(size, None if size is None else _plan(item, size).kind)


def ranks_stderr(item: pytest.Item) -> dict[int, str]:
    """What each rank of `item` wrote to stderr (see `harness.session.flow.ranks_stderr`)."""
    from harness.session import flow

    return flow.ranks_stderr(item)


def world_device(config: pytest.Config, world_size: int | None = None) -> str | None:
    """The device kind a world of `world_size` ranks gets in this session, None when it cannot be
    had (`--device cuda` with too few GPUs); by default the session's smallest world: one rank,
    or under torchrun the whole torchrun world."""
    torchrun = torchrun_world()
    size = world_size if world_size is not None else (torchrun.world_size if torchrun else 1)
    return devices.plan_world(config.option.device, size, torchrun).kind


def device_kinds(config: pytest.Config) -> tuple[str, ...]:
    """Every device kind this session's worlds may get (`--device auto` with GPUs: cuda and cpu)."""
    return devices.device_kinds(config.option.device, torchrun_world())


@pytest.fixture(scope="session")
def spmd_world(request: pytest.FixtureRequest) -> Callable[[int], SpmdWorld]:
    """`spmd_world(n)`: the `harness.SpmdWorld` of n ranks on this session's device, for a test that
    runs in the pytest process (no world_size marker) and calls functions on the ranks.

    Session-scoped (a factory: it holds no ranks), so Hypothesis tests may use it. A world that
    cannot be had skips the calling test: under torchrun, or where the device lacks (its reason)."""
    config = request.config

    def world(world_size: int) -> SpmdWorld:
        # Noted like a distributed test's plan: a session whose worlds all lacked their device fails.
        return open_world(config.stash.get(_SESSION, None), world_size, config.stash[_DEVICES].note)

    return world


def _plan(item: pytest.Item, world_size: int) -> DevicePlan:
    """The device decision for `item`, made once and kept on it: dispatch, reports and other
    plugins (through `run_context`) all see the same."""
    plan = item.stash.get(_PLAN, None)
    if plan is None:
        session = item.config.stash.get(_SESSION, None)
        if session is not None:
            plan = session.plan(world_size)
        else:
            plan = devices.plan_world(item.config.option.device, world_size, torchrun_world())
        item.stash[_PLAN] = plan
    return plan


def _register_placeholders(config: pytest.Config) -> None:
    """Parent-side stand-ins for rank fixtures, so pytest's fixture resolution is satisfied.

    A distributed test gets a placeholder string it never sees (its body runs in the ranks). A
    test without a `world_size` marker would run in this process with that string as its rank
    or device, and could pass having run nothing distributed: it errors instead, naming the fix.
    """
    holder = types.ModuleType("harness_rank_fixture_placeholders")
    for name in rank_fixtures.registered_names():

        def placeholder(request: pytest.FixtureRequest, _name: str = name) -> str:
            if not world_sizes.is_distributed(request.node):
                pytest.fail(
                    f"{request.node.nodeid} asks for the rank-side fixture {_name!r} but has no world_size "
                    f"marker, so it would run in the pytest process with a placeholder for {_name!r}: mark it "
                    "@pytest.mark.world_size(N) to run it on N ranks",
                    pytrace=False,
                )
            return f"<rank-side fixture {_name}>"

        setattr(holder, f"rank_fixture_{name}", pytest.fixture(name=name)(placeholder))
    config.pluginmanager.register(holder, "harness-rank-fixture-placeholders")


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Where the reports go: the directory pytest was started from unless --reports-dir says otherwise
    (a suite run from an installed package writes into the user's directory, never site-packages)."""
    session = config.stash.get(_SESSION, None)
    if session is None:
        return []
    directory = session.reports_dir
    try:
        shown = os.path.relpath(directory, config.invocation_params.dir)
    except ValueError:  # another drive (Windows)
        shown = directory
    if not shown.startswith(".."):
        shown = os.path.join(".", shown)
    return [f"harness reports: {shown} (change with --reports-dir)"]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    world_sizes.generate(metafunc)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    world_sizes.deselect(config, items)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if not world_sizes.is_distributed(pyfuncitem):
        return None
    size = world_size_of(pyfuncitem)
    assert size is not None, f"{pyfuncitem.nodeid} runs at no world size: it should have been deselected"
    plan = _plan(pyfuncitem, size)
    pyfuncitem.config.stash[_DEVICES].note(plan)
    pyfuncitem.config.stash[_SESSION].run_item(pyfuncitem, size, plan)
    return True


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outermost: sees the report after every plugin changed it
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    session = item.config.stash.get(_SESSION, None)
    if session is not None and world_size_of(item) is not None:
        session.record_phase(item, report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
    session = item.config.stash.get(_SESSION, None)
    size = world_size_of(item) if session is not None else None
    if session is None or size is None:
        return (yield)
    try:
        result = yield
    except BaseException as error:  # an interrupt: the test is still published, as interrupted
        session.finish_test(item, size, error)
        raise
    session.finish_test(item, size)
    return result


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """From here on the session is ending: a signal no longer interrupts the clean-up."""
    guard = session.config.stash.get(_SIGNALS, None)
    harness_session = session.config.stash.get(_SESSION, None)
    interrupted = exitstatus == pytest.ExitCode.INTERRUPTED or (guard is not None and guard.is_ending)
    if interrupted and isinstance(harness_session, PoolSession):
        harness_session.interrupted = True  # no polite waits on the way out
    if guard is not None:
        guard.ending()
    tally = session.config.stash.get(_DEVICES, None)
    if tally is not None and tally.nothing_ran() and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collection_finish(session: pytest.Session) -> None:
    harness_session = session.config.stash.get(_SESSION, None)
    if harness_session is not None:
        harness_session.collected([item.nodeid for item in session.items])
    _say_oversubscribed(session)


def _say_oversubscribed(session: pytest.Session) -> None:
    """Once, before the first test: CPU worlds with more ranks than cores (slow, and timeouts may need raising)."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or torchrun_world() is not None:
        return
    sizes = {size for item in session.items if (size := world_size_of(item)) is not None}
    line = preflight.oversubscription_line(
        (size for size in sizes if world_device(session.config, size) == "cpu"), preflight.usable_cores()
    )
    if line is not None:
        reporter.write_line(line, yellow=True)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    for line in world_sizes.summary_lines(config):
        terminalreporter.write_line(line)
    session = config.stash.get(_SESSION, None)
    summary = config.pluginmanager.get_plugin(_SUMMARY_PLUGIN)
    if session is not None and summary is not None and (session.published or summary.incomplete):
        summary.write(terminalreporter, session.finish())


def pytest_unconfigure(config: pytest.Config) -> None:
    tally = config.stash.get(_DEVICES, None)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if tally is not None and tally.nothing_ran() and reporter is not None:
        reporter.write_line(tally.nothing_ran(), red=True, bold=True)  # last: after pytest's own summary
    guard = config.stash.get(_SIGNALS, None)
    if guard is not None:
        guard.ending()
    session = config.stash.get(_SESSION, None)
    try:
        if session is not None:
            session.finish()
    finally:
        if session is not None:
            session.kill_all()
        junit = config.pluginmanager.get_plugin(_JUNIT_PLUGIN)
        if junit is not None:
            junit.release()
            config.pluginmanager.unregister(junit)
        traces = config.pluginmanager.get_plugin(_TRACES_PLUGIN)
        if traces is not None:
            config.pluginmanager.unregister(traces)
        if config.pluginmanager.get_plugin(_SUMMARY_PLUGIN) is not None:
            config.pluginmanager.unregister(name=_SUMMARY_PLUGIN)
        if config.pluginmanager.get_plugin(_PYTEST_TIMEOUT_BRIDGE) is not None:
            config.pluginmanager.unregister(name=_PYTEST_TIMEOUT_BRIDGE)
        if guard is not None:
            guard.uninstall()
