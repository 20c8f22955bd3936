"""Reference engine vs torch FSDP2 / FSDP1: step time, peak memory and collective cost, one run.

    python bench/engine_step.py [--steps 30] [--repeats 1] [--configs ...] [--skip-collectives]

Spawns its own processes (no harness), one fresh process group per measurement, so each peak
memory figure belongs to one configuration.

1. Training step (zero_grad, forward, backward, Adam step; median over `--steps` after warm-up)
   and peak memory for the tiny MLP and the transformer, every configuration:
   engine (original parameters), engine-flat (flat parameters), engine-fwd (original parameters
   with forward prefetch: static graphs only), fsdp1 / fsdp1-flat (torch FSDP1 with
   use_orig_params=True / False), fsdp2 (torch fully_shard; original parameters only).
   CPU: world size 2 over gloo, peak memory = the rank processes' peak RSS (max over ranks).
   CUDA (when a GPU exists): world size 1 over NCCL, peak memory = torch.cuda.max_memory_allocated.
2. Collective cost at world sizes 2 and 4 (CPU): the engine's own collective path for every unit
   of the model, back to back (unshard = allocate + all-gather into the unit's buffer + wait,
   reshard = free; reduction = reduce-scatter into a new chunk + wait + average + hand out the
   gradient), against the raw collectives on the same byte counts into preallocated buffers.
3. Ratios against the anchors measured in the same run, and the goals they are held to.

The machine's load (os.getloadavg) is printed at the start and the end: on a shared machine
compare only figures from quiet runs.
"""

from __future__ import annotations

import argparse
import os
import queue as queue_module
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.queues import Queue

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIGS = ("engine", "engine-flat", "engine-fwd", "fsdp1", "fsdp1-flat", "fsdp2")
MODELS = ("tiny", "xfmr")
ANCHOR = "fsdp2"
WARMUP = 5
# Goals (issue #12), CPU at world size 2 from one run: engine / fsdp2 step time and peak memory;
# engine collective path / raw collectives on the same bytes.
STEP_GOALS = {"tiny": 0.5, "xfmr": 0.9}
MEMORY_GOAL = 1.0
COLLECTIVE_GOAL = 1.2


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


def shard(config: str, model: nn.Module, block: type, device: torch.device) -> nn.Module:
    if config.startswith("engine"):
        import engine

        return engine.fully_shard(
            model,
            auto_wrap_classes={block},
            use_orig_params=config != "engine-flat",
            forward_prefetch=config == "engine-fwd",
            device=device,
        )
    if config.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({block}),
            device_id=device,
            use_orig_params=config == "fsdp1",
        )
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():
        if isinstance(module, block):
            fully_shard(module)
    return fully_shard(model)


def _seeded_model(name: str) -> tuple[nn.Module, type, Callable[[torch.Generator], torch.Tensor]]:
    """`build_model` under seed 0: every rank and every measurement starts from the same weights."""
    torch.manual_seed(0)
    return build_model(name)


def _peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _init(rank: int, world: int, init_file: str, device_type: str) -> torch.device:
    backend = "nccl" if device_type == "cuda" else "gloo"
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    return device


