"""first_divergence / format_trace_table on fabricated traces, plus one real 2-rank same-shape mismatch."""

from __future__ import annotations

import re
from dataclasses import replace

import torch
import torch.distributed as dist
from test_trace import spawn_ranks

from harness.rank import tracing
from harness.trace.divergence import first_divergence, format_trace_table, unfinished_collectives
from harness.trace.records import CollectiveRecord


def rec(
    rank: int,
    index: int,
    seq: int,
    op: str = "all_gather_into_tensor",
    label: str = "",
    numel: int = 36,
    group: tuple[int, ...] = (0, 1),
    **extra,
) -> CollectiveRecord:
    return CollectiveRecord(
        rank=rank,
        index=index,
        seq=seq,
        op=op,
        group=group,
        shapes=((numel,),),
        dtypes=("float32",),
        numel=numel,
        label=label,
        completed=True,
        **extra,
    )


def test_identical_traces_have_no_divergence():
    traces = {r: [rec(r, 0, 0, label="layer1"), rec(r, 1, 1, op="all_reduce", numel=4)] for r in (0, 1)}
    assert first_divergence(traces, [0, 1]) is None


def test_same_shape_different_label_is_reported_with_both_sides():
    traces = {
        0: [rec(0, 0, 0, op="all_reduce", numel=1), rec(0, 1, 1, label="layer1.weight")],
        1: [rec(1, 0, 0, op="all_reduce", numel=1), rec(1, 1, 1, label="layer2.0.weight, layer2.2.weight")],
    }
    divergence = first_divergence(traces, [0, 1])
    assert divergence is not None
    assert divergence.describe() == (
        "collective #2 on group [0, 1]: rank 0 all_gather_into_tensor [layer1.weight] 36 float32 vs "
        "rank 1 all_gather_into_tensor [layer2.0.weight, layer2.2.weight] 36 float32"
    )


def test_unfinished_collectives_name_where_each_rank_was_stuck():
    done = {r: [rec(r, 0, 0, op="all_reduce", numel=4)] for r in (0, 1)}
    assert unfinished_collectives(done) is None
    stuck = {
        0: [*done[0], replace(rec(0, 1, 1, label="layer2"), completed=False)],
        1: [*done[1], replace(rec(1, 1, 1, label="layer2", fault="hang at collective #2"), completed=False)],
    }
    assert unfinished_collectives(stuck) == (
        "rank 0 in collective #2 on group [0, 1]: all_gather_into_tensor [layer2] 36 float32; "
        "rank 1 in collective #2 on group [0, 1]: all_gather_into_tensor [layer2] 36 float32 "
        "(injected fault: hang at collective #2)"
    )


def test_shapes_are_shown_when_only_they_differ():
    a = rec(0, 0, 0)
    b = CollectiveRecord(
        rank=1,
        index=0,
        seq=0,
        op=a.op,
        group=a.group,
        shapes=((6, 6),),
        dtypes=a.dtypes,
        numel=36,
        label="",
        completed=True,
    )
    text = first_divergence({0: [a], 1: [b]}, [0, 1]).describe()
    assert "shapes [36]" in text and "shapes [6,6]" in text


def test_rank_that_stopped_early_is_named_with_its_last_collective():
    traces = {
        0: [rec(0, i, i, op="all_reduce", numel=4) for i in range(8)],
        1: [rec(1, i, i, op="all_reduce", numel=4) for i in range(7)],
    }
    traces[1][-1].completed = False
    text = first_divergence(traces, [0, 1]).describe()
    assert text == (
        "collective #8 on group [0, 1]: rank 1 stopped early after #7 all_reduce 4 float32, "
        "which never completed (rank 0 issued all_reduce 4 float32)"
    )


def test_missing_rank_trace_counts_as_issuing_nothing():
    text = first_divergence({0: [rec(0, 0, 0, op="barrier")]}, [0, 1]).describe()
    assert text.startswith("collective #1 on group [0, 1]: rank 1 issued none")


def test_earliest_divergence_across_groups_wins():
    # Subgroup [0, 1] of a 4-rank world diverges at ranks 0/1's index 2; the world group diverges
    # afterwards (their index 4), although ranks 2 and 3 reach that world collective at index 1.
    world = (0, 1, 2, 3)
    traces = {}
    for r in range(4):
        records = [rec(r, 0, 0, op="all_reduce", numel=1, group=world)]
        if r in (0, 1):
            records.append(rec(r, 1, 0, group=(0, 1), label="agreed"))
            records.append(rec(r, 2, 1, group=(0, 1), label=f"layer{r}"))
            records.append(rec(r, 3, 2, group=(0, 1), label="x"))
            records.append(rec(r, 4, 1, op="all_reduce", numel=1 + r, group=world))
        else:
            records.append(rec(r, 1, 1, op="all_reduce", numel=1, group=world))
        traces[r] = records
    divergence = first_divergence(traces, list(range(4)))
    assert divergence.where == "collective #2 on group [0, 1]"


