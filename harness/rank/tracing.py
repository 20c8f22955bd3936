"""Rank side of the collective trace: wraps torch.distributed's entry points and records each call.

Why a trace: torch's own checks catch a divergent collective only when op, shape or dtype differ.
A *same-shape* mismatch (rank 0 all-gathers layer1 while rank 1 all-gathers layer2) silently
corrupts weights. Recording what each rank issued, with a semantic label (`harness.rank.labels`), lets
the parent diff the ranks after the test (`harness.trace.divergence`), even after a rank was SIGKILLed
or hung. The records and their file are `harness.trace.records`; the parent reads only that module.
What a record says of a call is read from its arguments by `harness.rank.call_records`; this module
patches torch, numbers the records and writes them.

Where the trace hooks in (and why there):
  * The Python entry points of `torch.distributed.distributed_c10d` (re-exported as
    `torch.distributed.*`) and of `torch.distributed._functional_collectives` are replaced by
    thin wrappers. FSDP1 (`dist.all_gather_single` / `dist.all_gather_into_tensor`,
    `dist.reduce_scatter_*`, `dist.all_reduce`), FSDP2 (`_fsdp_collectives`: `dist.all_gather_single`,
    `dist.reduce_scatter_single`, `dist.all_reduce`, and the `*_into_tensor` / `*_tensor` names on
    older torch) and DTensor (`funcol.all_gather_single`, `funcol.reduce_scatter_single`,
    `funcol.all_reduce`, ...) all look these functions up as module attributes at call time.
    Modules that bound a function early (`from torch.distributed.distributed_c10d import broadcast`,
    as DTensor's `_collective_utils` does) are found by scanning `sys.modules` for same-named
    references to the original function and rebinding them.
  * Patching `ProcessGroup` methods instead was rejected: functional collectives reach the C++
    process group through the dispatcher (`torch.ops._c10d_functional.*`), never through the
    Python-visible methods, so DTensor traffic would be missed; and a dispatcher-level mode
    would tax every tensor op, not just collectives.
  * `torch.distributed._broadcast_coalesced` (used to sync module states) is wrapped too.
  * Collectives issued below Python (DDP's reducer from C++, a `ProcessGroup` method called
    directly, a compiled graph's functional collectives) are met one level down, at the
    dispatcher op every process-group collective passes through (`harness.rank.dispatch_hooks`),
    and recorded with the same numbering, so both kinds are in one trace in the order issued; a
    Python entry point being recorded on the same thread makes its own dispatcher call pass
    through. Their label names a DDP bucket's parameters (`harness.rank.ddp_buckets`), their site
    the user's line that led to them (the `loss.backward()` of a DDP bucket on CPU). A torch on
    which they cannot be hooked writes a note at the top of every trace, which the reports show.
  * A record is done when its work has completed (`harness.rank.completion`): at return for a
    synchronous call, when its `Work` says so for an async one (and for every dispatched one),
    when its tensor has been waited for for an in-flight functional collective.
A collective that is implemented by calling another traced entry point (e.g.
`all_gather_into_tensor` delegating to `all_gather_single`, `all_gather_object` using
`all_gather`) is recorded once, as the outermost call, thanks to a per-thread re-entrancy flag.
Aliases are recorded under one canonical name (`harness.rank.collective_ops`) so ranks that spell an
op differently compare equal. Under `torch.compile` tracing the wrappers step aside and call the
original function, so Dynamo still sees the functions it knows.

Besides op, group, shapes and dtypes, a record carries what makes a collective's identity
(`harness.trace.divergence` compares it): the label, the names of the tensors for ops whose members pass
the same logical tensor (`harness.rank.tensor_names`), the user's call site (`harness.rank.call_sites`),
the root rank and reduction every member must agree on, and for collectives whose members exchange
pieces of their own (all_to_all, scatter, gather, list collectives) what this rank sends to and
expects from each member (`harness.trace.exchange`). Building a record never raises into the
caller: a failure becomes a `{"note": ...}` line in the trace and the call runs as if untraced.

The group of a record is a process group, not a set of ranks: torch's name for it, which every
member sees alike (torch numbers a world's groups in the order `new_group` is called, and every rank
must call it, member or not), and its number among the groups this test created. A call on a group
this rank is not a member of is recorded too (torch returns at once on such a rank): `new_group` is
wrapped to return, on a non-member, `NonMemberGroup`, which equals torch's `NON_GROUP_MEMBER` the way
torch compares it (`==`) and carries the group's members and name, so that such a call says which
group it named.

The wrapper is also the one interception point for fault injection: `set_interceptor` installs a
callback that sees each record first and may issue the call its own way (`harness.rank.faults`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from harness.rank import dispatch_hooks, labels
from harness.rank.call_records import (
    CallArguments,
    CallGroup,
    GroupTable,
    NonMemberGroup,
    build_record,
    dispatched_record,
    flatten_tensors,
    param_positions,
)
from harness.rank.collective_ops import (
    BROADCAST_COALESCED,
    BROADCAST_COALESCED_PARAMS,
    C10D_SPECS,
    FUNCOL_SPECS,
    KNOWN_OPS,
    DispatchedSpec,
    OpSpec,
)
from harness.rank.completion import CompletionWatch
from harness.rank.labels import register_label_provider
from harness.trace.records import P2P_SEND_OPS, CollectiveRecord, done_line, note_line, record_line

__all__ = [
    "KNOWN_OPS",
    "CollectiveCall",
    "CollectiveRecord",
    "Interceptor",
    "NonMemberGroup",
    "Runner",
    "begin_test",
    "end_test",
    "install",
    "is_installed",
    "register_label_provider",
    "set_interceptor",
    "wrap",
]


@dataclass
class CollectiveCall:
    """A collective about to be issued, as handed to an interceptor's runner (see `set_interceptor`)."""

    record: CollectiveRecord
    issue: Callable[[], Any]
    """Issues the real collective and returns its result."""
    spec: OpSpec
    params: dict[str, Any] = field(repr=False)
    """The call's output parameters and `async_op`, by name."""

    @property
    def async_op(self) -> bool:
        return bool(self.params.get("async_op"))

    def output_tensors(self, result: Any) -> list[torch.Tensor]:
        """The tensors this collective wrote, given `issue()`'s result; waits for async work first."""
        if self.spec.functional:
            from torch.distributed._functional_collectives import AsyncCollectiveTensor

            return [t.wait() if isinstance(t, AsyncCollectiveTensor) else t for t in flatten_tensors(result)]
        if self.async_op and result is not None:
            result.wait()
        return flatten_tensors(*(self.params.get(name) for name in self.spec.outputs))

    def skipped_result(self) -> Any:
        """What the caller gets back when the collective is not issued at all."""
        if self.spec.functional:
            raise ValueError(
                f"cannot skip functional collective {self.record.op}: its caller needs the result "
                "tensor; inject 'delay', 'corrupt', 'raise', 'exit' or 'hang' instead"
            )
        if self.async_op:
            future: torch.futures.Future = torch.futures.Future()
            future.set_result(None)
            return torch._C._distributed_c10d._create_work_from_future(future)
        if self.spec.op in ("recv", "irecv"):
            return self.record.peer if self.record.peer is not None else -1
        return None


