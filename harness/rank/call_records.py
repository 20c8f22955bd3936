"""Rank side: the record of a collective call, built from its arguments.

``build_record`` (a traced Python entry point's call) and ``dispatched_record`` (a process-group
op met at the dispatcher) read what a record says of a call (``harness.trace.records``): op,
group, shapes, dtypes, the label, tensor names, the call site, the root and reduction every member
must agree on, and what each member sends and receives. They patch nothing, issue nothing and
write nothing: the group of a call comes from a ``GroupTable`` and the record's position from a
``Numbering``, both the caller's (``harness.rank.tracing``), so they are tested on their own
(tests/harness_tests/test_call_records.py).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from harness.rank import call_sites, ddp_buckets, labels, tensor_names
from harness.rank.collective_ops import SAME_TENSOR_OPS, DispatchedSpec, Exchange, OpSpec
from harness.trace.records import CollectiveRecord

Numbering = Callable[[str, bool, "int | None", "CallGroup"], "tuple[int, int, int] | None"]
"""(op, point to point, peer, group) -> (rank, index, seq) of the next record, None when no test
is recording (``tracing`` numbers every record of a test, Python and dispatched alike)."""

_DTYPE_NAMES: dict[torch.dtype, str] = {}


class BuiltRecord(NamedTuple):
    """A call's record and whether its tensors are on the CPU (where a call returns completed)."""

    record: CollectiveRecord
    on_cpu: bool


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
class CallGroup:
    """A call's process group as a record names it (see `CollectiveRecord`)."""

    ranks: tuple[int, ...]
    name: str = ""
    number: int | None = None
    member: bool = True


class CallArguments:
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


def param_positions(function: Callable) -> dict[str, int]:
    parameters = inspect.signature(function).parameters.values()
    return {
        p.name: i
        for i, p in enumerate(parameters)
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    }


def flatten_tensors(*values: Any) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    stack = list(reversed(values))
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, (list, tuple)):
            stack.extend(reversed(value))
    return tensors


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


class GroupTable:
    """The process groups of one test's calls, by the group argument each call passed (a
    ProcessGroup, None for the default group, a functional collective's group name, a mesh...).

    A group's number is its position among the groups the test created (torch names a world's
    groups by its count of them, in the order ``new_group`` is called): ``begin`` is told that
    count when the test starts. A later test may create a group whose Python object reuses a
    destroyed one's id, hence ``begin`` forgets the groups seen before."""

    def __init__(self) -> None:
        self._by_argument: dict[Any, CallGroup] = {}
        self._groups_before: int | None = None

    def begin(self, groups_before: int | None) -> None:
        self._by_argument.clear()
        self._groups_before = groups_before

    def end(self) -> None:
        self._by_argument.clear()
        self._groups_before = None

    def of_c10d(self, group: Any) -> CallGroup:
        """The group of a c10d call's ``group`` argument."""
        found = self._by_argument.get(group)  # never an int key: every NonMemberGroup equals -100
        if found is not None:
            return found
        if isinstance(group, int) and group == c10d.GroupMember.NON_GROUP_MEMBER:
            if isinstance(group, NonMemberGroup):
                return CallGroup(group.members, group.name, self._number(group.name), member=False)
            return CallGroup((), member=False)  # made by torch's new_group before the trace was installed
        found = self._by_argument[group] = self._of_process_group(c10d._get_default_group() if group is None else group)
        return found

    def of_functional(self, group: Any) -> CallGroup | None:
        """The group of a functional-collective group argument, without creating any group."""
        if isinstance(group, tuple) and len(group) == 2 and not isinstance(group[0], int):  # (DeviceMesh, dim)
            mesh, dim = group
            return self.of_c10d(mesh.get_group(dim))
        if isinstance(group, (list, tuple)):  # ranks only: torch finds the group by them, unnamed here
            if group and isinstance(group[0], (list, tuple)):  # MPMD: the row holding this rank
                me = dist.get_rank()
                row = next((tuple(row) for row in group if me in row), None)
                return None if row is None else CallGroup(row)
            return CallGroup(tuple(group))
        if isinstance(group, str):
            found = self._by_argument.get(group)
            if found is None:
                resolved = torch._C._distributed_c10d._resolve_process_group(group)
                found = self._by_argument[group] = self._of_process_group(resolved)
            return found
        if group is None or isinstance(group, dist.ProcessGroup):
            return self.of_c10d(group)
        return self.of_c10d(group.get_group())  # 1-D DeviceMesh

    def _of_process_group(self, process_group: dist.ProcessGroup) -> CallGroup:
        ranks = tuple(dist.get_process_group_ranks(process_group))
        name = getattr(process_group, "group_name", None)  # a ProcessGroup property on recent torch
        if not isinstance(name, str):
            name = getattr(c10d._world, "pg_names", {}).get(process_group, "")
        number = 0 if process_group is c10d._get_default_group() else self._number(name)
        return CallGroup(ranks, name, number)

    def _number(self, name: str) -> int | None:
        """k for the k-th group this test created, None for one created before the test began or
        named otherwise (a hash of its ranks), and outside a test."""
        if self._groups_before is None or not name.isdigit():
            return None
        created = int(name) - self._groups_before
        return created + 1 if created >= 0 else None


