"""The pytest side of the harness: options, markers, dispatch of distributed tests to warm pools.

Selection, parametrization and reporting stay in the parent, so `-k`, `-x`, `--lf`,
pytest-timeout and `--junitxml` keep working; only the body of a test marked
`@pytest.mark.world_size(N)` is shipped to the N ranks of a warm pool.
"""
from __future__ import annotations

import atexit
import importlib
import os
import pickle
import shlex
import shutil
import sys
import tempfile
import types
import uuid
from typing import Any

import pytest
import torch

from harness import fixtures, hookspecs
from harness.devices import DEVICE_CHOICES, plan_devices
from harness.junit import CaseRecord, JUnitWriter, SuiteKey
from harness.messages import TestTask
from harness.pool import PoolKey, PoolStartError, RankLoss, WorkerPool, tail
from harness.verdict import Verdict, decide

_SESSION = pytest.StashKey["HarnessSession"]()
_PICKLABLE_OPTION_TYPES = (str, int, float, bool, type(None))


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("harness", "distributed test harness (warm rank pools)")
    group.addoption("--device", choices=DEVICE_CHOICES, default="auto",
                    help="cuda: one GPU + NCCL per rank (skip when too few GPUs); cpu: gloo; "
                         "auto: cuda when enough GPUs exist (default)")
    group.addoption("--seed", type=int, default=1234, help="seed every rank gets before each test")
    group.addoption("--collective-timeout", type=float, default=30.0,
                    help="process-group timeout in seconds: a rank stuck in a collective fails after it")
    group.addoption("--test-timeout", type=float, default=120.0,
                    help="parent deadline per distributed test in seconds; hung ranks are stack-dumped and killed")
    group.addoption("--straggler-grace", type=float, default=5.0,
                    help="seconds the other ranks get to finish once one rank has failed")
    group.addoption("--reports-dir", default=None, help="where junit/rank-<r>.xml goes (default: <rootdir>/reports)")
    parser.addini("rank_fixture_modules", type="linelist", default=[],
                  help="modules that register rank-side fixtures with harness.rank_fixture")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "world_size(n): run the test body on n ranks (an int, or a list to "
                                       "parametrize over world sizes)")
    config.addinivalue_line("markers", "fresh_world: run the test on brand-new rank processes")
    for name in ("collective_timeout", "test_timeout", "straggler_grace"):
        value = getattr(config.option, name)
        if value <= 0:
            raise pytest.UsageError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {value}")
    modules = tuple(config.getini("rank_fixture_modules"))
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise pytest.UsageError(
                f"rank_fixture_modules lists {module!r}, which cannot be imported ({error}); "
                "fix the module name in the ini file or make the module importable") from error
    _register_placeholders(config)
    session = HarnessSession(config, modules)
    config.stash[_SESSION] = session
    atexit.register(session.kill_all)


def _register_placeholders(config: pytest.Config) -> None:
    """Parent-side stand-ins for rank fixtures, so pytest's fixture resolution is satisfied."""
    holder = types.ModuleType("harness_rank_fixture_placeholders")
    for name in fixtures.registered_names():
        def placeholder(_name: str = name) -> str:
            return f"<rank-side fixture {_name}>"
        setattr(holder, f"rank_fixture_{name}", pytest.fixture(name=name)(placeholder))
    config.pluginmanager.register(holder, "harness-rank-fixture-placeholders")


def _reports_dir(config: pytest.Config) -> str:
    given = config.getoption("reports_dir")
    directory = os.path.abspath(given) if given else str(config.rootpath / "reports")
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory):
            pass
    except OSError as error:
        raise pytest.UsageError(
            f"reports directory {directory!r} is not writable ({error.strerror}); "
            "pass --reports-dir with a writable path") from None
    return directory


def parse_world_size(marker: pytest.Mark, where: str) -> list[int] | int:
    """The marker's argument: one int (no parametrization) or a non-empty list of ints."""
    if len(marker.args) != 1 or marker.kwargs:
        raise TypeError(f"{where}: use @pytest.mark.world_size(N) or world_size([N1, N2]), got {marker}")
    value = marker.args[0]
    sizes = list(value) if isinstance(value, (list, tuple)) else [value]
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"{where}: world_size must be an int or a list of ints, got {size!r}")
        if size < 1:
            raise ValueError(f"{where}: world_size must be >= 1, got {size}")
    if not sizes:
        raise ValueError(f"{where}: world_size list is empty")
    return sizes if isinstance(value, (list, tuple)) else sizes[0]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("world_size")
    if marker is None:
        return
    spec = parse_world_size(marker, metafunc.definition.nodeid)
    if isinstance(spec, list):
        if "world_size" not in metafunc.fixturenames:
            metafunc.fixturenames.append("world_size")
        metafunc.parametrize("world_size", spec, ids=[f"ws{n}" for n in spec])