Runner = Callable[[CollectiveCall], Any]
Interceptor = Callable[[CollectiveRecord], "Runner | None"]


class _ThreadState(threading.local):
    """Per-thread re-entrancy flag: a traced call made inside another is not recorded again."""

    def __init__(self) -> None:
        self.busy = False
        self.on_device = False
        """Whether the call being recorded has its tensors on a device (not the CPU)."""
        self.device_works: list[Any] | None = None
        """While a synchronous call on device tensors is recorded: the works its process-group ops
        returned. On NCCL a synchronous call returns once its kernel is queued, so its record is
        done when those works complete, not when it returns (on gloo, it returns completed)."""


class _TestState:
    """What is being recorded for the current test (one instance per test)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.next_index = 0
        self.seq_by_key: dict[tuple, int] = {}
        self.rank: int | None = None
        self.notes: set[str] = set()
        self.completion = CompletionWatch(self._write_done)

    def _write_done(self, index: int) -> None:
        # Only while this test is recording: end_test() closes the fd (and a later test may reuse
        # the number) once the completion watch is closed, which stops these calls first.
        with contextlib.suppress(OSError):
            os.write(self.fd, done_line(index))


_thread = _ThreadState()
_lock = threading.Lock()  # index and seq numbering: collectives may be issued from several threads
_test: _TestState | None = None
_interceptor: Interceptor | None = None
_groups = GroupTable()
"""The groups of this test's calls, by the group argument each passed."""
_installed = False
_unseen: list[str] = []
"""What this torch does not let the trace see (`dispatch_hooks.install`), noted in every trace."""
_is_compiling = torch.compiler.is_compiling
_async_tensor: type | None = None
"""funcol's AsyncCollectiveTensor: a functional collective's result that is still in flight."""


