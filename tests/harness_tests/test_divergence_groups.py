"""What exchanging collectives send and expect, and process groups by identity: how the tracer
records them (real gloo ranks), and how the diff, the one-sided watch and the trace table read them
(fabricated traces). End to end: test_divergence_groups_e2e.py."""

from __future__ import annotations

import inspect
import json
import re
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
from test_trace import spawn_ranks

from harness.rank import tracing
from harness.rank.collective_ops import C10D_SPECS, FUNCOL_SPECS
from harness.trace.divergence import first_divergence, format_trace_table, unfinished_collectives
from harness.trace.one_sided import OneSidedWatch
from harness.trace.records import CollectiveRecord, decode_line, done_line, record_line


def rec(rank: int, index: int, seq: int = 0, op: str = "all_reduce", **fields) -> CollectiveRecord:
    defaults = {"group": (0, 1), "shapes": ((4,),), "dtypes": ("float32",), "numel": 4, "label": "", "completed": True}
    return CollectiveRecord(rank=rank, index=index, seq=seq, op=op, **{**defaults, **fields})


def exchange(rank: int, sends: tuple[int, ...], receives: tuple[int, ...], **fields) -> CollectiveRecord:
    """An all_to_all_single whose shapes differ by rank on purpose (`uneven`), as the tracer records it."""
    defaults = {"op": "all_to_all_single", "uneven": True, "site": "moe.py:9"}
    return rec(rank, 0, sends=sends, receives=receives, **{**defaults, **fields})


# ------------------------------------------------------------------------- exchanges, diffed


def test_an_uneven_exchange_that_pairs_up_is_no_divergence():
    traces = {0: [exchange(0, (1, 3), (1, 2))], 1: [exchange(1, (2, 2), (3, 2))]}
    assert first_divergence(traces, [0, 1]) is None


def test_a_stale_split_is_named_as_the_pair_that_does_not_add_up_with_every_ranks_sizes():
    traces = {0: [exchange(0, (4, 4), (4, 4))], 1: [exchange(1, (5, 3), (3, 5))]}
    divergence = first_divergence(traces, [0, 1])
    assert divergence is not None and divergence.positions() == {0: 0, 1: 0}
    assert divergence.describe() == (
        "collective #1 on group [0, 1] at moe.py:9: all_to_all_single: rank 0 sends 4 to rank 1 but rank 1 "
        "expects 3 from rank 0 (and 2 more that do not add up); elements per member: "
        "rank 0 sends [4, 4], expects [4, 4]; rank 1 sends [5, 3], expects [3, 5]"
    )


def test_equal_lists_that_do_not_pair_up_are_a_divergence():
    # Both ranks pass the same splits: equal lists, yet rank 0 sends 3 to rank 1, which expects 1.
    traces = {rank: [exchange(rank, (1, 3), (1, 3))] for rank in (0, 1)}
    divergence = first_divergence(traces, [0, 1])
    assert divergence is not None
    assert "rank 0 sends 3 to rank 1 but rank 1 expects 1 from rank 0 (and 1 more" in divergence.describe()


def test_a_list_of_the_wrong_length_is_named():
    traces = {0: [exchange(0, (2, 2), (2, 2), op="all_to_all")], 1: [exchange(1, (2, 2), (2, 2, 2), op="all_to_all")]}
    divergence = first_divergence(traces, [0, 1])
    assert divergence is not None
    assert "all_to_all: rank 1 gives the sizes it expects from 3 members in a group of 2" in divergence.describe()


def test_a_scatter_whose_pieces_differ_from_what_a_rank_expects_is_said_as_the_pair():
    root = rec(0, 0, op="scatter", args=(("root", "0"),), sends=(4, 4), receives=(4, 0))
    other = rec(1, 0, op="scatter", args=(("root", "0"),), sends=(0, 0), receives=(3, 0), shapes=((3,),), numel=3)
    divergence = first_divergence({0: [root], 1: [other]}, [0, 1])
    assert divergence is not None
    assert "scatter: rank 0 sends 4 to rank 1 but rank 1 expects 3 from rank 0" in divergence.describe()


def test_exchanges_are_compared_only_between_the_same_collective():
    # A different op at that position is the divergence, not a pairing of unrelated sizes.
    traces = {0: [exchange(0, (4, 4), (4, 4))], 1: [rec(1, 0, op="all_reduce", site="moe.py:9")]}
    divergence = first_divergence(traces, [0, 1])
    assert divergence is not None and divergence.exchange is None and " vs " in divergence.describe()


# ------------------------------------------------------------------ groups by identity, diffed


def on_group(rank: int, index: int, number: int, **fields) -> CollectiveRecord:
    """A collective on the `number`-th group the test created, whose members are [0, 1]."""
    return rec(rank, index, group_name=str(10 + number), group_number=number, **fields)


