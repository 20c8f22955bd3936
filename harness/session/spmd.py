"""Parent-side SPMD calls: a test that runs in the pytest process (a Hypothesis test, say) runs a
module-level function on every rank of a warm pool and gets each rank's value or failure back.

Why a parent-side call and not a distributed test: the test's logic stays in the parent, where
Hypothesis draws, shrinks and keeps its database; only the function travels. The ranks are the
pool distributed tests of the same world size use (`PoolSession.pool_for`), so a session mixing
both starts one pool per size.

The data path is a test's (`WorkerPool.run` with an `SpmdCall` instead of a `TestTask`): the same
deadline (`--test-timeout`, or `timeout_s`), straggler grace, one-sided watch (with `trace=True`),
stack dumps, kill and restart. What differs is the answer: a `SpmdResult` instead of a verdict;
a failing call fails nothing by itself (`SpmdWorld.call` raises `SpmdCallFailed`), and the session
never ends because of one. A call after which the ranks may not go on discards the pool (see
`_reusable`), so the next call or test starts fresh ranks.

The function and its arguments: the function travels by name (`module.qualname`, checked here to
name the function itself), its arguments pickled once (`SpmdCall.arguments`); a rank imports a
test module the way pytest imported it (assertion rewriting, `SpmdCall.module_file`).
"""

from __future__ import annotations

import pickle
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from _pytest.assertion.rewrite import AssertionRewritingHook

from harness.config.devices import DevicePlan
from harness.message_text import clip, describe_exception, read_tail
from harness.messages import DeviceKind, RankLoss, RankOutcome, RankResult, SpmdCall, encoded, picklable
from harness.process.pool import PoolKey, PoolStartError, WorkerPool
from harness.session.pool_session import PoolSession, agent_store_error
from harness.session.verdict import (
    LOST_STDERR_LINES,
    FirstFailure,
    failure_reason,
    first_failure,
    without_harness_frames,
    world_reusable,
)
from harness.trace.divergence import first_divergence, unfinished_collectives
from harness.trace.one_sided import OneSidedWatch
from harness.trace.records import CollectiveRecord, read_trace_or_empty

_NO_ARGUMENTS = encoded(((), {}))
_STDERR_TAIL_BYTES = 64 * 1024
_VALUE_REPR_CHARS = 2000  # of one rank's value in `SpmdResult.describe`
UNDER_TORCHRUN = (
    "parent-side SPMD calls need the harness's warm pool, which does not exist under torchrun: this "
    "pytest process is itself a rank there. Write the check as a distributed test "
    "(@pytest.mark.world_size) to run it under torchrun"
)


@dataclass(frozen=True)
class _FunctionName:
    """How the ranks find a function: its module's name, its qualified name, and the module's file
    when pytest's assertion rewriting imported it (the rank imports it the same way)."""

    module_name: str
    qualname: str
    module_file: str | None

    def __str__(self) -> str:
        return f"{self.module_name}.{self.qualname}"


_names: dict[Callable[..., Any], _FunctionName] = {}


def function_name(fn: Callable[..., Any]) -> _FunctionName:
    """The name the ranks import `fn` by (cached per function: the hot path looks it up once);
    TypeError naming the fix when that name does not lead to `fn` itself."""
    known = _names.get(fn)
    if known is not None:
        return known
    module_name = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    module = sys.modules.get(module_name) if isinstance(module_name, str) else None
    found: Any = module
    for part in qualname.split(".") if isinstance(qualname, str) and "<" not in qualname else ():
        found = getattr(found, part, None)
    if module is None or found is not fn or module_name == "__main__":
        raise TypeError(
            f"{fn!r} cannot be called on the ranks: the ranks import the function by its module and name, "
            f"and {module_name}.{qualname} does not name it there (a lambda, a nested function, a method, "
            "a functools.partial, or a function of __main__). Define it at module level in a test module or "
            "a helper module, and pass what varies through args/kwargs"
        )
    loader = getattr(getattr(module, "__spec__", None), "loader", None)
    module_file = getattr(module, "__file__", None) if isinstance(loader, AssertionRewritingHook) else None
    name = _FunctionName(module_name, qualname, module_file)  # type: ignore[arg-type]
    _names[fn] = name
    return name


