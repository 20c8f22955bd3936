"""The table of traced collective entry points: for each, how to read its arguments.

`harness.rank.tracing` wraps every entry point listed here; the op name a record carries is the
canonical one given here, so aliases (`all_gather_single`, `_all_gather_base`,
`all_gather_into_tensor`) compare equal across ranks that spell an op differently.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OpSpec:
    """How to read one entry point's arguments.

    inputs: parameters holding the tensors all members must agree on (recorded shapes/dtypes).
    outputs: parameters the op writes into; a functional op (`functional=True`) returns its output.
    uneven_when: parameters that, when not None, let input shapes differ across ranks.
    peer: (global-rank parameter, group-rank parameter) of a point-to-point op.
    root: (global-rank parameter, group-rank parameter) of the rank a rooted collective sends
        from or gathers to (broadcast src, reduce dst, ...); every member must name the same one.
    reduce_op: the parameter holding the reduction, which every member must agree on;
        `default_reduce_op` is what an omitted one means.
    exchange: how to read what each member sends to and expects from each other member, for
        collectives whose members exchange pieces of their own (`Exchange`); None for the others.
    """

    op: str
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    group: str = "group"
    functional: bool = False
    always_uneven: bool = False
    uneven_when: tuple[str, ...] = ()
    peer: tuple[str, str] | None = None
    root: tuple[str, str] | None = None
    reduce_op: str | None = None
    default_reduce_op: str = "SUM"
    exchange: str | None = None

    @property
    def same_tensor(self) -> bool:
        """Every member passes the same logical tensor (all-reduce, broadcast, reduce,
        reduce-scatter), so the tensors' names must agree (`harness.rank.tensor_names`). Not gathers,
        scatters and all-to-all, whose inputs are each rank's own piece: in a sharding engine,
        which parameter a rank's piece belongs to depends on the rank."""
        return self.op in SAME_TENSOR_OPS


class Exchange:
    """How an exchanging collective's arguments say what each member sends and expects (the tracer
    turns them into `CollectiveRecord.sends` / `receives`, elements per member)."""

    SPLITS = "splits"
    """all_to_all_single: input and output split sizes (rows; even when omitted)."""
    LISTS = "lists"
    """all_to_all: one input and one output tensor per member."""
    GATHER_LIST = "gather_list"
    """all_gather with a list: the same input to everyone, one output tensor per member."""
    REDUCE_SCATTER_LIST = "reduce_scatter_list"
    """reduce_scatter with a list: one input tensor per member, the same output from everyone."""
    GATHER = "gather"
    """gather: the input to the root only; the root's list holds one tensor per member."""
    SCATTER = "scatter"
    """scatter: the root's list holds one tensor per member; everyone's output from the root."""


_GATHER_INTO_TENSOR = OpSpec("all_gather_into_tensor", ("input_tensor",), ("output_tensor",))
_REDUCE_SCATTER_TENSOR = OpSpec("reduce_scatter_tensor", ("input",), ("output",), reduce_op="op")
_FROM_SRC = ("src", "group_src")
_TO_DST = ("dst", "group_dst")
_SEND: dict = {"inputs": ("tensor",), "peer": ("dst", "group_dst")}
_RECV: dict = {"inputs": ("tensor",), "outputs": ("tensor",), "peer": ("src", "group_src")}