# ----------------------------------------------------------------------------------- public API


def install() -> None:
    """Wrap every collective entry point of this process (idempotent) and start tracking module
    forwards for labels. Recording only happens between `begin_test` and `end_test`."""
    global _installed
    if _installed:
        return
    import torch.distributed._functional_collectives as funcol

    replacements: dict[int, _Replacement] = {}

    def add(owner: Any, name: str, spec: OpSpec, positions: dict[str, int] | None = None) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return
        known = replacements.get(id(original))
        if known is None:
            wrapper = wrap(original, spec, positions)
            known = replacements[id(original)] = _Replacement(original, wrapper, {getattr(original, "__name__", name)})
        known.names.add(name)

    for name, spec in C10D_SPECS.items():
        add(c10d, name, spec)
    add(dist, "_broadcast_coalesced", BROADCAST_COALESCED, {p: i for i, p in enumerate(BROADCAST_COALESCED_PARAMS)})
    for name, spec in FUNCOL_SPECS.items():
        add(funcol, name, spec)
    new_group = getattr(c10d, "new_group", None)
    if new_group is not None:
        replacements[id(new_group)] = _Replacement(new_group, _naming_non_members(new_group), {"new_group"})
    wait_tensor = getattr(funcol, "wait_tensor", None)
    if wait_tensor is not None:
        replacements[id(wait_tensor)] = _Replacement(wait_tensor, _observing_waits(wait_tensor), {"wait_tensor"})
    _rebind_everywhere(replacements)
    _observe_work_waits()
    global _async_tensor
    _async_tensor = getattr(funcol, "AsyncCollectiveTensor", None)
    # Collectives issued below Python (DDP's reducer, process-group methods, compiled graphs).
    try:
        missing = dispatch_hooks.install(_on_dispatched, _on_wait)
    except Exception as error:  # noqa: BLE001 - the Python entry points are still traced; the gap is noted
        missing = [f"every process-group op ({type(error).__name__}: {error})"]
    if missing:
        _unseen.append(
            f"collectives issued below Python (DDP's reducer, process-group methods) are not traced on torch "
            f"{torch.__version__}: {'; '.join(missing)}; a divergence among them cannot be seen"
        )
    labels.track_module_forwards()
    _installed = True


def is_installed() -> bool:
    return _installed


def recorded_count() -> int:
    """How many collectives this rank has recorded in the current test so far (0 outside one).

    Read before and after a call to learn whether it issued any (``harness.collectives_issued``)."""
    test = _test
    return 0 if test is None else test.next_index


