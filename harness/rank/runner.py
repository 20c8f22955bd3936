"""Runs one test body inside a rank: the part shared by warm workers and torchrun mode.

It imports the test module (with pytest's assertion rewriting), resolves rank fixtures, wraps the
body in per-test isolation and the collective trace, and turns whatever happened into a
`RankOutcome`. It never lets an exception escape: a failing body is a result, not a crash, and
an exception of any shape (one whose `__str__` raises included) is described safely; a failure of
the harness's own steps is a failed outcome that asks for the rank to be replaced.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness.message_text import clip, describe_exception
from harness.messages import RankOutcome, Status, TestTask
from harness.rank import faults, group_reuse, known_checks, rank_fixtures, replicas, tracing
from harness.rank.isolation import TestIsolation, seed_everything, sync_state
from harness.rank.labels import load_label_providers

_TRACEBACK_LIMIT = 256 * 1024  # characters of one rank's failure text sent to the parent


def import_test_module(name: str, file: str) -> ModuleType:
    """Import a test module with pytest's assertion rewriting, as the parent did."""
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__file__", None) == file:
        return module
    package = name.rpartition(".")[0]
    if package:
        importlib.import_module(package)
    source = Path(file).read_bytes()
    tree = ast.parse(source, filename=file)
    try:
        from _pytest.assertion.rewrite import rewrite_asserts

        rewrite_asserts(tree, source, file)
    except ImportError:
        pass  # plain asserts still fail, only with less detail
    code = compile(tree, file, "exec", dont_inherit=True)
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None, f"cannot build an import spec for {file}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def resolve_callable(task: TestTask) -> Callable[..., Any]:
    obj: Any = import_test_module(task.module_name, task.module_file)
    for part in task.qualname.split("."):
        obj = getattr(obj, part)
        if isinstance(obj, type):
            obj = obj()  # a test class: methods run on a fresh instance, as in pytest
    return obj


def format_failure(error: BaseException, runner_file: str = __file__) -> str:
    """Traceback without the leading frames of the runner that caught it (`runner_file`: this
    module, or `harness.rank.call_runner`): the user's code is what matters."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == runner_file:
        tb = tb.tb_next
    try:
        text = "".join(traceback.format_exception(type(error), error, tb))
    except Exception as failure:  # noqa: BLE001 - formatting a foreign exception must not fail the rank
        text = f"{describe_exception(error)}\n(its traceback could not be formatted: {describe_exception(failure)})"
    return clip(text, _TRACEBACK_LIMIT)


class TestRunner:
    """Executes tasks for one rank; holds what must persist across tests (isolation baseline)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        local_rank: int,
        device: torch.device,
        rank_fixture_modules: tuple[str, ...],
        label_providers: tuple[str, ...],
        trace_path: str,
        raised_path: str | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.device = device
        self.rank_fixture_modules = rank_fixture_modules
        self.trace_path = trace_path
        self.raised_path = raised_path
        tracing.install()
        group_reuse.install()  # after the trace: what is kept is what the traced new_group returned
        load_label_providers(label_providers)
        self.isolation = TestIsolation()

    def run(self, task: TestTask) -> RankOutcome:
        started = time.perf_counter()
        try:
            return self._run(task, started)
        except BaseException as error:  # noqa: BLE001 - the harness's own steps failed, not the body
            return harness_failure(self.rank, started, error)

    def _run(self, task: TestTask, started: float) -> RankOutcome:
        # The rank fixtures' setup and teardown are inside the trace with the body (their
        # collectives belong to the test, and a fixture that diverges is found like a body that
        # does); the replica check watches the body and digests after it, before the fixtures'
        # teardown (`_execute`).
        def body() -> BodyResult:
            status, summary, failure, failed_at = self._execute(task)
            return status, summary, failure, failed_at, None

        return run_bracketed(
            self,
            started,
            body,
            seed=task.seed,
            isolate=True,
            trace=True,
            check_replicas=task.check_replicas,
            reuse_groups=task.reuse_groups,
        )

    def _execute(self, task: TestTask) -> tuple[Status, str, str, float | None]:
        """Resolve the rank fixtures, run the body, tear the fixtures down: (status, summary,
        traceback, when it failed: the wall-clock time the body or a fixture raised, None unless failed)."""
        raised_at: float | None = None
        try:
            with ExitStack() as teardown:
                for module in self.rank_fixture_modules:
                    importlib.import_module(module)
                test = resolve_callable(task)
                ctx = rank_fixtures.RankContext(
                    rank=self.rank,
                    world_size=self.world_size,
                    local_rank=self.local_rank,
                    device=self.device,
                    params=task.params,
                    options=task.options,
                )
                kwargs = dict(task.call_kwargs)
                # Inside the fixtures' bracket: a rank fixture's teardown (the suite's vacuity
                # watch) sees the test as failed when a known check failed.
                teardown.enter_context(known_checks.known_failures(task.known_failures))
                try:
                    kwargs.update(rank_fixtures.resolve(task.rank_fixture_names, ctx, teardown))
                    try:
                        test(**kwargs)
                    except BaseException as body_error:
                        known_checks.finish_body(body_error)
                        raise
                    known_checks.finish_body(None)
                except BaseException as error:
                    raised_at = time.time()  # the moment it failed, before any teardown takes time
                    # Noted before the fixtures' teardown runs: a teardown that aborts the process
                    # (gloo's SIGABRT on a mismatched collective) must not take the cause with it.
                    self._note_raised(error)
                    self._digest_replicas(error)
                    raise
                self._digest_replicas(None)
        except pytest.skip.Exception as skip:
            return "skipped", str(skip.msg), "", None
        except pytest.xfail.Exception as xfail:
            return "xfailed", str(xfail.msg), "", None
        except BaseException as error:  # noqa: BLE001 - SystemExit and friends fail the test, not the rank
            # A fixture's teardown that raised after the body passed failed the test now.
            failed_at = raised_at if raised_at is not None else time.time()
            return "failed", describe_exception(error), format_failure(error), failed_at
        return "passed", "", "", None

    def _digest_replicas(self, error: BaseException | None) -> None:
        """The replica check's digests, taken after the body and before the fixtures' teardown
        (which may close the backend). Locally: no collective. Not after a skip, nor after a
        failure on CUDA (reading a tensor would wait on a stream that may hold a collective its
        peers never issue)."""
        recorder = replicas.active_recorder()
        if recorder is None or isinstance(error, (pytest.skip.Exception, pytest.xfail.Exception)):
            return
        if error is not None and self.device.type != "cpu":
            return
        recorder.finish(self.rank)

    def _note_raised(self, error: BaseException) -> None:
        if not isinstance(error, (pytest.skip.Exception, pytest.xfail.Exception)):
            note_raised(self.raised_path, describe_exception(error), format_failure(error))