def pickle_arguments(name: _FunctionName, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """The call's arguments pickled once for every rank; TypeError naming the argument that
    cannot be pickled and the fix."""
    if not args and not kwargs:
        return _NO_ARGUMENTS
    try:
        return encoded((args, kwargs))
    except Exception as error:
        labelled = [(f"argument {index}", value) for index, value in enumerate(args)]
        labelled += [(f"keyword argument {key!r}", value) for key, value in kwargs.items()]
        which = next((label for label, value in labelled if not picklable(value)), "an argument")
        value = dict(labelled).get(which)
        raise TypeError(
            f"{which} of the SPMD call of {name} (a {type(value).__qualname__}) cannot be sent to the ranks: "
            f"{describe_exception(error)}. Pass plain data (numbers, strings, lists, dicts, dataclasses of an "
            "importable module) or CPU tensors, and build anything else (models, process groups, generators) "
            "inside the function"
        ) from error


class SpmdCallFailed(Exception):
    """Raised by `SpmdWorld.call` when a rank did not return, or the ranks' collectives diverged;
    the whole story is `result` (its text is `result.describe()`)."""

    def __init__(self, result: SpmdResult) -> None:
        super().__init__(result.describe())
        self.result = result


@dataclass
class SpmdResult:
    """What every rank of a parent-side SPMD call did (`SpmdWorld.run`)."""

    function: str
    """`module.qualname` of the function called."""
    world_size: int
    device_kind: str
    values: dict[int, Any]
    """Rank -> the value it returned, for the ranks that returned."""
    failures: dict[int, str]
    """Rank -> the whole text of its failure: the exception and its traceback, or how it was lost
    (killed, hung, stopped after a peer failed: its Python stacks and the tail of its stderr)."""
    first_failure: tuple[int, str] | None
    """(rank, one-line cause) of the rank that failed first: the only failed rank, or the one the
    verdict's logic tells apart (`harness.session.verdict.first_failure`); None when every rank
    returned, or when several failed and none can be told to have failed first."""
    divergence: str | None
    """The first collective the ranks disagreed on (`Divergence.describe()`), with `trace=True`."""
    traces: dict[int, list[CollectiveRecord]]
    """Rank -> the collectives it issued during the call, with `trace=True` (else empty)."""
    restarted: bool
    """The pool was discarded after this call: the next call (or test) of this size starts fresh ranks."""
    duration_s: float
    results: dict[int, RankResult] = field(repr=False, default_factory=dict)
    """Each rank's raw result (`RankOutcome`, or `RankLoss` for a rank the parent lost)."""
    unfinished: str | None = None
    """The collectives ranks were stuck in when they failed, when the trace shows any."""

    @property
    def ok(self) -> bool:
        """Every rank returned (a divergence is reported apart: `divergence`)."""
        return not self.failures and len(self.values) == self.world_size

    def ordered_values(self) -> list[Any]:
        """The ranks' values in rank order (every rank returned)."""
        return [self.values[rank] for rank in range(self.world_size)]

    def describe(self) -> str:
        """The call's whole story in one text: what a failing Hypothesis example prints."""
        state = "every rank returned" if self.ok else f"ranks failed: {sorted(self.failures)}"
        lines = [
            f"SPMD call {self.function} on {self.world_size} ranks ({self.device_kind}): {state} "
            f"in {self.duration_s * 1000:.1f} ms"
        ]
        if self.first_failure is not None:
            lines.append(f"rank {self.first_failure[0]} failed first: {self.first_failure[1]}")
        if self.divergence:
            lines.append(f"ranks issued divergent collectives: {self.divergence}")
        if self.unfinished:
            lines.append(f"unfinished collectives: {self.unfinished}")
        if self.restarted:
            lines.append("the pool was restarted after this call: the next call starts fresh ranks")
        for rank in range(self.world_size):
            if rank in self.values:
                shown = clip(_safe_repr(self.values[rank]), _VALUE_REPR_CHARS)
                lines += [f"{'=' * 20} rank {rank}: returned {'=' * 20}", shown]
            elif rank in self.failures:
                lines += [f"{'=' * 20} rank {rank}: failed {'=' * 20}", self.failures[rank].rstrip()]
        return "\n".join(lines)


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception as error:  # noqa: BLE001 - a value's repr must not break the account
        return f"<{type(value).__qualname__}: repr failed: {describe_exception(error)}>"


class SpmdWorld:
    """The ranks of one world size on the session's device, for parent-side SPMD calls.

    Made by the `spmd_world` fixture; holds no ranks itself: each call takes the session's warm
    pool of this size (started on first use, restarted after a call that broke it).
    """

    def __init__(self, session: PoolSession, world_size: int, device_kind: DeviceKind) -> None:
        self._session = session
        self._key = PoolKey(world_size, device_kind, session.options.collective_timeout)
        self.world_size = world_size
        self.device_kind: DeviceKind = device_kind
        self._context_of: tuple[Any, ...] = ()
        self._context_bytes = b""

    def _context(self) -> bytes:
        """`SpmdCall.context`, pickled again only when the options or sys.path changed."""
        options = self._session.forwarded_options  # made once per session: its identity stands for it
        key = (id(options), *sys.path)
        if key != self._context_of:
            self._context_bytes = encoded((options, list(sys.path)))
            self._context_of = key
        return self._context_bytes

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        trace: bool = True,
        isolate: bool = True,
        seed: int | None = None,
    ) -> SpmdResult:
        """Call `fn(*args, **kwargs)` on every rank at once; every rank's value or failure.

        `timeout_s`: the ranks' deadline (default `--test-timeout`); `trace`: record the call's
        collectives (the one-sided watch and the trace diff, as for a test); `isolate`: bracket
        the call as a test is (False: the light path, for cheap calls); `seed`: what every rank is
        seeded with before the call (default `--seed`).
        """
        options = self._session.options
        name = function_name(fn)
        call = SpmdCall(
            module_name=name.module_name,
            qualname=name.qualname,
            module_file=name.module_file,
            arguments=pickle_arguments(name, args, kwargs or {}),
            seed=options.seed if seed is None else seed,
            trace=trace,
            isolate=isolate,
            context=self._context(),
        )
        started = time.perf_counter()
        pool = self._pool()
        watch = None
        if trace:
            watch = OneSidedWatch({rank: pool.rank_files(rank).trace for rank in range(self.world_size)})
        deadline_s = options.test_timeout if timeout_s is None else timeout_s
        source = "" if timeout_s is None else f"the call's timeout_s={timeout_s:g}"
        try:
            results = pool.run(
                call, deadline_s, options.straggler_grace, watch.check if watch is not None else None, source
            )
        except BaseException as error:
            # Interrupted (Ctrl-C, SIGTERM, pytest-timeout): no rank may outlive the call.
            if isinstance(error, KeyboardInterrupt):
                self._session.interrupted = True
            self._session.discard_pool(self._key)
            raise
        finally:
            self._session.spmd_calls += 1
        if pool.agent_store_failure is not None:
            self._session.discard_pool(self._key)
            raise RuntimeError(agent_store_error(pool.agent_store_failure))
        traces = {rank: read_trace_or_empty(pool.rank_files(rank).trace) for rank in results} if trace else {}
        restarted = not _reusable(call, results, traces)
        if restarted:
            self._session.discard_pool(self._key)
        return _result(str(name), self, results, traces, restarted, time.perf_counter() - started, pool.rank_files)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """`run(fn, args, kwargs)` with the defaults; the ranks' values in rank order, or
        `SpmdCallFailed` when a rank did not return or the ranks' collectives diverged."""
        result = self.run(fn, args, kwargs)
        if not result.ok or result.divergence:
            raise SpmdCallFailed(result)
        return result.ordered_values()

    def _pool(self) -> WorkerPool:
        try:
            return self._session.pool_for(self._key)
        except PoolStartError as error:
            raise RuntimeError(
                f"could not start a world of {self.world_size} ranks ({self.device_kind}) for a parent-side "
                f"SPMD call: {error}"
            ) from error