# torch.distributed.distributed_c10d entry points, by attribute name.
C10D_SPECS: dict[str, OpSpec] = {
    "all_reduce": OpSpec("all_reduce", ("tensor",), ("tensor",), reduce_op="op"),
    "all_reduce_coalesced": OpSpec("all_reduce_coalesced", ("tensors",), ("tensors",), reduce_op="op"),
    "broadcast": OpSpec("broadcast", ("tensor",), ("tensor",), root=_FROM_SRC),
    "reduce": OpSpec("reduce", ("tensor",), ("tensor",), root=_TO_DST, reduce_op="op"),
    "all_gather": OpSpec("all_gather", ("tensor",), ("tensor_list",), exchange=Exchange.GATHER_LIST),
    "all_gather_single": _GATHER_INTO_TENSOR,
    "all_gather_into_tensor": _GATHER_INTO_TENSOR,
    "_all_gather_base": _GATHER_INTO_TENSOR,
    "all_gather_coalesced": OpSpec("all_gather_coalesced", ("input_tensor_list",), ("output_tensor_lists",)),
    "reduce_scatter": OpSpec(
        "reduce_scatter", ("input_list",), ("output",), reduce_op="op", exchange=Exchange.REDUCE_SCATTER_LIST
    ),
    "reduce_scatter_single": _REDUCE_SCATTER_TENSOR,
    "reduce_scatter_tensor": _REDUCE_SCATTER_TENSOR,
    "_reduce_scatter_base": _REDUCE_SCATTER_TENSOR,
    "all_to_all": OpSpec(
        "all_to_all", ("input_tensor_list",), ("output_tensor_list",), always_uneven=True, exchange=Exchange.LISTS
    ),
    "all_to_all_single": OpSpec(
        "all_to_all_single",
        ("input",),
        ("output",),
        uneven_when=("output_split_sizes", "input_split_sizes"),
        exchange=Exchange.SPLITS,
    ),
    "barrier": OpSpec("barrier"),
    "monitored_barrier": OpSpec("monitored_barrier"),
    "send": OpSpec("send", **_SEND),
    "isend": OpSpec("isend", **_SEND),
    "recv": OpSpec("recv", **_RECV),
    "irecv": OpSpec("irecv", **_RECV),
    "all_gather_object": OpSpec("all_gather_object"),
    "gather_object": OpSpec("gather_object", root=_TO_DST),
    "broadcast_object_list": OpSpec("broadcast_object_list", root=_FROM_SRC),
    "scatter_object_list": OpSpec("scatter_object_list", root=_FROM_SRC),
    "send_object_list": OpSpec("send_object_list", peer=("dst", "group_dst")),
    "recv_object_list": OpSpec("recv_object_list", peer=("src", "group_src")),
    "scatter": OpSpec("scatter", ("tensor",), ("tensor",), root=_FROM_SRC, exchange=Exchange.SCATTER),
    "gather": OpSpec("gather", ("tensor",), ("gather_list",), root=_TO_DST, exchange=Exchange.GATHER),
}

# torch.distributed._broadcast_coalesced is a C++ builtin without an inspectable signature.
BROADCAST_COALESCED = OpSpec("broadcast_coalesced", ("tensors",), ("tensors",), group="process_group", root=("src", ""))
BROADCAST_COALESCED_PARAMS = ("process_group", "tensors", "buffer_size", "src")

_FUNCOL_GATHER = OpSpec("funcol.all_gather", ("self",), functional=True)
_FUNCOL_REDUCE_SCATTER = OpSpec("funcol.reduce_scatter", ("self",), functional=True, reduce_op="reduceOp")
_FUNCOL_ALL_TO_ALL = OpSpec(
    "funcol.all_to_all_single",
    ("self",),
    functional=True,
    uneven_when=("output_split_sizes", "input_split_sizes"),
    exchange=Exchange.SPLITS,
)
_FUNCOL_GATHER_COALESCED = OpSpec("funcol.all_gather_coalesced", ("self",), functional=True)
_FUNCOL_RS_COALESCED = OpSpec("funcol.reduce_scatter_coalesced", ("inputs",), functional=True, reduce_op="reduceOp")