def test_two_groups_with_the_same_members_are_two_streams():
    traces = {
        0: [on_group(0, 0, 1, seq=0), on_group(0, 1, 2, seq=0, numel=8)],
        1: [on_group(1, 0, 1, seq=0), on_group(1, 1, 2, seq=0, numel=8)],
    }
    assert first_divergence(traces, [0, 1]) is None
    # Interleaved differently across the two groups: still no divergence (each group agrees).
    traces[1] = [replace(traces[1][1], index=0), replace(traces[1][0], index=1)]
    assert first_divergence(traces, [0, 1]) is None


def test_a_wait_cycle_across_groups_is_named_as_a_deadlock():
    traces = {
        0: [on_group(0, 0, 2, site="t.py:12", completed=False)],
        1: [on_group(1, 0, 1, site="t.py:15", completed=False)],
    }
    divergence = first_divergence(traces, [0, 1])
    assert divergence is not None and divergence.deadlock is not None
    assert divergence.describe() == (
        "deadlock: rank 0 waits in all_reduce on group #2 [0, 1] (t.py:12) for rank 1, "
        "which waits in all_reduce on group #1 [0, 1] (t.py:15) for rank 0"
    )
    assert unfinished_collectives(traces) == (
        "rank 0 in collective #1 on group #2 [0, 1]: all_reduce 4 float32 at t.py:12; "
        "rank 1 in collective #1 on group #1 [0, 1]: all_reduce 4 float32 at t.py:15"
    )


def test_a_three_rank_cycle_is_named_from_its_lowest_rank():
    def stuck(rank: int, members: tuple[int, ...], site: str) -> CollectiveRecord:
        return rec(rank, 0, group=members, group_name=site, group_number=1, site=site, completed=False)

    traces = {0: [stuck(0, (0, 1), "a.py:1")], 1: [stuck(1, (1, 2), "b.py:2")], 2: [stuck(2, (0, 2), "c.py:3")]}
    divergence = first_divergence(traces, [0, 1, 2])
    assert divergence is not None
    assert divergence.describe() == (
        "deadlock: rank 0 waits in all_reduce on group [0, 1] (a.py:1) for rank 1, which waits in all_reduce "
        "on group [1, 2] (b.py:2) for rank 2, which waits in all_reduce on group [0, 2] (c.py:3) for rank 0"
    )


def test_a_call_on_a_group_the_rank_is_not_in_is_named_where_it_should_have_issued():
    waiting = rec(2, 0, group=(2, 3), group_name="2", group_number=2, site="t.py:20", completed=False)
    wrong = rec(3, 0, group=(0, 1), group_name="1", group_number=1, site="t.py:20", member=False)
    traces = {0: [], 1: [], 2: [waiting], 3: [wrong]}
    divergence = first_divergence(traces, [0, 1, 2, 3])
    assert divergence is not None
    assert divergence.describe() == (
        "collective #1 on group [2, 3]: rank 3 called all_reduce on group [0, 1] (t.py:20), which it is not "
        "a member of (rank 2 issued all_reduce 4 float32 at t.py:20)"
    )


def test_a_call_torch_skips_on_a_non_member_is_no_divergence_by_itself():
    traces = {
        0: [rec(0, 0, group_name="1", group_number=1)],
        1: [rec(1, 0, group_name="1", group_number=1)],
        2: [rec(2, 0, group_name="1", group_number=1, member=False)],
    }
    assert first_divergence(traces, [0, 1, 2]) is None


def test_traces_without_group_names_compare_by_members_as_before():
    """Files written before groups were named, and Flight Recorder dumps without the group's configuration."""
    traces = {0: [rec(0, 0), rec(0, 1, seq=1)], 1: [rec(1, 0), rec(1, 1, seq=1, numel=8, shapes=((8,),))]}
    divergence = first_divergence(traces, [0, 1])
    assert divergence is not None and divergence.where == "collective #2 on group [0, 1]"


def test_the_trace_table_names_the_tests_groups_non_member_calls_and_exchanges():
    traces = {
        0: [
            rec(0, 0, group_name="0", group_number=0),
            on_group(0, 1, 2),
            rec(0, 2, group=(2, 3), group_name="3", group_number=3, member=False),
            replace(exchange(0, (4, 4), (4, 4), group_name="0", group_number=0), index=3, seq=1),
        ]
    }
    table = format_trace_table(traces)
    rows = [re.split(r"\s{2,}", line.strip()) for line in table.splitlines()[2:]]
    assert [row[1] for row in rows] == ["[0, 1]", "#2 [0, 1]", "not in #3 [2, 3]", "[0, 1]"], table
    assert rows[3][8] == "sends=[4,4] expects=[4,4]", table


