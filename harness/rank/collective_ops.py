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

KNOWN_OPS: frozenset[str] = frozenset(
    spec.op for spec in (*C10D_SPECS.values(), *FUNCOL_SPECS.values(), BROADCAST_COALESCED)
)
"""Every op name a record can carry (canonical names; aliases are folded)."""

SAME_TENSOR_OPS: frozenset[str] = frozenset(
    {
        "all_reduce",
        "all_reduce_coalesced",
        "broadcast",
        "broadcast_coalesced",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "funcol.all_reduce",
        "funcol.all_reduce_coalesced",
        "funcol.broadcast",
        "funcol.reduce_scatter",
        "funcol.reduce_scatter_coalesced",
    }
)
"""Ops whose members all pass the same logical tensor (see `OpSpec.same_tensor`)."""