# torch.distributed._functional_collectives entry points (DTensor, user code).
FUNCOL_SPECS: dict[str, OpSpec] = {
    "all_gather_single": _FUNCOL_GATHER,
    "all_gather_single_autograd": _FUNCOL_GATHER,
    "all_gather_tensor": _FUNCOL_GATHER,
    "all_gather_tensor_autograd": _FUNCOL_GATHER,
    "all_gather_tensor_inplace": OpSpec("funcol.all_gather", ("input_tensor",), ("output_tensor",)),
    "all_gather_inplace": OpSpec("funcol.all_gather", ("tensor",), ("tensor_list",), exchange=Exchange.GATHER_LIST),
    "reduce_scatter_single": _FUNCOL_REDUCE_SCATTER,
    "reduce_scatter_single_autograd": _FUNCOL_REDUCE_SCATTER,
    "reduce_scatter_tensor": _FUNCOL_REDUCE_SCATTER,
    "reduce_scatter_tensor_autograd": _FUNCOL_REDUCE_SCATTER,
    "reduce_scatter_tensor_inplace": OpSpec("funcol.reduce_scatter", ("input",), ("output",), reduce_op="op"),
    "all_reduce": OpSpec("funcol.all_reduce", ("self",), functional=True, reduce_op="reduceOp"),
    "all_reduce_inplace": OpSpec("funcol.all_reduce", ("tensor",), ("tensor",), reduce_op="op"),
    "all_reduce_coalesced": OpSpec("funcol.all_reduce_coalesced", ("self",), functional=True, reduce_op="reduceOp"),
    "all_gather_single_coalesced": _FUNCOL_GATHER_COALESCED,
    "all_gather_into_tensor_coalesced": _FUNCOL_GATHER_COALESCED,
    "reduce_scatter_single_coalesced": _FUNCOL_RS_COALESCED,
    "reduce_scatter_tensor_coalesced": _FUNCOL_RS_COALESCED,
    "all_to_all_single": _FUNCOL_ALL_TO_ALL,
    "all_to_all_single_autograd": _FUNCOL_ALL_TO_ALL,
    "all_to_all_inplace": OpSpec(
        "funcol.all_to_all_single",
        ("input",),
        ("output",),
        uneven_when=("output_split_sizes", "input_split_sizes"),
        exchange=Exchange.SPLITS,
    ),
    "broadcast": OpSpec("funcol.broadcast", ("self",), functional=True, root=("src", "")),
    "permute_tensor": OpSpec("funcol.permute_tensor", ("self",), functional=True),
}


@dataclass(frozen=True)
class DispatchedSpec:
    """How to read one dispatcher op's arguments (by the names of its schema, which stay stable
    across torch versions while their positions move): the ops every process-group collective
    passes through, whoever issued it (`harness.rank.dispatch_hooks`).

    op: the canonical name the record carries (the Python entry point's, so a rank that issued a
        collective from Python and one whose C++ issued it compare equal).
    inputs: the argument holding the tensors every member must agree on.
    group: the process group argument (a `ProcessGroup` script object, or a functional op's group name).
    root / peer: the argument holding the root's / the other side's rank within the group.
    reduce_op: the argument holding the reduction.
    functional: an op of `_c10d_functional`: it returns its output, done when that is waited for.
    """

    op: str
    inputs: str
    group: str = "process_group"
    root: str | None = None
    peer: str | None = None
    reduce_op: str | None = None
    functional: bool = False
    always_uneven: bool = False
    uneven_when: tuple[str, ...] = ()


_GROUP_NAME = "group_name"
_DISPATCHED_SPLITS = ("output_split_sizes", "input_split_sizes")

