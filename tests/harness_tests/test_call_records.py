"""The record builder on its own (harness.rank.call_records): records built from a call's
arguments, with the caller's group table and numbering, and no collective issued.

The tracer's own tests issue collectives through the patched entry points and read the trace;
these call ``build_record`` / ``dispatched_record`` directly, on 2 gloo ranks (a group is only
resolved where a world exists), so a wrong reading of an argument shows as the field it broke.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from test_trace import spawn_ranks

from harness.rank.call_records import (
    CallArguments,
    CallGroup,
    GroupTable,
    NonMemberGroup,
    build_record,
    dispatched_record,
    param_positions,
)
from harness.rank.collective_ops import C10D_DISPATCHED, C10D_SPECS


def _arguments(name: str, *args, **kwargs) -> CallArguments:
    function = getattr(c10d, name)
    return CallArguments(args, kwargs, param_positions(getattr(function, "__trace_original__", function)))


class _Numbering:
    """Hands out (rank, index, seq) as the tracer would, and remembers what it was asked."""

    def __init__(self, rank: int, recording: bool = True) -> None:
        self.rank, self.recording, self.asked = rank, recording, []

    def __call__(self, op: str, p2p: bool, peer: int | None, group: CallGroup) -> tuple[int, int, int] | None:
        self.asked.append((op, p2p, peer, group.ranks))
        return (self.rank, 7, 3) if self.recording else None


def _records(rank: int, world_size: int, out_dir: str) -> None:
    table = GroupTable()
    table.begin(getattr(c10d._world, "group_count", None))
    numbering = _Numbering(rank)

    # A reduction over a group this test created: its reduction, its group (named, numbered 1).
    group = dist.new_group([0, 1])
    built = build_record(
        C10D_SPECS["all_reduce"],
        _arguments("all_reduce", torch.ones(2, 3), op=dist.ReduceOp.AVG, group=group),
        table,
        numbering,
    )
    assert built is not None and built.on_cpu
    record = built.record
    assert (record.op, record.group, record.shapes, record.dtypes, record.numel) == (
        "all_reduce",
        (0, 1),
        ((2, 3),),
        ("float32",),
        6,
    )
    assert dict(record.args) == {"op": "AVG"}, record.args
    assert (record.rank, record.index, record.seq) == (rank, 7, 3)
    assert record.group_number == 1 and record.group_name, (record.group_number, record.group_name)
    assert numbering.asked[-1] == ("all_reduce", False, None, (0, 1))

    # all_to_all_single with uneven splits: what this rank sends to and expects from each member.
    splits_in, splits_out = ([1, 3], [1, 2]) if rank == 0 else ([2, 1], [3, 1])
    arguments = _arguments(
        "all_to_all_single",
        torch.empty(sum(splits_out), 5),
        torch.empty(sum(splits_in), 5),
        output_split_sizes=splits_out,
        input_split_sizes=splits_in,
    )
    record = build_record(C10D_SPECS["all_to_all_single"], arguments, table, numbering).record
    assert record.uneven
    assert record.sends == tuple(5 * s for s in splits_in) and record.receives == tuple(5 * s for s in splits_out)

    # gather to rank 1: everyone sends to the root only; only the root expects anything.
    gather_list = [torch.empty(4), torch.empty(4)] if rank == 1 else None
    record = build_record(
        C10D_SPECS["gather"], _arguments("gather", torch.empty(4), gather_list, dst=1), table, numbering
    ).record
    assert dict(record.args)["root"] == "1"
    assert record.sends == (0, 4)
    assert record.receives == ((4, 4) if rank == 1 else (0, 0))

    # A group this rank is not a member of: recorded with the group it named, as a non-member.
    marker = NonMemberGroup(c10d.GroupMember.NON_GROUP_MEMBER, (1,), "99")
    record = build_record(
        C10D_SPECS["broadcast"], _arguments("broadcast", torch.ones(1), 1, group=marker), table, numbering
    ).record
    assert (record.group, record.member, record.group_name) == ((1,), False, "99")

    # No test recording: a Python call is still described (for the fault interceptor), unnumbered;
    # a dispatched one is not recorded at all.
    silent = _Numbering(rank, recording=False)
    record = build_record(C10D_SPECS["all_reduce"], _arguments("all_reduce", torch.ones(1)), table, silent).record
    assert (record.rank, record.index, record.seq, record.group_number) == (rank, -1, -1, 0)
    spec = C10D_DISPATCHED["allreduce_"]
    default = dist.group.WORLD
    assert (
        dispatched_record(
            spec, CallArguments((), {"tensors": [torch.ones(1)], "process_group": default}, {}), table, silent
        )
        is None
    )

    # Dispatched: the same reading of the same call; meta tensors are no collective being run.
    built = dispatched_record(
        spec, CallArguments((), {"tensors": [torch.ones(3)], "process_group": default}, {}), table, numbering
    )
    assert built is not None and built.on_cpu
    assert (built.record.op, built.record.group, built.record.shapes) == ("all_reduce", (0, 1), ((3,),))
    assert built.record.async_op and dict(built.record.args) == {"op": "SUM"}
    meta = CallArguments((), {"tensors": [torch.empty(3, device="meta")], "process_group": default}, {})
    assert dispatched_record(spec, meta, table, numbering) is None

    # Outside a test the table numbers no group it had not seen.
    table.end()
    assert table.of_c10d(group).number is None


def test_records_are_read_from_the_arguments_alone(tmp_path):
    spawn_ranks(_records, tmp_path)
