"""Cost of the per-rank collective trace (harness.rank.tracing), which is on by default.

Spawns 2 gloo ranks. Three measurements:
  * recording cost: the trace wrapper around a no-op collective, with a test recording to a file
    (what tracing adds to every collective, without network noise);
  * end-to-end: a 1 MB (per rank) all_gather_into_tensor through the untraced original vs the
    traced entry point, in alternating blocks (noisy on a shared machine; shown for reference);
  * the dispatcher hook (harness.rank.dispatch_hooks), which every process-group collective passes
    through, whoever issued it: a 1-element all-reduce issued as DDP's reducer issues it
    (`ProcessGroup.allreduce`, from below Python's entry points) with the hook bypassed, hooked
    while no test records, and hooked and recorded (its record and its completion watched), in
    alternating blocks: the floor of a collective's cost, so the hook's share is at its largest.

    python bench/trace_overhead.py [--iterations 400] [--record-calls 20000]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness.rank import tracing
from harness.rank.collective_ops import C10D_SPECS

ELEMENTS = 1024 * 1024 // 4  # 1 MB of float32 per rank
BLOCKS = 8


def _mean_us(fn, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) * 1e6 / calls


def recording_cost_us(calls: int, trace_path: str, model_seen: bool = False) -> float:
    """Wrapper cost per call: traced no-op minus bare no-op, while a test records to a file.

    `model_seen`: an all-reduce of a parameter of a 100-parameter model that ran a forward, so each
    record also looks the tensor's name up (harness.rank.tensor_names).
    """

    def no_op(output_tensor, input_tensor, group=None, async_op=False):
        return None

    def no_op_reduce(tensor, op=None, group=None, async_op=False):
        return None

    output, data = torch.empty(2 * ELEMENTS), torch.ones(ELEMENTS)
    tracing.begin_test(trace_path)
    try:
        if model_seen:
            model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(50)))
            model(torch.ones(1, 4))
            parameter = model[-1].weight.data
            traced_reduce = tracing.wrap(no_op_reduce, C10D_SPECS["all_reduce"])
            with_trace = min(_mean_us(lambda: traced_reduce(parameter), calls) for _ in range(3))
            bare = min(_mean_us(lambda: no_op_reduce(parameter), calls) for _ in range(3))
            return with_trace - bare
        traced = tracing.wrap(no_op, C10D_SPECS["all_gather_into_tensor"])  # also all_gather_single's spec
        with_trace = min(_mean_us(lambda: traced(output, data), calls) for _ in range(3))
    finally:
        tracing.end_test()
    bare = min(_mean_us(lambda: no_op(output, data), calls) for _ in range(3))
    return with_trace - bare


def all_gather_us(iterations: int, trace_path: str) -> tuple[float, float]:
    """Median per-call time of the untraced and the traced 1 MB all-gather, alternating blocks."""
    traced = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.13 name
    untraced = traced.__trace_original__
    output, data = torch.empty(2 * ELEMENTS), torch.ones(ELEMENTS)
    per_block = max(1, iterations // BLOCKS)
    for _ in range(20):
        untraced(output, data)
    plain, recorded = [], []
    for _ in range(BLOCKS):
        dist.barrier()
        plain.append(_mean_us(lambda: untraced(output, data), per_block))
        tracing.begin_test(trace_path)
        dist.barrier()
        recorded.append(_mean_us(lambda: traced(output, data), per_block))
        tracing.end_test()
    return statistics.median(plain), statistics.median(recorded)


def dispatch_hook_us(iterations: int, trace_path: str) -> tuple[float, float, float]:
    """Median per-call time of a 1-element `ProcessGroup.allreduce`: hook bypassed, hooked and idle,
    hooked and recorded."""
    group = dist.group.WORLD
    tensor = torch.ones(1)
    below_hook = torch._C._AutoDispatchBelowAutograd  # the dispatcher then skips the autograd-key hook

    def issue() -> None:
        group.allreduce([tensor]).wait()

    def bypassed() -> None:
        with below_hook():
            group.allreduce([tensor]).wait()

    per_block = max(1, iterations // BLOCKS)
    for _ in range(50):
        issue()
    plain, idle, recorded = [], [], []
    for _ in range(BLOCKS):
        dist.barrier()
        plain.append(_mean_us(bypassed, per_block))
        dist.barrier()
        idle.append(_mean_us(issue, per_block))
        tracing.begin_test(trace_path)
        dist.barrier()
        recorded.append(_mean_us(issue, per_block))
        tracing.end_test()
    return statistics.median(plain), statistics.median(idle), statistics.median(recorded)


def _rank(rank: int, world_size: int, work_dir: str, iterations: int, record_calls: int) -> None:
    store = dist.FileStore(os.path.join(work_dir, "store"), world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120)
    )
    tracing.install()
    trace_path = os.path.join(work_dir, f"trace-{rank}.jsonl")
    plain_us, traced_us = all_gather_us(iterations, trace_path)
    hook = dispatch_hook_us(iterations * 4, trace_path) if hasattr(tracing, "dispatch_hooks") else None
    dist.barrier()
    if rank == 0:
        cost_us = recording_cost_us(record_calls, trace_path)
        print(f"trace overhead: {cost_us:.1f} us/collective, {100 * cost_us / plain_us:.2f}% of a 1 MB gloo all_gather")
        if hasattr(tracing, "tensor_names"):  # this checkout names tensors (compare with older ones)
            named_us = recording_cost_us(record_calls, trace_path, model_seen=True)
            print(f"  an all-reduce of a named parameter: {named_us:.1f} us/collective")
        print(
            f"  1 MB all_gather_into_tensor, 2 ranks: untraced {plain_us:.0f} us, traced {traced_us:.0f} us "
            f"(end-to-end difference {traced_us - plain_us:+.0f} us, noisy)"
        )
        if hook is not None:
            bare, idle, recorded = hook
            print(
                f"  dispatcher hook, 1-element ProcessGroup.allreduce (as DDP's reducer issues it), 2 ranks: "
                f"bypassed {bare:.1f} us, hooked {idle:.1f} us ({idle / bare:.2f}x), "
                f"hooked and recorded {recorded:.1f} us ({recorded / bare:.2f}x)"
            )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=400, help="1 MB all-gathers per side")
    parser.add_argument("--record-calls", type=int, default=20000, help="no-op calls for the recording cost")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as work_dir:
        mp.spawn(_rank, args=(2, work_dir, options.iterations, options.record_calls), nprocs=2)


if __name__ == "__main__":
    main()