def world_size_of(item: pytest.Item) -> int | None:
    marker = item.get_closest_marker("world_size")
    if marker is None:
        return None
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "world_size" in callspec.params:
        return int(callspec.params["world_size"])
    spec = parse_world_size(marker, item.nodeid)
    assert isinstance(spec, int)
    return spec


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    size = world_size_of(pyfuncitem)
    if size is None:
        return None
    pyfuncitem.config.stash[_SESSION].run_item(pyfuncitem, size)
    return True


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    session = config.stash.get(_SESSION, None)
    if session is not None and session.dispatched:
        files = session.finish()
        terminalreporter.write_line(
            f"harness: {session.dispatched} distributed tests, {session.pool_starts} pool starts; "
            f"per-rank JUnit: {', '.join(os.path.relpath(f) for f in files)}")


def pytest_unconfigure(config: pytest.Config) -> None:
    session = config.stash.get(_SESSION, None)
    if session is not None:
        session.finish()
        session.kill_all()


class HarnessSession:
    """Pools, reports and dispatch for one pytest session."""

    def __init__(self, config: pytest.Config, rank_fixture_modules: tuple[str, ...]) -> None:
        self.config = config
        self.options = config.option
        self.rank_fixture_modules = rank_fixture_modules
        self.tag = uuid.uuid4().hex[:12]
        self.run_dir = tempfile.mkdtemp(prefix=f"fsdp-harness-{self.tag}-")
        self.pools: dict[PoolKey, WorkerPool] = {}
        self.pool_starts = 0
        self.dispatched = 0
        self.reports_dir = _reports_dir(config)
        self.junit = JUnitWriter(os.path.join(self.reports_dir, "junit"), {
            "seed": str(self.options.seed),
            "torch_version": torch.__version__,
            "python_version": sys.version.split()[0],
        })
        self._forwarded_options = {
            name: value for name, value in vars(config.option).items()
            if isinstance(value, _PICKLABLE_OPTION_TYPES)
            or (isinstance(value, list) and all(isinstance(v, str) for v in value))
        }
        self._finished = False

    # -- pools ---------------------------------------------------------------------------
    def pool_for(self, key: PoolKey) -> WorkerPool:
        pool = self.pools.get(key)
        if pool is None:
            run_dir = os.path.join(self.run_dir, f"ws{key.world_size}-{key.device_kind}-{self.pool_starts}")
            pool = WorkerPool(key, run_dir, self.rank_fixture_modules, self.tag)
            self.pool_starts += 1
            pool.start()
            self.pools[key] = pool
        return pool

    def discard_pool(self, key: PoolKey) -> None:
        pool = self.pools.pop(key, None)
        if pool is not None:
            pool.kill()

    def kill_all(self) -> None:
        for key in list(self.pools):
            self.discard_pool(key)
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def finish(self) -> list[str]:
        """Close pools politely and write the per-rank reports (idempotent)."""
        if not self._finished:
            self._finished = True
            for pool in self.pools.values():
                pool.close()
            self.pools.clear()
        return self.junit.write()

    # -- one test ------------------------------------------------------------------------
    def run_item(self, item: pytest.Function, world_size: int) -> None:
        self.dispatched += 1
        params = dict(getattr(item, "callspec", None).params) if hasattr(item, "callspec") else {}
        plan = plan_devices(self.options.device, world_size)
        suite = SuiteKey(str(params.get("backend", "")), world_size, plan.kind or self.options.device)
        if plan.kind is None:
            for rank in range(world_size):
                self.junit.add(rank, suite, self._case(item, 0.0, "skipped", plan.skip_reason))
            pytest.skip(plan.skip_reason)
        key = PoolKey(world_size, plan.kind, self.options.collective_timeout)
        fresh = item.get_closest_marker("fresh_world") is not None
        if fresh:
            self.discard_pool(key)
        task = self._task(item, params)
        try:
            pool = self.pool_for(key)
        except PoolStartError as error:
            text = f"could not start a world of {world_size} ({plan.kind}): {error}"
            for rank in range(world_size):
                self.junit.add(rank, suite, self._case(item, 0.0, "failed", str(error).splitlines()[0], text))
            pytest.fail(text, pytrace=False)
        try:
            results = pool.run(task, self.options.test_timeout, self.options.straggler_grace)
        except BaseException:
            self.discard_pool(key)  # interrupted (Ctrl-C, pytest-timeout): no rank may outlive it
            raise
        verdict = decide(results)
        captured = {rank: (tail(pool.rank_files(rank).stdout, 1 << 20), tail(pool.rank_files(rank).stderr, 1 << 20))
                    for rank in results}
        if fresh or not verdict.pool_reusable:
            self.discard_pool(key)
        self._report(item, suite, results, captured, verdict)

    def _task(self, item: pytest.Function, params: dict[str, Any]) -> TestTask:
        rank_side = set(fixtures.registered_names())
        argnames = item._fixtureinfo.argnames
        rank_fixture_names = tuple(name for name in argnames if name in rank_side)
        call_kwargs = {name: params[name] if name in params else item.funcargs[name]
                       for name in argnames if name not in rank_side}
        for name, value in call_kwargs.items():
            try:
                pickle.dumps(value)
            except Exception as error:  # noqa: BLE001 - any pickling failure has the same fix
                pytest.fail(f"argument {name!r} of {item.nodeid} cannot be sent to the ranks ({error}); "
                            "use picklable parametrize values or register it with harness.rank_fixture",
                            pytrace=False)
        return TestTask(
            nodeid=item.nodeid,
            module_name=item.module.__name__,
            module_file=str(item.module.__file__),
            qualname=item.obj.__qualname__,
            call_kwargs=call_kwargs,
            rank_fixture_names=rank_fixture_names,
            params={k: v for k, v in params.items() if _picklable(v)},
            seed=self.options.seed,
            options=self._forwarded_options,
            sys_path=list(sys.path),
        )

    def _report(self, item: pytest.Function, suite: SuiteKey, results: dict[int, Any],
                captured: dict[int, tuple[str, str]], verdict: Verdict) -> None:
        for rank, result in results.items():
            stdout, stderr = captured[rank]
            if isinstance(result, RankLoss):
                text = f"rank {rank} {result.cause}\n{result.stacks}\n--- stderr ---\n{stderr}"
                case = self._case(item, 0.0, "failed", f"rank {rank} {result.cause}", text, stdout, stderr)
            else:
                case = self._case(item, result.duration_s, result.status, result.summary,
                                  result.traceback or result.summary, stdout, stderr)
            self.junit.add(rank, suite, case)
            if stdout:
                sys.stdout.write(f"--- rank {rank} stdout ---\n{stdout}\n")
            if stderr:
                sys.stdout.write(f"--- rank {rank} stderr ---\n{stderr}\n")
        if verdict.outcome == "failed":
            lost = [f"--- rank {r} stderr (last lines) ---\n{tail_lines(captured[r][1], 25)}"
                    for r, result in results.items() if isinstance(result, RankLoss) and captured[r][1]]
            pytest.fail("\n".join([verdict.message, *lost, self.repro_line(item)]), pytrace=False)
        if verdict.outcome == "skipped":
            pytest.skip(verdict.message)
        if verdict.outcome == "xfailed":
            pytest.xfail(verdict.message)

    @staticmethod
    def _case(item: pytest.Function, duration: float, status: str, message: str, text: str = "",
              stdout: str = "", stderr: str = "") -> CaseRecord:
        path, _, rest = item.nodeid.partition("::")
        classname = path.removesuffix(".py").replace("/", ".")
        if "::" in rest:
            classname += "." + rest.rsplit("::", 1)[0].replace("::", ".")
        return CaseRecord(classname, item.name, duration, status, message, text, stdout, stderr)

    def repro_line(self, item: pytest.Function) -> str:
        opts = self.options
        args = [sys.executable, "-m", "pytest", item.nodeid, f"--device={opts.device}", f"--seed={opts.seed}",
                f"--collective-timeout={opts.collective_timeout:g}", f"--test-timeout={opts.test_timeout:g}"]
        for extra in item.config.hook.pytest_harness_repro_args(item=item):
            args.extend(extra)
        return "REPRO: " + shlex.join(args)


def tail_lines(text: str, count: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-count:])


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001
        return False
    return True