# torch.ops.c10d: what ProcessGroup's C++ methods dispatch to (DDP's reducer, Python's entry points,
# `ProcessGroup.allreduce(...)` called directly).
C10D_DISPATCHED: dict[str, DispatchedSpec] = {
    "allreduce_": DispatchedSpec("all_reduce", "tensors", reduce_op="reduce_op"),
    "allreduce_coalesced_": DispatchedSpec("all_reduce_coalesced", "tensors", reduce_op="reduce_op"),
    "broadcast_": DispatchedSpec("broadcast", "tensors", root="root_rank"),
    "reduce_": DispatchedSpec("reduce", "tensors", root="root_rank", reduce_op="reduce_op"),
    "allgather_": DispatchedSpec("all_gather", "input_tensors"),
    "_allgather_base_": DispatchedSpec("all_gather_into_tensor", "input_tensor"),
    "allgather_coalesced_": DispatchedSpec("all_gather_coalesced", "input_list"),
    "allgather_into_tensor_coalesced_": DispatchedSpec("all_gather_into_tensor_coalesced", "inputs"),
    "reduce_scatter_": DispatchedSpec("reduce_scatter", "input_tensors", reduce_op="reduce_op"),
    "_reduce_scatter_base_": DispatchedSpec("reduce_scatter_tensor", "input_tensor", reduce_op="reduce_op"),
    "reduce_scatter_tensor_coalesced_": DispatchedSpec(
        "reduce_scatter_tensor_coalesced", "inputs", reduce_op="reduce_op"
    ),
    "alltoall_": DispatchedSpec("all_to_all", "input_tensors", always_uneven=True),
    "alltoall_base_": DispatchedSpec("all_to_all_single", "input", uneven_when=_DISPATCHED_SPLITS),
    "gather_": DispatchedSpec("gather", "input_tensors", root="root_rank"),
    "scatter_": DispatchedSpec("scatter", "output_tensors", root="root_rank"),
    "barrier": DispatchedSpec("barrier", ""),
    "send": DispatchedSpec("send", "tensors", peer="dst"),
    "recv_": DispatchedSpec("recv", "tensors", peer="src"),
}

# torch.ops._c10d_functional: functional collectives (DTensor, compiled graphs), whose C++ calls the
# process group below the dispatcher's autograd layer, so they are met here rather than in c10d's.
FUNCTIONAL_DISPATCHED: dict[str, DispatchedSpec] = {
    name: DispatchedSpec(op, inputs, group=_GROUP_NAME, functional=True, **extra)
    for name, (op, inputs, extra) in {
        "all_reduce": ("funcol.all_reduce", "input", {"reduce_op": "reduce_op"}),
        "all_reduce_": ("funcol.all_reduce", "input", {"reduce_op": "reduce_op"}),
        "all_reduce_coalesced": ("funcol.all_reduce_coalesced", "inputs", {"reduce_op": "reduce_op"}),
        "all_reduce_coalesced_": ("funcol.all_reduce_coalesced", "inputs", {"reduce_op": "reduce_op"}),
        "all_gather_into_tensor": ("funcol.all_gather", "input", {}),
        "all_gather_into_tensor_out": ("funcol.all_gather", "input", {}),
        "all_gather_into_tensor_coalesced": ("funcol.all_gather_coalesced", "inputs", {}),
        "reduce_scatter_tensor": ("funcol.reduce_scatter", "input", {"reduce_op": "reduce_op"}),
        "reduce_scatter_tensor_out": ("funcol.reduce_scatter", "input", {"reduce_op": "reduce_op"}),
        "reduce_scatter_tensor_coalesced": ("funcol.reduce_scatter_coalesced", "inputs", {"reduce_op": "reduce_op"}),
        "all_to_all_single": ("funcol.all_to_all_single", "input", {"uneven_when": _DISPATCHED_SPLITS}),
        "broadcast": ("funcol.broadcast", "input", {"root": "src"}),
        "broadcast_": ("funcol.broadcast", "input", {"root": "src"}),
    }.items()
}

KNOWN_OPS: frozenset[str] = frozenset(
    spec.op
    for spec in (
        *C10D_SPECS.values(),
        *FUNCOL_SPECS.values(),
        BROADCAST_COALESCED,
        *C10D_DISPATCHED.values(),
        *FUNCTIONAL_DISPATCHED.values(),
    )
)
"""Every op name a record can carry (canonical names; aliases are folded). A few only dispatched
records carry: process-group methods without a Python entry point of their own, such as the
coalesced all-gather into one tensor."""

SAME_TENSOR_OPS: frozenset[str] = frozenset(
    {
        "all_reduce",
        "all_reduce_coalesced",
        "broadcast",
        "broadcast_coalesced",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced",
        "funcol.all_reduce",
        "funcol.all_reduce_coalesced",
        "funcol.broadcast",
        "funcol.reduce_scatter",
        "funcol.reduce_scatter_coalesced",
    }
)
"""Ops whose members all pass the same logical tensor (see `OpSpec.same_tensor`)."""
