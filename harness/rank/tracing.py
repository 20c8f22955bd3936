"""Rank side of the collective trace: wraps torch.distributed's entry points and records each call.

Why a trace: torch's own checks catch a divergent collective only when op, shape or dtype differ.
A *same-shape* mismatch (rank 0 all-gathers layer1 while rank 1 all-gathers layer2) silently
corrupts weights. Recording what each rank issued, with a semantic label (`harness.rank.labels`), lets
the parent diff the ranks after the test (`harness.trace.divergence`), even after a rank was SIGKILLed
or hung. The records and their file are `harness.trace.records`; the parent reads only that module.

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
    Collectives issued from C++ alone (DDP's reducer) are not seen.
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
import inspect
import math
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from harness.rank import call_sites, labels, tensor_names
from harness.rank.collective_ops import (
    BROADCAST_COALESCED,
    BROADCAST_COALESCED_PARAMS,
    C10D_SPECS,
    FUNCOL_SPECS,
    KNOWN_OPS,
    Exchange,
    OpSpec,
)
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

            return [t.wait() if isinstance(t, AsyncCollectiveTensor) else t for t in _flatten_tensors(result)]
        if self.async_op and result is not None:
            result.wait()
        return _flatten_tensors(*(self.params.get(name) for name in self.spec.outputs))

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


class _TestState:
    """What is being recorded for the current test (one instance per test)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.next_index = 0
        self.seq_by_key: dict[tuple, int] = {}
        self.rank: int | None = None
        self.notes: set[str] = set()
        # torch's count of the groups created in this world so far: the groups this test creates
        # get the names from here on, in creation order.
        self.groups_before: int | None = getattr(c10d._world, "group_count", None)


class NonMemberGroup(int):
    """What the traced `new_group` returns on a rank that is not a member of the new group, in place
    of torch's `GroupMember.NON_GROUP_MEMBER` (-100): equal to it, as torch compares (`==`), and
    carrying the group's members and torch's name for it, so that a collective called on it is
    recorded with the group it named."""

    members: tuple[int, ...]
    name: str

    def __new__(cls, value: int, members: tuple[int, ...], name: str) -> NonMemberGroup:
        marker = super().__new__(cls, value)
        marker.members, marker.name = members, name
        return marker

    def __reduce__(self) -> tuple:
        return (NonMemberGroup, (int(self), self.members, self.name))

    def __copy__(self) -> NonMemberGroup:
        return self

    def __deepcopy__(self, memo: dict) -> NonMemberGroup:
        return self


@dataclass(frozen=True, slots=True)
class _Group:
    """A call's process group as a record names it (see `CollectiveRecord`)."""

    ranks: tuple[int, ...]
    name: str = ""
    number: int | None = None
    member: bool = True


_thread = _ThreadState()
_lock = threading.Lock()  # index and seq numbering: collectives may be issued from several threads
_test: _TestState | None = None
_interceptor: Interceptor | None = None
_groups: dict[Any, _Group] = {}
"""Group arguments seen in this test (ProcessGroup, None, a funcol group name) -> their group."""
_dtype_names: dict[torch.dtype, str] = {}
_installed = False
_is_compiling = torch.compiler.is_compiling


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
    _rebind_everywhere(replacements)
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


def end_test() -> None:
    """Stop recording and close the trace file; forget groups and module names of this test."""
    global _test
    test, _test = _test, None
    if test is not None:
        os.close(test.fd)
    # A later test may create a group whose Python object reuses a destroyed one's id.
    _groups.clear()
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
        positions = _param_positions(original)

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
                params = _Params(args, kwargs, positions)
                record = _build_record(spec, params)
            except Exception as error:  # noqa: BLE001 - whatever broke, the call must still run
                _note(test, spec, error)
                return original(*args, **kwargs)
            if record is None:
                return original(*args, **kwargs)
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
                with contextlib.suppress(OSError):
                    os.write(test.fd, done_line(record.index))
            return result
        finally:
            thread.busy = False

    traced.__trace_original__ = original  # type: ignore[attr-defined]
    return traced


def _naming_non_members(new_group: Callable) -> Callable:
    """`new_group` returning a `NonMemberGroup` where torch returns NON_GROUP_MEMBER (see the module docstring)."""
    positions = _param_positions(new_group)

    @functools.wraps(new_group)
    def naming_new_group(*args: Any, **kwargs: Any) -> Any:
        count_before = getattr(c10d._world, "group_count", None)
        group = new_group(*args, **kwargs)
        if type(group) is not int or group != c10d.GroupMember.NON_GROUP_MEMBER:
            return group
        try:
            ranks = _Params(args, kwargs, positions).get("ranks")
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


class _Params:
    """Positional-or-keyword argument lookup without the cost of `Signature.bind`."""

    __slots__ = ("args", "kwargs", "positions")

    def __init__(self, args: tuple, kwargs: dict, positions: dict[str, int]) -> None:
        self.args, self.kwargs, self.positions = args, kwargs, positions

    def get(self, name: str) -> Any:
        position = self.positions.get(name)
        if position is not None and position < len(self.args):
            return self.args[position]
        return self.kwargs.get(name)

    def as_dict(self, spec: OpSpec) -> dict[str, Any]:
        names = {*spec.outputs, "async_op"}
        return {name: self.get(name) for name in names}