def _rank_argument(names: tuple[str, str], params: CallArguments, group: tuple[int, ...]) -> int | None:
    """The global rank named by a (global-rank parameter, group-rank parameter) pair."""
    global_name, group_name = names
    value = params.get(global_name)
    if value is None and group_name:
        group_value = params.get(group_name)
        value = group[group_value] if group_value is not None and 0 <= group_value < len(group) else None
    return value


def _agreed_args(spec: OpSpec, params: CallArguments, root: int | None) -> tuple[tuple[str, str], ...]:
    """The non-tensor arguments every member must pass alike: the root rank and the reduction."""
    agreed: list[tuple[str, str]] = []
    if spec.root is not None:
        agreed.append(("root", str(root)))
    if spec.reduce_op is not None:
        agreed.append(("op", _reduce_op_name(params.get(spec.reduce_op), spec.default_reduce_op)))
    return tuple(agreed)


def _exchange_sizes(
    kind: str, params: CallArguments, group: tuple[int, ...], rank: int, root: int | None
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


def _dispatched_reduce_op(value: Any) -> str | None:
    """SUM, AVG, ... from a dispatched call's reduction (a script object of c10d's ReduceOp, or
    funcol's string); None where this torch's script object does not expose it (torch 2.6)."""
    if isinstance(value, str):
        return value.upper()
    if value is None:
        return "SUM"
    try:
        number = value.op  # its RedOpType, as an attribute or a method
        number = int(number() if callable(number) else number)
    except Exception:  # noqa: BLE001 - not readable here: the reduction is left out of the record
        return None
    return _RED_OP_NAMES.get(number)


_RED_OP_NAMES: dict[int, str] = {int(v): name for name, v in dist.ReduceOp.RedOpType.__members__.items()}


def _unbox_group(value: Any) -> Any:
    """A process group argument as Python's `ProcessGroup` (the dispatcher hands a script object)."""
    if value is None or isinstance(value, (str, dist.ProcessGroup)):
        return value
    return dist.ProcessGroup.unbox(value)


def _group_rank_to_global(value: Any, ranks: tuple[int, ...]) -> int | None:
    if not isinstance(value, int) or not 0 <= value < len(ranks):
        return None
    return ranks[value]


def build_record(spec: OpSpec, params: CallArguments, groups: GroupTable, number: Numbering) -> BuiltRecord | None:
    """The record of a call of a traced Python entry point, or None for a call not to record (a
    functional collective while a graph is being traced)."""
    if spec.op.startswith("funcol."):
        import torch.distributed._functional_collectives as funcol

        if funcol._are_we_tracing():
            return None
        process_group = groups.of_functional(params.get(spec.group))
    else:
        process_group = groups.of_c10d(params.get(spec.group))
    if process_group is None:
        return None
    group = process_group.ranks
    tensors = flatten_tensors(*(params.get(name) for name in spec.inputs))
    shapes = tuple(tuple(t.shape) for t in tensors)
    dtypes = tuple(dtype_name(t.dtype) for t in tensors)
    numel = sum(t.numel() for t in tensors)
    uneven = spec.always_uneven or any(params.get(name) is not None for name in spec.uneven_when)
    peer = _rank_argument(spec.peer, params, group) if spec.peer else None
    label = labels.current_label()
    names = tensor_names.names_of(tensors) if spec.same_tensor else ()
    site = call_sites.call_site(3)  # above build_record and the wrapper that called it
    root = _rank_argument(spec.root, params, group) if spec.root is not None else None
    agreed = _agreed_args(spec, params, root)
    # With only an interceptor listening (faults under torchrun) there is no numbering.
    rank, index, seq = number(spec.op, bool(spec.peer), peer, process_group) or (dist.get_rank(), -1, -1)
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
    return BuiltRecord(record, on_cpu=not tensors or tensors[0].device.type == "cpu")


def dispatched_record(
    spec: DispatchedSpec, args: CallArguments, groups: GroupTable, number: Numbering
) -> BuiltRecord | None:
    """The record of a process-group op met below Python (``harness.rank.dispatch_hooks``), or
    None for a call not to record (fake or meta tensors, a compiled graph being traced)."""
    tensors = flatten_tensors(args.get(spec.inputs)) if spec.inputs else []
    if any(type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter for t in tensors):
        return None  # a tensor subclass (FakeTensor while tracing): not a collective being run
    if any(t.device.type == "meta" for t in tensors):
        return None
    group_argument = args.get(spec.group)
    if spec.functional:
        process_group_object = None
        group = groups.of_functional(
            group_argument if isinstance(group_argument, str) else _unbox_group(group_argument)
        )
    else:
        process_group_object = _unbox_group(group_argument)
        group = groups.of_c10d(process_group_object)
    if group is None:
        return None
    ranks = group.ranks
    label = labels.current_label()
    if not label and spec.op == "all_reduce" and process_group_object is not None:
        label = ddp_buckets.bucket_label(tensors, process_group_object)
    # A DDP bucket's buffer is no parameter's: its label names what it holds.
    names = tensor_names.names_of(tensors) if spec.op in SAME_TENSOR_OPS and not label.startswith("DDP bucket") else ()
    agreed: list[tuple[str, str]] = []
    root = _group_rank_to_global(args.get(spec.root), ranks) if spec.root else None
    if spec.root:
        agreed.append(("root", str(root)))
    if spec.reduce_op:
        reduction = _dispatched_reduce_op(args.get(spec.reduce_op))
        if reduction is not None:
            agreed.append(("op", reduction))
    peer = _group_rank_to_global(args.get(spec.peer), ranks) if spec.peer else None
    uneven = spec.always_uneven or any(args.get(name) for name in spec.uneven_when)
    numbered = number(spec.op, bool(spec.peer), peer, group)
    if numbered is None:
        return None
    rank, index, seq = numbered
    record = CollectiveRecord(
        rank=rank,
        index=index,
        seq=seq,
        op=spec.op,
        group=ranks,
        shapes=tuple(tuple(t.shape) for t in tensors),
        dtypes=tuple(dtype_name(t.dtype) for t in tensors),
        numel=sum(t.numel() for t in tensors),
        label=label,
        peer=peer,
        uneven=uneven,
        tensors=names,
        site=call_sites.call_site(4),  # above this, the tracer's handler, the hook's run and its kernel
        args=tuple(agreed),
        async_op=True,
        asymmetric=call_sites.in_asymmetric_region(),
        group_name=group.name,
        group_number=group.number,
    )
    return BuiltRecord(record, on_cpu=not tensors or tensors[0].device.type == "cpu")


__all__ = [
    "BuiltRecord",
    "CallArguments",
    "CallGroup",
    "GroupTable",
    "NonMemberGroup",
    "Numbering",
    "build_record",
    "dispatched_record",
    "dtype_name",
    "flatten_tensors",
    "param_positions",
]