def _reusable(call: SpmdCall, results: dict[int, RankResult], traces: dict[int, list[CollectiveRecord]]) -> bool:
    """Whether the ranks may take the next call or test, the rule a test's ranks follow
    (`world_reusable`), and stricter where the call gives less to judge by: a failed call keeps
    its pool only when it was isolated (its process groups destroyed, its state put back) and
    traced (no collective left half-done); otherwise its ranks are replaced."""
    if not world_reusable(results, traces):
        return False
    failed = any(result.status != "passed" for result in results.values())
    return not failed or (call.isolate and call.trace)


def _result(
    function: str,
    world: SpmdWorld,
    results: dict[int, RankResult],
    traces: dict[int, list[CollectiveRecord]],
    restarted: bool,
    duration_s: float,
    rank_files: Callable[[int], Any],
) -> SpmdResult:
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    unreadable: dict[int, str] = {}  # rank -> why the value it returned cannot be unpickled here
    for rank, result in results.items():
        if isinstance(result, RankOutcome) and result.status == "passed":
            try:
                values[rank] = pickle.loads(result.value) if result.value is not None else None
            except Exception as error:  # noqa: BLE001 - any unpickling failure has the same fix
                unreadable[rank] = (
                    f"the value {function} returned on rank {rank} cannot be unpickled in the pytest process "
                    f"({describe_exception(error)})"
                )
                failures[rank] = f"{unreadable[rank]}: return plain data, or tensors, of classes the parent imports"
        elif isinstance(result, RankLoss):
            stderr = read_tail(rank_files(rank).stderr, _STDERR_TAIL_BYTES)
            failures[rank] = result.account(stderr, without_harness_frames, last_lines=LOST_STDERR_LINES)
        else:
            failures[rank] = without_harness_frames(result.traceback.rstrip()) or result.summary
    divergence = first_divergence(traces, list(results)) if traces else None
    return SpmdResult(
        function=function,
        world_size=world.world_size,
        device_kind=world.device_kind,
        values=values,
        failures=failures,
        first_failure=_first_failure(results, unreadable) if failures else None,
        divergence=divergence.describe() if divergence is not None else None,
        traces=traces,
        restarted=restarted,
        duration_s=duration_s,
        results=results,
        unfinished=unfinished_collectives(traces) if failures and traces else None,
    )