def step_rank(
    rank: int, world: int, init_file: str, device_type: str, model_name: str, config: str, steps: int, queue
) -> None:
    """Median step time (s) and peak memory (MiB) of one configuration, max over ranks."""
    device = _init(rank, world, init_file, device_type)
    # Every configuration imports the same modules, so peak RSS compares what the backends
    # allocate rather than how much code they load.
    import torch.distributed.fsdp
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy  # noqa: F401

    import engine  # noqa: F401

    model, block, make_input = _seeded_model(model_name)
    baseline = _peak_memory_mib(device)  # the unsharded model, before the backend allocates
    sharded = shard(config, model.to(device), block, device)
    optim = torch.optim.Adam(sharded.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    inputs = [make_input(generator).to(device) for _ in range(4)]

    def step(index: int) -> float:
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        optim.zero_grad(set_to_none=True)
        sharded(inputs[index % 4]).sum().backward()
        optim.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    times = [step(i) for i in range(WARMUP + steps)]
    peak = _peak_memory_mib(device)
    stats = torch.tensor([statistics.median(times[WARMUP:]), peak, peak - baseline], dtype=torch.float64)
    _send_max(stats, device, rank, queue)


def collective_rank(
    rank: int, world: int, init_file: str, device_type: str, model_name: str, config: str, steps: int, queue
) -> None:
    """Seconds per pass: the engine's collective path for every unit, and raw collectives."""
    import engine
    from engine import collectives

    device = _init(rank, world, init_file, device_type)
    model, block, _ = _seeded_model(model_name)
    sharded = shard("engine", model.to(device), block, device)
    units = [unit for unit in engine.units(sharded) if unit.has_params]
    grads = [torch.randn(unit.layout.padded_numel, device=device) for unit in units]

    def engine_pass() -> None:
        for unit in units:
            unit.unshard()
            unit.reshard()
        for unit, grad in zip(units, grads):
            unit.flat_leaf.grad = grad
            unit.reduce_grad()

    gathered = [torch.empty(unit.layout.padded_numel, device=device) for unit in units]
    chunks = [torch.empty(unit.layout.chunk, device=device) for unit in units]
    group = units[0].topology.shard_group

    def raw_pass() -> None:
        for out, chunk in zip(gathered, chunks):
            collectives._all_gather_single(out, chunk, group=group)
        for grad, chunk in zip(grads, chunks):
            collectives._reduce_scatter_single(chunk, grad, group=group)

    # Alternate the two passes sample by sample, so both see the same machine load.
    engine_times, raw_times = [], []
    for index in range(WARMUP + 3 * steps):
        for run, samples in ((engine_pass, engine_times), (raw_pass, raw_times)):
            sharded.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if index >= WARMUP:
                samples.append(time.perf_counter() - start)
    stats = torch.tensor(
        [statistics.median(engine_times), statistics.median(raw_times), sum(g.numel() for g in grads) * 4 / 2**20]
    )
    _send_max(stats, device, rank, queue)


def _send_max(stats: torch.Tensor, device: torch.device, rank: int, queue: Queue) -> None:
    """The maximum of `stats` over the ranks, sent by rank 0; then the rank leaves (`_leave`)."""
    on_device = stats.to(device)  # NCCL reduces device tensors only
    dist.all_reduce(on_device, op=dist.ReduceOp.MAX)
    if rank == 0:
        queue.put(on_device.cpu().tolist())
    _leave(queue)


def _leave(queue) -> None:
    """End the rank without interpreter teardown, where torch's C++ threads (gloo's) sometimes
    abort ("terminate called without an active exception") after the result was sent."""
    queue.close()
    queue.join_thread()  # the result is in the pipe before the process ends
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_world(target: Callable, world: int, device_type: str, *args) -> list[float]:
    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            context.Process(target=target, args=(r, world, init_file, device_type, *args, queue)) for r in range(world)
        ]
        for proc in procs:
            proc.start()
        while True:  # poll so that a crashed rank fails the run instead of hanging it
            try:
                result = queue.get(timeout=1.0)
                break
            except queue_module.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed:
                    for proc in procs:
                        proc.kill()
                    raise RuntimeError(f"{target.__name__}{args[:2]} ws{world}: a rank exited with {failed}") from None
        for proc in procs:
            proc.join()
    return result


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


def _ratio(ours: float | None, theirs: float | None) -> str:
    return f"{ours / theirs:.2f}" if ours and theirs else "n/a"