# ----------------------------------------------------------------------------- file format


def test_record_json_round_trips_group_identity_and_exchange_sizes():
    original = rec(1, 2, group_name="5", group_number=2, member=False, sends=(0, 4), receives=(3, 0))
    original.completed = False
    assert CollectiveRecord.from_json(json.loads(original.to_json())) == original


def test_a_line_written_before_groups_were_named_still_reads():
    old = '{"rank":0,"index":0,"seq":0,"op":"all_reduce","group":[0,1],"shapes":[[4]],"dtypes":["float32"],'
    record = decode_line(old + '"numel":4,"label":""}')
    assert isinstance(record, CollectiveRecord)
    assert (record.group_name, record.group_number, record.member, record.sends, record.receives) == (
        "",
        None,
        True,
        None,
        None,
    )
    assert record.to_json() == old + '"numel":4,"label":""}'  # nothing new written for what is not known


# -------------------------------------------------------------------------- one-sided watch


def _write(path, *records: CollectiveRecord) -> None:
    with open(path, "ab") as handle:
        for record in records:
            handle.write(record_line(record))
            if record.completed:
                handle.write(done_line(record.index))


def _judge(watch: OneSidedWatch, finished: set[int], waiting: set[int]) -> str | None:
    """The watch's verdict once its judgement had time to settle (None if it never gave one)."""
    for _ in range(2):
        found = watch.check(finished, waiting)
        if found:
            return found
        time.sleep(watch.settle_s)
    return watch.check(finished, waiting)


def _watch(tmp_path: Path, ranks: tuple[int, ...] = (0, 1), **options: float) -> tuple[dict[int, str], OneSidedWatch]:
    """Each rank's trace file under `tmp_path`, and a watch over them."""
    paths = {rank: str(tmp_path / f"trace-{rank}.jsonl") for rank in ranks}
    return paths, OneSidedWatch(paths, **options)


def test_the_watch_stops_a_cross_group_deadlock_once_it_settled(tmp_path):
    paths, watch = _watch(tmp_path, settle_s=0.05)
    _write(paths[0], on_group(0, 0, 2, site="t.py:12", completed=False))
    _write(paths[1], on_group(1, 0, 1, site="t.py:15", completed=False))
    assert watch.check(set(), {0, 1}) is None  # first sighting: not yet settled
    assert _judge(watch, set(), {0, 1}) == (
        "deadlock: rank 0 waits in all_reduce on group #2 [0, 1] (t.py:12) for rank 1, "
        "which waits in all_reduce on group #1 [0, 1] (t.py:15) for rank 0"
    )


def test_the_watch_stops_a_rank_whose_peer_left_an_exchange_that_cannot_pair_up(tmp_path):
    paths, watch = _watch(tmp_path, settle_s=0.05)
    _write(paths[0], replace(exchange(0, (4, 4), (4, 4)), completed=False))
    _write(paths[1], replace(exchange(1, (5, 3), (3, 5)), completed=False))  # gloo raised inside it
    assert _judge(watch, {1}, {0}) == (
        "waited in collective #1 on group [0, 1] at moe.py:9, which can never match: all_to_all_single: "
        "rank 0 sends 4 to rank 1 but rank 1 expects 3 from rank 0 (and 2 more that do not add up); "
        "elements per member: rank 0 sends [4, 4], expects [4, 4]; rank 1 sends [5, 3], expects [3, 5]"
    )


def test_the_watch_leaves_a_peer_that_left_a_matching_call_to_the_straggler_grace(tmp_path):
    paths, watch = _watch(tmp_path, settle_s=0.05)
    _write(paths[0], replace(exchange(0, (1, 3), (1, 2)), completed=False))
    _write(paths[1], replace(exchange(1, (2, 2), (3, 2)), completed=False))
    assert _judge(watch, {1}, {0}) is None


def test_the_watch_names_a_non_member_call_of_a_member_that_finished(tmp_path):
    paths, watch = _watch(tmp_path, ranks=(0, 1, 2))
    _write(paths[0], rec(0, 0, group=(0, 1), group_name="1", group_number=1, site="t.py:20", completed=False))
    _write(paths[1], rec(1, 0, group=(1, 2), group_name="2", group_number=2, site="t.py:20", member=False))
    assert watch.check({1, 2}, {0}) == (
        "waited alone in collective #1 on group [0, 1] (all_reduce 4 float32 at t.py:20): the other members "
        "finished without issuing it (collectives they issued on that group: rank 1 0); "
        "rank 1 called all_reduce on group [1, 2] (t.py:20), which it is not a member of"
    )


# ------------------------------------------------------------------------- the tracer, real ranks


