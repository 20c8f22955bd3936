"""Step time and peak RSS of the reference engine vs torch FSDP1, FSDP2 and DDP (CPU / gloo).

Spawns its own processes (no harness): one fresh process group per (world size, model, backend)
so peak RSS is per configuration.  Also times the engine's all-gathers / reduce-scatters per step
against raw collectives on the same byte counts.

    python bench/engine_step.py [--steps 30] [--world-sizes 2 4]

Last line: `engine ws2 tiny: ref/fsdp2 = R1, xfmr: ref/fsdp2 = R2`.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BACKENDS = ("engine", "fsdp1", "fsdp2", "ddp")
MODELS = ("tiny", "xfmr")


class Block(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(100, 100), nn.ReLU())


def build_model(name: str) -> tuple[nn.Module, type, Callable[[torch.Generator], torch.Tensor]]:
    """(model, class of its sharded blocks, input maker)."""
    if name == "tiny":
        model = nn.Sequential(nn.Linear(100, 100), Block(), Block(), nn.Linear(100, 100))
        return model, Block, lambda g: torch.randn(2, 100, generator=g)
    layer = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True, dropout=0.0)
    model = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
    return model, nn.TransformerEncoderLayer, lambda g: torch.randn(8, 64, 256, generator=g)


def shard(backend: str, model: nn.Module, block: type) -> nn.Module:
    if backend == "engine":
        import engine

        return engine.fully_shard(model, auto_wrap_classes={block})
    if backend == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({block}), device_id=torch.device("cpu"), use_orig_params=True
        )
    if backend == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for module in model.modules():
            if isinstance(module, block):
                fully_shard(module)
        return fully_shard(model)
    return nn.parallel.DistributedDataParallel(model)


def timed_collectives() -> dict[str, list]:
    """Wrap the engine's collective entry points to time them (and record their sizes).

    Asynchronous reduce-scatters are waited inside the timer, so this runs in a separate pass
    from the step-time measurement.
    """
    from engine import collectives

    record: dict[str, list] = {"all_gather": [], "reduce_scatter": []}
    for key, attr in (("all_gather", "all_gather_flat"), ("reduce_scatter", "reduce_scatter_flat")):
        original = getattr(collectives, attr)

        def wrapper(output, source, group, _original=original, _key=key, **kwargs):
            start = time.perf_counter()
            work = _original(output, source, group, **kwargs)
            if work is not None:
                work.wait()
            record[_key].append((time.perf_counter() - start, output.numel(), source.numel()))
            return work

        setattr(collectives, attr, wrapper)
    return record


def raw_collective_time(record: dict[str, list], steps: int) -> float:
    """Seconds per step for raw collectives on the byte counts the engine issued per step."""
    per_step = {k: v[: len(v) // steps] for k, v in record.items()}
    buffers = [
        (k, torch.empty(out), torch.empty(src)) for k, entries in per_step.items() for _, out, src in entries
    ]
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        for kind, out, src in buffers:
            (gather if kind == "all_gather" else scatter)(out, src)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_rank(rank: int, world: int, init_file: str, model_name: str, backend: str, steps: int, queue) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, block, make_input = build_model(model_name)
    sharded = shard(backend, model, block)
    optim = torch.optim.Adam(sharded.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    inputs = [make_input(generator) for _ in range(4)]

    def step(index: int) -> float:
        dist.barrier()
        start = time.perf_counter()
        optim.zero_grad(set_to_none=True)
        sharded(inputs[index % 4]).sum().backward()
        optim.step()
        return time.perf_counter() - start

    warmup = 5
    times = [step(i) for i in range(warmup + steps)]
    step_time = statistics.median(times[warmup:])
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before the comm pass
    comm = raw = 0.0
    if backend == "engine":
        record = timed_collectives()
        for i in range(steps):
            step(i)
        comm = sum(t for entries in record.values() for t, _, _ in entries) / steps
        raw = raw_collective_time(record, steps)
    stats = torch.tensor([step_time, peak_rss_mb, comm, raw], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    if rank == 0:
        queue.put(stats.tolist())
    dist.destroy_process_group()


def measure(world: int, model_name: str, backend: str, steps: int) -> list[float]:
    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            context.Process(target=run_rank, args=(r, world, init_file, model_name, backend, steps, queue))
            for r in range(world)
        ]
        for proc in procs:
            proc.start()
        while True:  # poll so that a crashed rank fails the run instead of hanging it
            try:
                result = queue.get(timeout=1.0)
                break
            except Exception:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed:
                    for proc in procs:
                        proc.kill()
                    raise RuntimeError(f"{backend} {model_name} ws{world}: a rank exited with {failed}")
        for proc in procs:
            proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    args = parser.parse_args()
    results: dict[tuple[int, str, str], list[float]] = {}
    print(f"{'ws':>3} {'model':>5} {'backend':>7} {'step ms':>9} {'peak RSS MB':>12} {'engine comm ms':>15} {'raw comm ms':>12}")
    for world in args.world_sizes:
        for model_name in MODELS:
            for backend in args.backends:
                step, rss, comm, raw = results[(world, model_name, backend)] = measure(world, model_name, backend, args.steps)
                comm_text = f"{comm * 1e3:15.2f} {raw * 1e3:12.2f}" if backend == "engine" else f"{'':>15} {'':>12}"
                print(f"{world:>3} {model_name:>5} {backend:>7} {step * 1e3:9.2f} {rss:12.1f} {comm_text}", flush=True)
    ratios = []
    for model_name in MODELS:
        ours, theirs = results.get((2, model_name, "engine")), results.get((2, model_name, "fsdp2"))
        ratios.append(f"{ours[0] / theirs[0]:.2f}" if ours and theirs else "n/a")
    print(f"engine ws2 tiny: ref/fsdp2 = {ratios[0]}, xfmr: ref/fsdp2 = {ratios[1]}")


if __name__ == "__main__":
    main()
