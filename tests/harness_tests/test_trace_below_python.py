"""Collectives issued below Python, and completion observed rather than assumed (2 gloo ranks each).

harness.rank.dispatch_hooks records what DDP's reducer and process-group methods issue from C++,
in one numbering with the Python entry points; harness.rank.completion marks a record done when
its work completed: an async call's `Work`, a functional collective's waited-for tensor.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from test_trace import spawn_ranks

from harness.rank import completion, dispatch_hooks, tracing
from harness.trace.divergence import first_divergence
from harness.trace.records import RankTrace


def _ddp_steps(rank: int, world_size: int, out_dir: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.0001)  # tiny buckets: one per parameter or two
    for _ in range(2):
        ddp(torch.randn(3, 4)).sum().backward()
    dist.all_reduce(torch.ones(2))  # a Python collective after them, in the same numbering
    process_group = dist.group.WORLD
    process_group.allreduce([torch.ones(5)]).wait()  # a ProcessGroup method called directly


def test_ddp_reductions_and_process_group_methods_are_traced_in_order_with_their_buckets(tmp_path):
    traces = spawn_ranks(_ddp_steps, tmp_path)
    assert first_divergence(traces, [0, 1]) is None
    for rank in (0, 1):
        records = traces[rank]
        assert [r.index for r in records] == list(range(len(records)))
        assert all(r.completed for r in records), [(r.index, r.op) for r in records if not r.completed]
        buckets = [r for r in records if r.label.startswith("DDP bucket")]
        # The first iteration reduces one bucket (DDP's first bucket has a cap of its own); the
        # second, after DDP rebuilt its buckets in the order gradients became ready, two or more.
        assert len(buckets) >= 3, [(r.op, r.label) for r in records]
        assert buckets[0].label == "DDP bucket 0 of 1 [0.bias, 0.weight, 2.bias, 2.weight]", buckets[0].label
        assert all(r.op == "all_reduce" and r.async_op for r in buckets)
        named = {name for r in buckets for name in r.label.partition("[")[2].rstrip("]").split(", ")}
        assert named == {"0.weight", "0.bias", "2.weight", "2.bias"}, named
        assert sum(r.numel for r in buckets[-2:]) <= 58
        assert all(r.site.endswith("test_trace_below_python.py:29") for r in buckets), [r.site for r in buckets]
        tail = [(r.op, r.numel) for r in records[-2:]]
        assert tail == [("all_reduce", 2), ("all_reduce", 5)], tail
        assert records[-2].site.endswith(":30") and records[-1].site.endswith(":32")
        assert records[-1].async_op and not records[-2].async_op
        # DDP's start-up check of parameter shapes, an all-gather from C++, is the first record.
        assert records[0].op == "all_gather" and records[0].async_op


def _trace_lines(out_dir: str, rank: int) -> RankTrace:
    trace = RankTrace()
    with open(os.path.join(out_dir, f"trace-{rank}.jsonl"), "rb") as handle:
        for line in handle.read().splitlines():
            trace.add(line)
    return trace


def _late_peer(rank: int, world_size: int, out_dir: str) -> None:
    import torch.distributed._functional_collectives as funcol

    if rank == 1:
        time.sleep(1.0)  # rank 0's async calls are issued, and cannot complete, until rank 1 joins
    work = dist.all_reduce(torch.ones(3), async_op=True)
    if rank == 0:
        pending = _trace_lines(out_dir, 0).by_index[0]
        assert not pending.completed, "an async all_reduce was marked done before its peer joined"
    work.wait()
    deadline = time.monotonic() + 2.0
    while rank == 0 and not _trace_lines(out_dir, 0).by_index[0].completed:
        assert time.monotonic() < deadline, "the async all_reduce was not marked done after it completed"
        time.sleep(0.01)
    result = funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD)
    if rank == 0:
        assert not _trace_lines(out_dir, 0).by_index[1].completed, "a functional collective done before its wait"
    assert result.wait().tolist() == [2.0, 2.0]
    if rank == 0:
        assert _trace_lines(out_dir, 0).by_index[1].completed, "a waited-for functional collective not marked done"


def test_async_and_functional_collectives_are_done_when_they_completed_not_when_called(tmp_path):
    traces = spawn_ranks(_late_peer, tmp_path)
    assert [r.op for r in traces[0]] == ["all_reduce", "funcol.all_reduce"]
    assert all(r.completed for trace in traces.values() for r in trace)


def _hooks_installed(rank: int, world_size: int, out_dir: str) -> None:
    assert dispatch_hooks.install(lambda *a: None, lambda t: None) == [], "ops this torch does not let the trace see"
    assert tracing._unseen == []


def test_every_process_group_op_is_hooked_on_this_torch(tmp_path):
    """On a torch where some op could not be hooked, every trace would carry a note saying so."""
    spawn_ranks(_hooks_installed, tmp_path)


def test_the_completion_watch_reports_each_record_once_and_forgets_the_rest_at_the_end():
    done: list[int] = []

    class FakeWork:
        def __init__(self) -> None:
            self.finished = False

        def is_completed(self) -> bool:
            return self.finished

        def get_future(self) -> FakeWork:
            return self  # its done() is its state

        def done(self) -> bool:
            return self.finished

    class SilentWork(FakeWork):
        """Like gloo's reduce_scatter_tensor work: no state of its own, no future."""

        def get_future(self) -> FakeWork:
            raise RuntimeError("Work::getFuture not implemented.")

    watch = completion.CompletionWatch(done.append)
    first, second, never = FakeWork(), FakeWork(), FakeWork()
    assert not any(watch.add_work(index, work, on_cpu=True) for index, work in enumerate((first, second, never)))
    second.finished = True
    deadline = time.monotonic() + 2.0
    while done != [1]:
        assert time.monotonic() < deadline, done
        time.sleep(0.005)
    tensor = torch.ones(4)
    watch.add_tensors(3, [tensor])
    watch.tensor_waited(tensor.view(2, 2))  # the same storage
    watch.tensor_waited(tensor)  # once only
    silent = SilentWork()  # never says: its wait() returning does
    on_device = FakeWork()  # an NCCL work's wait() only orders streams: it is done when it says so
    watch.add_work(4, silent, on_cpu=True)
    watch.add_work(5, on_device, on_cpu=False)
    watch.work_waited(silent)
    watch.work_waited(on_device)
    assert done == [1, 3, 4], done
    first.finished = True
    watch.close()
    assert done == [1, 3, 4, 0], done
    watch.done(2)  # after the end: nothing more is written
    assert done == [1, 3, 4, 0] and watch.pending == 0
