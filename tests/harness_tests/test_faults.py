"""harness.rank.faults: argument checks in-process; each action exercised on 2 spawned gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
from test_trace import read_traces, spawn_ranks

from harness.rank import faults
from harness.trace.divergence import first_divergence


@pytest.fixture(autouse=True)
def _no_faults_left():
    yield
    faults.clear()


def test_inject_rejects_unknown_actions_and_ops_with_the_fix():
    with pytest.raises(ValueError, match="use one of skip, delay"):
        faults.inject(rank=0, at=0, action="explode")
    with pytest.raises(ValueError, match="canonical name"):
        faults.inject(rank=0, at=0, action="skip", op="all_gather_single")
    with pytest.raises(ValueError, match="needs seconds > 0"):
        faults.inject(rank=0, at=0, action="delay")


def test_active_faults_lists_injected_faults_until_clear():
    with faults.inject(rank=1, at=3, action="corrupt", op="all_reduce"):
        pass
    faults.inject(rank=0, at=0, action="delay", seconds=0.5)
    assert faults.active_faults() == [
        "rank 1: corrupt all_reduce collective #4 (output += 1)",
        "rank 0: delay collective #1 by 0.5s",
    ]
    faults.clear()
    assert faults.active_faults() == []


def _skip_then_corrupt(rank: int, world_size: int, out_dir: str) -> None:
    with faults.inject(rank=0, at=0, action="skip"), faults.inject(rank=1, at=0, action="skip"):
        skipped = torch.ones(3)
        work = dist.all_reduce(skipped, async_op=True)  # neither rank issues it: nobody waits
    assert work.is_completed() and work.wait()
    torch.testing.assert_close(skipped, torch.ones(3))
    faults.inject(rank=1, at=1, action="corrupt", op="all_reduce", delta=10.0)
    first, second = torch.ones(2), torch.ones(2)
    dist.all_reduce(first)
    dist.all_reduce(second)
    assert faults.active_faults() == [
        "rank 0: skip collective #1",
        "rank 1: skip collective #1",
        "rank 1: corrupt all_reduce collective #2 (output += 10)",
    ]
    torch.testing.assert_close(first, torch.full((2,), 2.0))
    torch.testing.assert_close(second, torch.full((2,), 12.0 if rank == 1 else 2.0))
    faults.inject(rank=0, at=0, action="corrupt", op="funcol.all_reduce")
    reduced = funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD)
    torch.testing.assert_close(funcol.wait_tensor(reduced), torch.full((2,), 3.0 if rank == 0 else 2.0))


def test_skip_is_recorded_and_corrupt_changes_only_the_faulty_rank(tmp_path):
    traces = spawn_ranks(_skip_then_corrupt, tmp_path)
    for rank in (0, 1):
        skipped = traces[rank][0]
        assert skipped.skipped and skipped.fault == f"rank {rank}: skip collective #1"
    assert [r.fault for r in traces[1][1:]] == ["", "rank 1: corrupt all_reduce collective #2 (output += 10)", ""]
    assert traces[0][-1].op == "funcol.all_reduce" and traces[0][-1].fault.startswith("rank 0: corrupt")
    assert first_divergence(traces, [0, 1]) is None  # same calls on the wire; only data differs


def _delay(rank: int, world_size: int, out_dir: str) -> None:
    import time

    faults.inject(rank=0, at=0, action="delay", seconds=0.5)
    issued = time.monotonic()
    dist.all_reduce(torch.ones(1))
    done = time.monotonic()
    # Both ranks wait for the delayed one: no rank's all_reduce ends before rank 0 issued it, 0.5 s
    # after rank 0 called it. Checked by causality on CLOCK_MONOTONIC (one clock for every process
    # on the machine), not by a rank's own elapsed time, which a rank scheduled late would shorten.
    times = [torch.empty(2, dtype=torch.float64) for _ in range(world_size)]
    dist.all_gather(times, torch.tensor([issued, done], dtype=torch.float64))
    delayed_call = times[0][0].item()
    assert done >= delayed_call + 0.5, (rank, done - delayed_call)


def test_delay_holds_back_the_collective_on_every_rank(tmp_path):
    traces = spawn_ranks(_delay, tmp_path)
    assert traces[0][0].fault == "rank 0: delay collective #1 by 0.5s" and traces[1][0].fault == ""


def _raise_at_second(rank: int, world_size: int, out_dir: str) -> None:
    faults.inject(rank=1, at=1, action="raise")
    dist.all_reduce(torch.ones(1))
    try:
        dist.broadcast(torch.ones(3), src=0)
    except faults.InjectedFault as error:
        with open(f"{out_dir}/raised.txt", "w") as handle:
            handle.write(str(error))
        raise


def test_raise_fails_the_faulty_rank_before_issuing(tmp_path):
    with pytest.raises(mp.ProcessRaisedException):  # rank 1 raised; rank 0 lost its peer
        spawn_ranks(_raise_at_second, tmp_path, timeout_s=3.0)
    assert (tmp_path / "raised.txt").read_text().startswith("injected fault: rank 1: raise collective #2")
    traces = read_traces(tmp_path, 2)
    assert [r.op for r in traces[1]] == ["all_reduce", "broadcast"]
    assert traces[1][0].completed and not traces[1][1].completed


def _exit_in_all_gather(rank: int, world_size: int, out_dir: str) -> None:
    faults.inject(rank=1, at=0, action="exit", exit_code=7, op="all_gather_into_tensor")
    dist.all_reduce(torch.ones(1))
    dist.all_gather_into_tensor(torch.empty(4), torch.ones(2))


def test_exit_kills_the_rank_inside_the_collective_and_the_trace_survives(tmp_path):
    with pytest.raises((mp.ProcessExitedException, mp.ProcessRaisedException)):
        spawn_ranks(_exit_in_all_gather, tmp_path, timeout_s=3.0)
    traces = read_traces(tmp_path, 2)
    last = traces[1][-1]
    assert last.op == "all_gather_into_tensor" and not last.completed
    assert last.fault == "rank 1: exit all_gather_into_tensor collective #1 (exit code 7)"


def _hang_in_barrier(rank: int, world_size: int, out_dir: str) -> None:
    diverging = faults.on_rank(1, "hangs in the barrier")
    faults.inject(rank=1, at=0, action="hang")
    assert diverging == (rank == 1)
    assert faults.active_faults() == ["rank 1: hangs in the barrier", "rank 1: hang collective #1"]
    dist.barrier()


def test_hang_leaves_the_peer_timing_out_and_on_rank_is_listed(tmp_path):
    with pytest.raises(mp.ProcessRaisedException, match=r"(?i)timed out|timeout"):
        spawn_ranks(_hang_in_barrier, tmp_path, timeout_s=2.0)
    traces = read_traces(tmp_path, 2)
    assert traces[1][0].op == "barrier" and not traces[1][0].completed and traces[1][0].fault