def _groups_by_identity(rank: int, world_size: int, out_dir: str) -> None:
    first = dist.new_group([0, 1])  # rank 2 is a member of none of these three
    second = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(2))
    if rank != 2:
        dist.all_reduce(torch.ones(2), group=second)
        dist.all_reduce(torch.ones(2), group=first)
        dist.all_reduce(torch.ones(2), group=second)
    pair = dist.new_group([0, 1])
    if rank == 2:
        assert pair == c10d.GroupMember.NON_GROUP_MEMBER and isinstance(pair, tracing.NonMemberGroup)
        assert c10d._rank_not_in_group(pair)
    dist.all_reduce(torch.ones(2), group=pair)  # torch returns at once on rank 2


def test_groups_are_recorded_by_identity_and_non_member_calls_with_the_group_they_named(tmp_path):
    traces = spawn_ranks(_groups_by_identity, tmp_path, world_size=3)
    for rank in (0, 1):
        world, second, first, second_again, pair = traces[rank]
        assert (world.group, world.group_number) == ((0, 1, 2), 0)
        assert (first.group_number, second.group_number, second_again.group_number) == (1, 2, 2)
        assert first.group == second.group == (0, 1) and first.group_name != second.group_name
        assert (second.seq, first.seq, second_again.seq) == (0, 0, 1)
        assert pair.group_number == 3 and pair.member
    world, pair = traces[2]
    assert (pair.op, pair.group, pair.member, pair.completed) == ("all_reduce", (0, 1), False, True)
    assert (pair.group_name, pair.group_number) == (traces[0][-1].group_name, 3)
    assert first_divergence(traces, [0, 1, 2]) is None


def _no_op_of(original, spec):
    """A traced stand-in for `original` that records its call and issues nothing (gloo lacks some ops)."""

    def no_op(*args, **kwargs):
        return torch.empty(0) if spec.functional else None

    positions = {name: index for index, name in enumerate(inspect.signature(original).parameters)}
    return tracing.wrap(no_op, spec, positions)


def _exchanging_calls(rank: int, world_size: int, out_dir: str) -> None:
    other = 1 - rank
    ones = torch.ones
    all_to_all_single = _no_op_of(c10d.all_to_all_single, C10D_SPECS["all_to_all_single"])
    all_to_all_single(torch.empty(6, 2), ones(4, 2), [1 + 4 * rank, 5 - 4 * rank], [1 + rank, 3 - rank])
    all_to_all_single(torch.empty(4), ones(4))  # no splits: an even split
    _no_op_of(c10d.all_to_all, C10D_SPECS["all_to_all"])([ones(2), ones(3)], [ones(1), ones(2 + rank)])
    _no_op_of(c10d.all_gather, C10D_SPECS["all_gather"])([ones(3), ones(3)], ones(3))
    _no_op_of(c10d.reduce_scatter, C10D_SPECS["reduce_scatter"])(ones(2), [ones(2), ones(2)])
    _no_op_of(c10d.gather, C10D_SPECS["gather"])(ones(3), [ones(3), ones(3)] if rank == 1 else None, dst=1)
    _no_op_of(c10d.scatter, C10D_SPECS["scatter"])(ones(5), [ones(5), ones(5)] if rank == 0 else None, src=0)
    funcol_all_to_all = _no_op_of(funcol.all_to_all_single, FUNCOL_SPECS["all_to_all_single"])
    funcol_all_to_all(ones(3, 2), [other + 1, 2 - other], [rank + 1, 2 - rank], dist.group.WORLD)


def test_exchanging_collectives_record_what_each_member_sends_and_expects(tmp_path):
    traces = spawn_ranks(_exchanging_calls, tmp_path)
    sizes = {rank: [(record.op, record.sends, record.receives) for record in traces[rank]] for rank in (0, 1)}
    assert sizes[0] == [
        ("all_to_all_single", (2, 6), (2, 10)),  # splits are rows of 2 elements
        ("all_to_all_single", (2, 2), (2, 2)),
        ("all_to_all", (1, 2), (2, 3)),
        ("all_gather", (3, 3), (3, 3)),
        ("reduce_scatter", (2, 2), (2, 2)),
        ("gather", (0, 3), (0, 0)),
        ("scatter", (5, 5), (5, 0)),
        ("funcol.all_to_all_single", (2, 4), (4, 2)),
    ]
    assert sizes[1] == [
        ("all_to_all_single", (4, 4), (10, 2)),
        ("all_to_all_single", (2, 2), (2, 2)),
        ("all_to_all", (1, 3), (2, 3)),
        ("all_gather", (3, 3), (3, 3)),
        ("reduce_scatter", (2, 2), (2, 2)),
        ("gather", (0, 3), (3, 3)),
        ("scatter", (0, 0), (5, 0)),
        ("funcol.all_to_all_single", (4, 2), (2, 4)),
    ]