def test_more_than_two_ranks_are_grouped_by_what_they_issued():
    traces = {r: [rec(r, 0, 0, label="b" if r == 1 else "a", group=(0, 1, 2))] for r in range(3)}
    assert first_divergence(traces, [0, 1, 2]).describe() == (
        "collective #1 on group [0, 1, 2]: ranks 0, 2 all_gather_into_tensor [a] 36 float32 vs "
        "rank 1 all_gather_into_tensor [b] 36 float32"
    )


def test_uneven_all_to_all_shapes_are_not_a_divergence():
    a = CollectiveRecord(
        rank=0,
        index=0,
        seq=0,
        op="all_to_all_single",
        group=(0, 1),
        shapes=((3,),),
        dtypes=("float32",),
        numel=3,
        label="",
        uneven=True,
    )
    b = replace(a, rank=1, shapes=((5,),), numel=5)  # rank 1 in the same call, with its own element count
    assert first_divergence({0: [a], 1: [b]}, [0, 1]) is None


def test_skipped_collective_is_treated_as_not_issued_and_named():
    traces = {
        0: [rec(0, 0, 0, op="all_reduce", numel=4), rec(0, 1, 1)],
        1: [rec(1, 0, 0, op="all_reduce", numel=4, skipped=True, fault="rank 1: skip collective #1"), rec(1, 1, 1)],
    }
    text = first_divergence(traces, [0, 1]).describe()
    assert text == (
        "collective #1 on group [0, 1]: rank 0 all_reduce 4 float32 vs "
        "rank 1 all_gather_into_tensor 36 float32, having skipped all_reduce "
        "(injected fault: rank 1: skip collective #1)"
    )


def test_rank_whose_last_collective_was_skipped_did_not_issue_it():
    fault = "rank 1: skip all_reduce collective #2"
    traces = {
        0: [rec(0, 0, 0, op="all_reduce", numel=4), rec(0, 1, 1, op="all_reduce", numel=4)],
        1: [rec(1, 0, 0, op="all_reduce", numel=4), rec(1, 1, 1, op="all_reduce", numel=4, skipped=True, fault=fault)],
    }
    assert first_divergence(traces, [0, 1]).describe() == (
        f"collective #2 on group [0, 1]: rank 1 did not issue it, all_reduce skipped (injected fault: {fault}) "
        "(rank 0 issued all_reduce 4 float32)"
    )


def test_point_to_point_matches_sends_with_receives_per_direction():
    def p2p(rank, index, op, peer, numel):
        return CollectiveRecord(
            rank=rank,
            index=index,
            seq=0,
            op=op,
            group=(0, 1),
            shapes=((numel,),),
            dtypes=("float32",),
            numel=numel,
            label="",
            peer=peer,
        )

    # Posting order differs between ranks (fine for isend/irecv); sizes match per direction.
    good = {
        0: [p2p(0, 0, "isend", 1, 4), p2p(0, 1, "irecv", 1, 2)],
        1: [p2p(1, 0, "irecv", 0, 4), p2p(1, 1, "isend", 0, 2)],
    }
    assert first_divergence(good, [0, 1]) is None
    bad = {0: [p2p(0, 0, "send", 1, 4)], 1: [p2p(1, 0, "recv", 0, 8)]}
    assert first_divergence(bad, [0, 1]).describe() == (
        "p2p #1 from rank 0 to rank 1: rank 0 send 4 float32 vs rank 1 recv 8 float32"
    )


def test_trace_table_lists_every_record_with_status():
    traces = {0: [rec(0, 0, 0, label="layer1")], 1: [rec(1, 0, 0, op="send", peer=0, numel=2)]}
    traces[1][0].completed = False
    table = format_trace_table(traces)
    assert "rank 0: 1 collectives" in table and "rank 1: 1 collectives" in table
    assert "layer1" in table and "->0" in table and "NOT COMPLETED" in table


# ------------------------------------------------------------------------------ real 2-rank run


def _gather_different_layers(rank: int, world_size: int, out_dir: str) -> None:
    """Both ranks all-gather 36 float32 elements, but from different layers (a silent bug)."""
    model = torch.nn.ModuleDict(
        {"layer1": torch.nn.Linear(6, 6, bias=False), "layer2": torch.nn.Linear(6, 6, bias=False)}
    )
    chosen = model["layer1"] if rank == 0 else model["layer2"]
    name = "layer1" if rank == 0 else "layer2"
    remove = tracing.register_label_provider(lambda: f"{name}.weight")
    output = torch.empty(2 * 36)
    dist.all_gather_into_tensor(output, chosen.weight.detach().reshape(-1))
    remove()
    dist.barrier()


def test_same_shape_divergence_between_real_ranks_is_detected(tmp_path):
    traces = spawn_ranks(_gather_different_layers, tmp_path)
    divergence = first_divergence(traces, [0, 1])
    assert divergence is not None
    assert re.fullmatch(
        r"collective #1 on group \[0, 1\] at tests/harness_tests/test_divergence.py:\d+: "
        r"rank 0 all_gather_into_tensor \[layer1.weight\] 36 float32 vs "
        r"rank 1 all_gather_into_tensor \[layer2.weight\] 36 float32",
        divergence.describe(),
    ), divergence.describe()