def _build_record(spec: OpSpec, params: _Params) -> CollectiveRecord | None:
    """The record for this call, or None when this rank is not a member of the call's group."""
    if spec.op.startswith("funcol."):
        import torch.distributed._functional_collectives as funcol

        if funcol._are_we_tracing():
            return None
        process_group = _funcol_group(params.get(spec.group))
    else:
        process_group = _c10d_group(params.get(spec.group))
    if process_group is None:
        return None
    group = process_group.ranks
    tensors = _flatten_tensors(*(params.get(name) for name in spec.inputs))
    shapes = tuple(tuple(t.shape) for t in tensors)
    dtypes = tuple(_dtype_name(t.dtype) for t in tensors)
    numel = sum(t.numel() for t in tensors)
    uneven = spec.always_uneven or any(params.get(name) is not None for name in spec.uneven_when)
    peer = _rank_argument(spec.peer, params, group) if spec.peer else None
    label = labels.current_label()
    names = tensor_names.names_of(tensors) if spec.same_tensor else ()
    site = call_sites.call_site(3)  # above _build_record and the wrapper
    root = _rank_argument(spec.root, params, group) if spec.root is not None else None
    agreed = _agreed_args(spec, params, root)
    with _lock:
        test = _test
        if test is None:  # only an interceptor is listening (faults under torchrun): no numbering
            index, seq, rank = -1, -1, dist.get_rank()
        else:
            if test.rank is None:
                test.rank = dist.get_rank()
            rank = test.rank
            index = test.next_index
            test.next_index += 1
            if spec.peer:
                # Both ends of a pair count the same stream: sends a->b on a, receives from a on b.
                key: tuple = ("p2p", rank, peer) if spec.op in P2P_SEND_OPS else ("p2p", peer, rank)
            else:
                key = (process_group.member, process_group.name, group)
            seq = test.seq_by_key.get(key, 0)
            test.seq_by_key[key] = seq + 1
    record = CollectiveRecord(
        rank=rank,
        index=index,
        seq=seq,
        op=spec.op,
        group=group,
        shapes=shapes,
        dtypes=dtypes,
        numel=numel,
        label=label,
        peer=peer,
        uneven=uneven,
        tensors=names,
        site=site,
        args=agreed,
        async_op=bool(params.get("async_op")),
        asymmetric=call_sites.in_asymmetric_region(),
        group_name=process_group.name,
        group_number=process_group.number,
    )
    # Set only where they differ from the defaults: this runs before every collective.
    if not process_group.member:
        record.member = False
    elif spec.exchange is not None:
        # Sizes that cannot be read (arguments torch itself will reject) are left unknown, and
        # not compared: the record stands without them.
        with contextlib.suppress(Exception):
            record.sends, record.receives = _exchange_sizes(spec.exchange, params, group, rank, root)
    return record


def _flatten_tensors(*values: Any) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    stack = list(reversed(values))
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, (list, tuple)):
            stack.extend(reversed(value))
    return tensors


def _dtype_name(dtype: torch.dtype) -> str:
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).removeprefix("torch.")
    return name


def _c10d_group(group: Any) -> _Group:
    found = _groups.get(group)  # never an int key: every NonMemberGroup equals -100
    if found is not None:
        return found
    if isinstance(group, int) and group == c10d.GroupMember.NON_GROUP_MEMBER:
        if isinstance(group, NonMemberGroup):
            return _Group(group.members, group.name, _group_number(group.name), member=False)
        return _Group((), member=False)  # made by torch's new_group before the trace was installed
    found = _groups[group] = _process_group(c10d._get_default_group() if group is None else group)
    return found


def _process_group(process_group: dist.ProcessGroup) -> _Group:
    ranks = tuple(dist.get_process_group_ranks(process_group))
    name = getattr(process_group, "group_name", None)  # a ProcessGroup property on recent torch
    if not isinstance(name, str):
        name = getattr(c10d._world, "pg_names", {}).get(process_group, "")
    number = 0 if process_group is c10d._get_default_group() else _group_number(name)
    return _Group(ranks, name, number)


def _group_number(name: str) -> int | None:
    """k for the k-th group this test created (torch names groups by its count of them), None for
    one created before the test began or named otherwise (a hash of its ranks)."""
    test = _test
    if test is None or test.groups_before is None or not name.isdigit():
        return None
    created = int(name) - test.groups_before
    return created + 1 if created >= 0 else None