def begin_test(trace_path: str) -> None:
    """Start recording into `trace_path` (created or truncated); ends any test still open."""
    global _test
    end_test()
    # O_APPEND: every record is one write at the end of the file, whole or (if the rank is
    # killed mid-write) cut short at the very end, never interleaved (see harness.trace.records).
    fd = os.open(trace_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    labels.begin_test()
    _test = _TestState(fd)
    # torch's count of the groups created in this world so far: the groups this test creates get
    # the names from here on, in creation order.
    _groups.begin(getattr(c10d._world, "group_count", None))
    for text in _unseen:
        with contextlib.suppress(OSError):
            os.write(fd, note_line(text))


def end_test() -> None:
    """Stop recording and close the trace file; forget groups and module names of this test."""
    global _test
    test, _test = _test, None
    if test is not None:
        # What completed by now gets its done line; what did not stays without one.
        test.completion.close()
        os.close(test.fd)
    _groups.end()
    labels.reset()


def set_interceptor(interceptor: Interceptor | None) -> None:
    """Install the one interceptor (used by `harness.rank.faults`), or remove it with None.

    The interceptor sees each record before it is written (it may set `fault` / `skipped`) and
    returns a runner that issues the call its own way, or None to issue it normally. It is consulted
    even when no test is recording, so fault injection also works under torchrun.
    """
    global _interceptor
    _interceptor = interceptor


def wrap(original: Callable, spec: OpSpec, positions: dict[str, int] | None = None) -> Callable:
    """A drop-in replacement for `original` that records (and lets an interceptor take over) each call.

    `positions` maps parameter names to positions, for callables without an inspectable signature.
    """
    if positions is None:
        positions = param_positions(original)

    @functools.wraps(original)
    def traced(*args: Any, **kwargs: Any) -> Any:
        if _is_compiling():
            return original(*args, **kwargs)
        thread = _thread
        if thread.busy or (_test is None and _interceptor is None):
            return original(*args, **kwargs)
        thread.busy = True
        try:
            # The harness never changes an outcome: if the record cannot be built (a group
            # argument this torch resolves differently, a label provider that raises), the
            # failure becomes a note in the trace and the call runs as if untraced.
            test = _test
            try:
                params = CallArguments(args, kwargs, positions)
                built = build_record(spec, params, _groups, _number)
            except Exception as error:  # noqa: BLE001 - whatever broke, the call must still run
                _note(test, spec, error)
                return original(*args, **kwargs)
            if built is None:
                return original(*args, **kwargs)
            record = built.record
            thread.on_device = not built.on_cpu
            if thread.on_device and not params.get("async_op"):
                thread.device_works = []
            runner = _interceptor(record) if _interceptor is not None else None
            # The record goes to disk before the collective is issued: a rank that hangs or dies
            # inside it still shows it, without a "done" line (the trace file's completeness rule).
            if test is not None:
                try:
                    os.write(test.fd, record_line(record))
                except Exception as error:  # noqa: BLE001 - an argument of an unexpected type, a closed fd
                    _note(test, spec, error)
            if runner is None:
                result = original(*args, **kwargs)
            else:
                call = CollectiveCall(record, lambda: original(*args, **kwargs), spec, params.as_dict(spec))
                result = runner(call)
            # Only if the same test is still recording: end_test() may have closed the fd (and
            # a later test reused the number) while this call was blocked in another thread.
            if test is not None and test is _test:
                _completion(test, record.index, spec, params, result, thread.device_works)
            return result
        finally:
            thread.busy = False
            thread.device_works = None

    traced.__trace_original__ = original  # type: ignore[attr-defined]
    return traced


def _completion(
    test: _TestState, index: int, spec: OpSpec, params: CallArguments, result: Any, device_works: list[Any] | None
) -> None:
    """Mark record `index` done now, or when its work completes (`harness.rank.completion`).

    A synchronous call on CPU returned after its work completed; one on a device (NCCL) when the
    works it queued complete. One that returned a `Work` (async_op) completes when the work does;
    a functional collective's in-flight result when it is waited for."""
    try:
        if device_works:
            test.completion.add_work(index, device_works[-1], on_cpu=False)
            return
        if spec.functional:
            in_flight = _async_tensor
            pending = [t for t in flatten_tensors(result) if in_flight is not None and isinstance(t, in_flight)]
            if pending:
                test.completion.add_tensors(index, pending)
                return
        elif params.get("async_op") and result is not None and hasattr(result, "is_completed"):
            test.completion.add_work(index, result, on_cpu=not _thread.on_device)
            return
    except Exception:  # noqa: BLE001 - whatever the result is, the record is done when the call returned
        pass
    test.completion.done(index)


def _observing_waits(wait_tensor: Callable) -> Callable:
    """funcol.wait_tensor, which also tells the completion watch that its tensor is ready."""

    @functools.wraps(wait_tensor)
    def observed_wait(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        result = wait_tensor(tensor, *args, **kwargs)
        _on_wait(tensor)
        return result

    observed_wait.__trace_original__ = wait_tensor  # type: ignore[attr-defined]
    return observed_wait


def _observe_work_waits() -> None:
    """`Work.wait()` tells the completion watch that the work completed (CPU works only count it:
    `harness.rank.completion`). Patched on torch's Work class: Python callers (FSDP, the engine,
    user code) all wait through it; C++ callers do not need to (their works say when they completed)."""
    work_class = c10d.Work
    original = work_class.wait
    if getattr(original, "__trace_original__", None) is not None:
        return

    @functools.wraps(original)
    def observed_wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        test = _test
        if test is not None:
            test.completion.work_waited(self)
        return result

    observed_wait.__trace_original__ = original  # type: ignore[attr-defined]
    work_class.wait = observed_wait


def _on_wait(tensor: Any) -> None:
    test = _test
    if test is not None:
        test.completion.tensor_waited(tensor)


def _on_dispatched(
    spec: DispatchedSpec, run: Callable[[], Any], args: tuple, kwargs: dict, positions: dict[str, int]
) -> Any:
    """A process-group op met below Python (`harness.rank.dispatch_hooks`): recorded unless a traced
    Python entry point on this thread is already recording it."""
    thread = _thread
    test = _test
    if test is None or thread.busy or _is_compiling():
        if thread.device_works is None:
            return run()
        result = run()  # inside a recorded synchronous call on a device: its work says when it completed
        with contextlib.suppress(Exception):
            thread.device_works.append(_unbox_work(result[-1] if isinstance(result, tuple) else result))
        return result
    thread.busy = True
    try:
        try:
            built = dispatched_record(spec, CallArguments(args, kwargs, positions), _groups, _number)
        except Exception as error:  # noqa: BLE001 - whatever broke, the call must still run
            _note(test, spec, error)
            return run()
        if built is None:
            return run()
        record, on_cpu = built
        with contextlib.suppress(OSError):
            os.write(test.fd, record_line(record))
        result = run()
        if test is _test:
            try:
                if spec.functional:
                    test.completion.add_tensors(record.index, flatten_tensors(result))
                else:
                    work = result[-1] if isinstance(result, tuple) else result
                    test.completion.add_work(record.index, _unbox_work(work), on_cpu=on_cpu)
            except Exception:  # noqa: BLE001 - a result of an unexpected shape: done when the call returned
                test.completion.done(record.index)
        return result
    finally:
        thread.busy = False


def _unbox_work(work: Any) -> Any:
    if hasattr(work, "is_completed"):
        return work
    return c10d.Work.unbox(work)


def _naming_non_members(new_group: Callable) -> Callable:
    """`new_group` returning a `NonMemberGroup` where torch returns NON_GROUP_MEMBER (see the module docstring)."""
    positions = param_positions(new_group)

    @functools.wraps(new_group)
    def naming_new_group(*args: Any, **kwargs: Any) -> Any:
        count_before = getattr(c10d._world, "group_count", None)
        group = new_group(*args, **kwargs)
        if type(group) is not int or group != c10d.GroupMember.NON_GROUP_MEMBER:
            return group
        try:
            ranks = CallArguments(args, kwargs, positions).get("ranks")
            members = tuple(sorted(int(rank) for rank in ranks)) if ranks is not None else ()
            # torch named the group from its count of groups, which this call advanced by one;
            # a group named by a hash of its ranks (use_local_synchronization) did not advance it.
            counted = isinstance(count_before, int) and getattr(c10d._world, "group_count", None) == count_before + 1
            return NonMemberGroup(group, members, str(count_before) if counted else "")
        except Exception:  # noqa: BLE001 - naming the group is a nicety; torch's answer stands
            return group

    naming_new_group.__trace_original__ = new_group  # type: ignore[attr-defined]
    return naming_new_group


# ------------------------------------------------------------------------------------ recording


def _note(test: _TestState | None, spec: OpSpec, error: Exception) -> None:
    """Write, once per test and kind of failure, why a call of `spec` could not be recorded."""
    text = (
        f"{spec.op} not recorded: {type(error).__name__}: {error} (the call ran untraced; "
        "this is a harness limitation, please report it with this line)"
    )
    if test is None or test is not _test or text in test.notes:
        return
    test.notes.add(text)
    with contextlib.suppress(OSError):
        os.write(test.fd, note_line(text))
        # Also on the rank's stderr, which the test's report keeps (the trace file is the next
        # test's once this one ends).
        sys.stderr.write(f"[harness] {text}\n")


def _number(op: str, p2p: bool, peer: int | None, group: CallGroup) -> tuple[int, int, int] | None:
    """(rank, index, seq) of the next record of the running test, None when no test is recording:
    its position in the rank's trace, and among the rank's calls on the same process group (or,
    point to point, in the same direction between the same pair)."""
    with _lock:
        test = _test
        if test is None:
            return None
        if test.rank is None:
            test.rank = dist.get_rank()
        rank = test.rank
        index = test.next_index
        test.next_index += 1
        if p2p:
            # Both ends of a pair count the same stream: sends a->b on a, receives from a on b.
            key: tuple = ("p2p", rank, peer) if op in P2P_SEND_OPS else ("p2p", peer, rank)
        else:
            key = (group.member, group.name, group.ranks)
        seq = test.seq_by_key.get(key, 0)
        test.seq_by_key[key] = seq + 1
    return rank, index, seq


# ------------------------------------------------------------------------------------- patching


@dataclass
class _Replacement:
    original: Callable
    wrapper: Callable
    names: set[str]
    """Attribute names under which torch publishes the original (its own name and aliases)."""


def rebind_everywhere(original: Callable, wrapper: Callable, names: set[str]) -> None:
    """Replace module-level references to `original` with `wrapper` in every loaded module, as
    `install` does for the trace's own wrappers (`names`: the names torch publishes it under)."""
    _rebind_everywhere({id(original): _Replacement(original, wrapper, set(names))})


def _rebind_everywhere(replacements: dict[int, _Replacement]) -> None:
    """Replace module-level references to an original with its wrapper, so that bindings made
    before `install` are traced too.

    In torch's own modules only the names torch publishes it under are rebound (an early
    `from torch.distributed import all_gather_single`): torch keeps some originals under internal
    aliases on purpose (`funcol.legacy_allgather` is a Dynamo remapping key). Elsewhere every
    name is, whatever it is: a module the zygote imported before this rank installed the trace
    may hold a private alias, such as the reference engine's `_all_gather_single`.
    """
    by_identity = {id(replacement.original): replacement for replacement in replacements.values()}
    for module_name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        in_torch = module_name == "torch" or module_name.startswith("torch.")
        for name, value in list(namespace.items()):
            replacement = by_identity.get(id(value))
            if replacement is None or value is not replacement.original:
                continue
            if not in_torch or name in replacement.names:
                namespace[name] = replacement.wrapper