def step_section(device_type: str, world: int, configs: list[str], steps: int, repeats: int) -> dict:
    """Best of `repeats` runs per (model, config), the configurations taking turns so that a
    change in the machine's load hits all of them alike."""
    results: dict[tuple[str, str], tuple[float, float, float]] = {}
    memory = "peak RSS" if device_type == "cpu" else "max allocated"
    print(f"\n== step time and peak memory (MiB): {device_type}, world size {world} ==")
    print(
        f"{'model':>5} {'config':>11} {'step ms':>9} {memory:>14} {'above model':>12} "
        f"{'step / ' + ANCHOR:>13} {'memory / ' + ANCHOR:>15}"
    )
    order = [ANCHOR] + [c for c in configs if c != ANCHOR]
    for model_name in MODELS:
        runs: dict[str, list[list[float]]] = {config: [] for config in order}
        for _ in range(repeats):
            for config in order:
                runs[config].append(run_world(step_rank, world, device_type, model_name, config, steps))
        for config in order:
            best = (min(r[0] for r in runs[config]), min(r[1] for r in runs[config]), min(r[2] for r in runs[config]))
            results[(model_name, config)] = best
            anchor = results[(model_name, ANCHOR)]
            print(
                f"{model_name:>5} {config:>11} {best[0] * 1e3:9.2f} {best[1]:14.1f} {best[2]:12.1f} "
                f"{_ratio(best[0], anchor[0]):>13} {_ratio(best[1], anchor[1]):>15}",
                flush=True,
            )
    return results


def collective_section(worlds: list[int], steps: int) -> dict:
    results = {}
    print("\n== collective cost: the engine's path for every unit vs raw collectives, same bytes (cpu) ==")
    print(f"{'ws':>3} {'model':>5} {'MiB/pass':>9} {'engine ms':>10} {'raw ms':>8} {'engine / raw':>13}")
    for world in worlds:
        for model_name in MODELS:
            ours, raw, mib = run_world(collective_rank, world, "cpu", model_name, "engine", steps)
            results[(world, model_name)] = (ours, raw)
            print(
                f"{world:>3} {model_name:>5} {mib:9.2f} {ours * 1e3:10.2f} {raw * 1e3:8.2f} {_ratio(ours, raw):>13}",
                flush=True,
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=1, help="runs per configuration; the best counts")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--collective-world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--skip-collectives", action="store_true")
    args = parser.parse_args()
    print(f"torch {torch.__version__}; {_load()}")
    cpu = step_section("cpu", 2, args.configs, args.steps, args.repeats)
    gpu = step_section("cuda", 1, args.configs, args.steps, args.repeats) if torch.cuda.is_available() else {}
    comm = {} if args.skip_collectives else collective_section(args.collective_world_sizes, args.steps)

    print("\n== goals (ratios from this run) ==")
    for model_name in MODELS:
        anchor = cpu.get((model_name, ANCHOR))
        for config in ("engine", "engine-flat", "engine-fwd"):
            ours = cpu.get((model_name, config))
            if not ours or not anchor:
                continue
            step, peak = ours[0] / anchor[0], ours[1] / anchor[1]
            print(
                f"cpu ws2 {model_name:>5} {config:>11}: step / fsdp2 = {step:.2f} (goal <= {STEP_GOALS[model_name]}) "
                f"{'met' if step <= STEP_GOALS[model_name] else 'MISSED'}; peak RSS / fsdp2 = {peak:.3f} "
                f"(goal <= {MEMORY_GOAL}) {'met' if peak <= MEMORY_GOAL else 'MISSED'}; "
                f"above the model: {ours[2]:.1f} vs {anchor[2]:.1f} MiB"
            )
    for (world, model_name), (ours, raw) in comm.items():
        ratio = ours / raw
        print(
            f"cpu ws{world} {model_name:>5} collectives: engine / raw = {ratio:.2f} (goal <= {COLLECTIVE_GOAL}) "
            f"{'met' if ratio <= COLLECTIVE_GOAL else 'MISSED'}"
        )
    for model_name in MODELS:
        anchor, ours = gpu.get((model_name, ANCHOR)), gpu.get((model_name, "engine"))
        if anchor and ours:
            print(
                f"cuda ws1 {model_name:>5} engine: step / fsdp2 = {ours[0] / anchor[0]:.2f}, "
                f"memory / fsdp2 = {ours[1] / anchor[1]:.2f} (goals <= 1.0)"
            )
    if not gpu:
        print("cuda: no GPU on this machine, CUDA rows not measured")
    print(_load())


if __name__ == "__main__":
    main()