def _funcol_group(group: Any) -> _Group | None:
    """The group of a functional-collective group argument, without creating any group."""
    if isinstance(group, tuple) and len(group) == 2 and not isinstance(group[0], int):  # (DeviceMesh, dim)
        mesh, dim = group
        return _c10d_group(mesh.get_group(dim))
    if isinstance(group, (list, tuple)):  # ranks only: torch finds the group by them, unnamed here
        if group and isinstance(group[0], (list, tuple)):  # MPMD: the row holding this rank
            me = dist.get_rank()
            row = next((tuple(row) for row in group if me in row), None)
            return None if row is None else _Group(row)
        return _Group(tuple(group))
    if isinstance(group, str):
        found = _groups.get(group)
        if found is None:
            found = _groups[group] = _process_group(torch._C._distributed_c10d._resolve_process_group(group))
        return found
    if group is None or isinstance(group, dist.ProcessGroup):
        return _c10d_group(group)
    return _c10d_group(group.get_group())  # 1-D DeviceMesh


def _rank_argument(names: tuple[str, str], params: _Params, group: tuple[int, ...]) -> int | None:
    """The global rank named by a (global-rank parameter, group-rank parameter) pair."""
    global_name, group_name = names
    value = params.get(global_name)
    if value is None and group_name:
        group_value = params.get(group_name)
        value = group[group_value] if group_value is not None and 0 <= group_value < len(group) else None
    return value


def _agreed_args(spec: OpSpec, params: _Params, root: int | None) -> tuple[tuple[str, str], ...]:
    """The non-tensor arguments every member must pass alike: the root rank and the reduction."""
    agreed: list[tuple[str, str]] = []
    if spec.root is not None:
        agreed.append(("root", str(root)))
    if spec.reduce_op is not None:
        agreed.append(("op", _reduce_op_name(params.get(spec.reduce_op), spec.default_reduce_op)))
    return tuple(agreed)


def _exchange_sizes(
    kind: str, params: _Params, group: tuple[int, ...], rank: int, root: int | None
) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """Elements this rank sends to and expects from each member, in the group's order (`Exchange`)."""
    size = len(group)
    if kind == Exchange.SPLITS:
        functional = params.get("self")
        source = functional if functional is not None else params.get("input")
        target = source if functional is not None else params.get("output")
        if not isinstance(source, torch.Tensor) or not isinstance(target, torch.Tensor):
            return None, None
        sends = _split_elements(source, params.get("input_split_sizes"), size)
        return sends, _split_elements(target, params.get("output_split_sizes"), size)
    if kind == Exchange.LISTS:
        return _numels(params.get("input_tensor_list")), _numels(params.get("output_tensor_list"))
    if kind == Exchange.GATHER_LIST:
        return _same_to_all(params.get("tensor"), size), _numels(params.get("tensor_list"))
    if kind == Exchange.REDUCE_SCATTER_LIST:
        return _numels(params.get("input_list")), _same_to_all(params.get("output"), size)
    if root is None:
        root = 0  # torch's default root when neither src/dst nor its group rank is given: global rank 0
    nothing = (0,) * size
    if kind == Exchange.GATHER:
        tensor = params.get("tensor")
        sends = tuple(tensor.numel() if member == root else 0 for member in group) if tensor is not None else None
        return sends, (_numels(params.get("gather_list")) if rank == root else nothing)
    if kind == Exchange.SCATTER:
        tensor = params.get("tensor")
        receives = tuple(tensor.numel() if member == root else 0 for member in group) if tensor is not None else None
        return (_numels(params.get("scatter_list")) if rank == root else nothing), receives
    return None, None


def _split_elements(tensor: torch.Tensor, splits: Any, size: int) -> tuple[int, ...]:
    """Elements per member of an all_to_all_single side: its split sizes (rows; an even split when
    None or empty, as torch reads them) times the elements of a row."""
    row = math.prod(tensor.shape[1:])
    if not splits:
        rows = tensor.shape[0] if tensor.dim() else 1
        return (rows // size * row,) * size
    return tuple(int(split) * row for split in splits)


def _numels(tensors: Any) -> tuple[int, ...] | None:
    if not isinstance(tensors, (list, tuple)):
        return None
    return tuple(t.numel() if isinstance(t, torch.Tensor) else 0 for t in tensors)


def _same_to_all(tensor: Any, size: int) -> tuple[int, ...] | None:
    return (tensor.numel(),) * size if isinstance(tensor, torch.Tensor) else None


def _reduce_op_name(value: Any, default: str) -> str:
    """SUM, AVG, ... whether given as c10d's enum, a `ReduceOp` object or funcol's string."""
    if value is None:
        return default
    if isinstance(value, str):
        return value.upper()
    value = getattr(value, "op", value)  # a ReduceOp object wraps its RedOpType
    name = getattr(value, "name", None)
    return name if isinstance(name, str) else str(value).rpartition(".")[2]


# ------------------------------------------------------------------------------------- patching


def _param_positions(function: Callable) -> dict[str, int]:
    parameters = inspect.signature(function).parameters.values()
    return {
        p.name: i
        for i, p in enumerate(parameters)
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    }


@dataclass
class _Replacement:
    original: Callable
    wrapper: Callable
    names: set[str]
    """Attribute names under which torch publishes the original (its own name and aliases)."""


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