def _first_failure(results: dict[int, RankResult], unreadable: dict[int, str]) -> tuple[int, str] | None:
    """The rank that failed first and its one-line cause (the verdict's logic over the ranks'
    results; where every rank returned, the first whose value could not be read here)."""
    failed = [rank for rank, result in results.items() if result.status == "failed"]
    if not failed:
        rank = min(unreadable)
        return rank, unreadable[rank]
    found = first_failure(results) if len(failed) > 1 else FirstFailure(failed[0], "message")
    if found is None:
        return None
    return found.rank, failure_reason(results, found).cause


def open_world(session: object, world_size: int, note: Callable[[DevicePlan], None] | None = None) -> SpmdWorld:
    """The `SpmdWorld` of `world_size` ranks for this session; skips the calling test where there
    is none: under torchrun (no pool), or where the session cannot have the device (its reason).
    `note` sees the device decision (the session's tally of worlds that got their device)."""
    if not isinstance(session, PoolSession):
        pytest.skip(reason=UNDER_TORCHRUN)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"spmd_world({world_size!r}): the world size is a number of ranks; pass an int of 1 or more")
    plan = session.plan(world_size)
    if note is not None:
        note(plan)
    if plan.kind is None:
        pytest.skip(reason=plan.skip_reason or "the device for this world cannot be had")
    return SpmdWorld(session, world_size, plan.kind)