def note_raised(raised_path: str | None, summary: str, failure: str) -> None:
    """Write what a body raised to the rank's raised file (`RankFiles.raised`) at once, before
    any teardown: if the rank dies afterwards (gloo's SIGABRT on a mismatched collective), the
    parent still knows what it raised (`RankLoss.raised`)."""
    if raised_path is None:
        return
    try:
        with open(raised_path, "w", encoding="utf-8", errors="replace") as handle:
            handle.write(f"{summary}\n{failure}")
    except OSError:
        pass  # the outcome still carries the failure if the rank survives


BodyResult = tuple[Status, str, str, "float | None", "bytes | None"]
"""What a test's or call's body came to: (status, summary, traceback, when it failed, pickled value)."""


def run_bracketed(
    runner: TestRunner,
    started: float,
    body: Callable[[], BodyResult],
    *,
    seed: int,
    isolate: bool,
    trace: bool,
    check_replicas: bool = False,
    reuse_groups: bool = True,
) -> RankOutcome:
    """Run ``body`` (a test's, or a parent-side SPMD call's) in the bracket every unit of work on
    a rank gets, and make its outcome.

    Order matters. Isolation (or, for a call that asked for none, only the seeds) brackets
    everything; the trace and the opt-in replica check bracket the body. Faults are read and
    disarmed in ``finally``, whatever the body did, so a fault armed but not fired never reaches
    the next test or call. ``body`` runs in its own frame: by the time isolation runs, nothing it
    built (arguments, fixture values, the function) is referenced from here, so it is garbage
    isolation can collect, not state that lives into the next test.
    """
    if isolate:
        runner.isolation.enter(seed, reuse_groups)
    else:
        seed_everything(seed)
    if trace:
        tracing.begin_test(runner.trace_path)
    if check_replicas:
        replicas.begin_test(runner.trace_path)
    try:
        status, summary, failure, failed_at, value = body()
    finally:
        digests = replicas.end_test()
        if trace:
            tracing.end_test()
        injected = take_injected_faults()
    if isolate:
        state, replace_reason = runner.isolation.exit()
    elif dist.is_initialized():
        state, replace_reason = sync_state(), ""
    else:
        state, replace_reason = (0, 0, 0), "the call destroyed the default process group"
    return RankOutcome(
        rank=runner.rank,
        status=status,
        duration_s=time.perf_counter() - started,
        summary=summary,
        traceback=failure,
        sync_state=state,
        injected_faults=injected,
        replace_reason=replace_reason,
        failed_at=failed_at,
        value=value,
        replicas=digests,
    )


def harness_failure(rank: int, started: float, error: BaseException) -> RankOutcome:
    """The outcome of a task or call whose harness steps failed (not the user's code): failed, and
    the rank asks to be replaced, since its state is unknown."""
    summary = f"harness error on rank {rank}: {describe_exception(error)}"
    return RankOutcome(
        rank=rank,
        status="failed",
        duration_s=time.perf_counter() - started,
        summary=summary,
        traceback=format_failure(error),
        replace_reason=summary,
        failed_at=time.time(),
    )


def take_injected_faults() -> list[str]:
    """The faults injected since the last call, disarmed: a fault armed but not fired must never
    reach the next test or call."""
    injected = faults.active_faults()
    faults.clear()
    return injected
