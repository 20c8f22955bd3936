"""harness.rank.tracing: trace file format, labels, and real collectives traced in 2 spawned gloo ranks.

`spawn_ranks` / `read_traces` are also used by test_divergence.py and test_faults.py.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conformance.adapters.torch_fsdp2 import TorchFSDP2Adapter
from conformance.suite import gate
from harness.rank import labels, tracing
from harness.rank.isolation import GLOO_DESTRUCTOR_HOLDS_GIL
from harness.trace.divergence import first_divergence
from harness.trace.records import CollectiveRecord, Done, Note, RankTrace, decode_line, note_line, read_trace


def spawn_ranks(
    body: Callable[..., None], tmp_path: Path, *args, world_size: int = 2, timeout_s: float = 10.0
) -> dict[int, list[CollectiveRecord]]:
    """Run `body(rank, world_size, out_dir, *args)` on `world_size` gloo ranks with tracing on;
    return every rank's trace. Rank failures propagate as torch.multiprocessing exceptions.

    The ranks come from a fork server that imported torch once for the whole self-test run, so
    each call costs forks rather than `world_size` interpreter starts and torch imports (seconds
    each on a 2-core runner); like spawned ranks, they inherit nothing of this pytest process.
    """
    mp.start_processes(
        _rank_main,
        args=(world_size, body, str(tmp_path), timeout_s, args),
        nprocs=world_size,
        start_method="forkserver",
    )
    return read_traces(tmp_path, world_size)


# Imported by the fork server before it forks any rank (the rank-side modules every body needs).
multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "torch.distributed", "harness.rank.tracing"])


def read_traces(directory: Path, world_size: int) -> dict[int, list[CollectiveRecord]]:
    return {rank: read_trace(str(directory / f"trace-{rank}.jsonl")) for rank in range(world_size)}


def _rank_main(
    rank: int, world_size: int, body: Callable[..., None], out_dir: str, timeout_s: float, args: tuple
) -> None:
    store = dist.FileStore(os.path.join(out_dir, "store"), world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
    )
    tracing.install()
    tracing.begin_test(os.path.join(out_dir, f"trace-{rank}.jsonl"))
    try:
        body(rank, world_size, out_dir, *args)
    finally:
        tracing.end_test()
    if GLOO_DESTRUCTOR_HOLDS_GIL:  # let gloo's workers drop their last tensors first (harness.rank.isolation)
        time.sleep(0.2)
    dist.destroy_process_group()
    # torch's C++ threads sometimes abort ("terminate called without an active exception") in
    # interpreter teardown after FSDP ran; the rank's work is done, so leave without teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def record(index: int, op: str = "all_reduce") -> CollectiveRecord:
    return CollectiveRecord(
        rank=0,
        index=index,
        seq=index,
        op=op,
        group=(0, 1),
        shapes=((2, 3),),
        dtypes=("float32",),
        numel=6,
        label="block.0",
    )


# ----------------------------------------------------------------------------- file format


def test_read_trace_keeps_whole_lines_marks_completion_and_ignores_a_cut_last_line(tmp_path):
    path = tmp_path / "tracing.jsonl"
    first, second = record(0), record(1, op="broadcast")
    path.write_text(first.to_json() + "\n" + '{"done":0}\n' + second.to_json() + "\n" + '{"rank":0,"ind')
    records = read_trace(str(path))
    assert [r.op for r in records] == ["all_reduce", "broadcast"]
    assert records[0].completed and not records[1].completed
    assert records[0].shapes == ((2, 3),) and records[0].group == (0, 1) and records[0].label == "block.0"


def test_read_trace_rejects_a_corrupt_line_before_the_end(tmp_path):
    path = tmp_path / "tracing.jsonl"
    path.write_text("garbage\n" + record(0).to_json() + "\n")
    with pytest.raises(ValueError, match=r"tracing.jsonl:1: corrupt trace line"):
        read_trace(str(path))


def test_a_trace_read_line_by_line_is_the_trace_read_whole(tmp_path):
    """The incremental reader (harness.trace.one_sided) and read_trace decode lines one way (RankTrace)."""
    lines = [record(0).to_json(), '{"done":0}', note_line("a call not recorded").decode().strip(), record(1).to_json()]
    path = tmp_path / "tracing.jsonl"
    path.write_text("\n".join(lines) + "\n")
    incremental = RankTrace()
    for line in lines:
        incremental.add(line.encode())
    notes: list[str] = []
    assert incremental.records == read_trace(str(path), notes)
    assert incremental.notes == notes == ["a call not recorded"]
    assert isinstance(decode_line('{"done":4}'), Done) and isinstance(decode_line('{"note":"x"}'), Note)
    for cut in ('{"rank":0,"ind', "[1, 2]", '{"rank": 0}'):
        with pytest.raises(ValueError, match="not a trace line"):
            decode_line(cut)


def test_record_json_round_trips_optional_fields():
    original = CollectiveRecord(
        rank=1,
        index=4,
        seq=0,
        op="isend",
        group=(0, 1),
        shapes=((3,),),
        dtypes=("int64",),
        numel=3,
        label="",
        peer=0,
        uneven=True,
        fault="rank 1: skip collective #0",
        skipped=True,
    )
    assert CollectiveRecord.from_json(json.loads(original.to_json())) == original


# ---------------------------------------------------------------------------------- labels


class Inner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(2, 2)


class Outer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Inner(), Inner()])
        self._fsdp_wrapped_module = Inner()


def test_module_label_is_the_innermost_fqn_relative_to_the_outermost_module():
    outer = Outer()
    assert labels.module_label([outer, outer.blocks[1], outer.blocks[1].proj]) == "blocks.1.proj"
    assert labels.module_label([outer]) == ""
    assert labels.module_label([]) == ""


def test_module_label_drops_wrapper_segments_and_names_foreign_modules_by_type():
    outer = Outer()
    assert labels.module_label([outer, outer._fsdp_wrapped_module.proj]) == "proj"
    stranger = Inner()
    assert labels.module_label([outer, stranger, stranger.proj]) == "Inner.proj"


def test_install_is_idempotent_and_reaches_early_imported_references():
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.tensor._collective_utils as dtensor_collectives

    tracing.install()
    wrapped = dist.all_reduce
    tracing.install()
    assert tracing.is_installed() and dist.all_reduce is wrapped and wrapped.__trace_original__ is not None
    assert dist.distributed_c10d.all_reduce is wrapped
    assert dtensor_collectives.broadcast is dist.broadcast and hasattr(dist.broadcast, "__trace_original__")
    assert hasattr(funcol.all_gather_tensor, "__trace_original__")
    dynamo_remap_key = getattr(funcol, "legacy_allgather", None)  # must stay the original for Dynamo
    assert dynamo_remap_key is None or not hasattr(dynamo_remap_key, "__trace_original__")


def test_known_ops_fold_aliases_into_canonical_names():
    assert {"all_gather_into_tensor", "reduce_scatter_tensor", "funcol.all_gather", "broadcast"} <= tracing.KNOWN_OPS
    assert not {"all_gather_single", "_all_gather_base", "reduce_scatter_single"} & tracing.KNOWN_OPS


# ------------------------------------------------------------------------ real collectives


class AllReduceLayer(torch.nn.Module):
    """A layer whose forward issues a collective, to check module labels."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x


def _assorted_collectives(rank: int, world_size: int, out_dir: str) -> None:
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor._collective_utils import mesh_broadcast  # bound broadcast early

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), AllReduceLayer())
    model(torch.ones(1, 3))  # 0 all_reduce [1]
    gathered = torch.empty(2 * 4)
    dist.all_gather_into_tensor(gathered, torch.ones(4))  # 1 one record, not two
    dist.all_gather_object([None] * world_size, {"rank": rank})  # 2 one record
    singletons = [dist.new_group([r]) for r in range(world_size)]
    dist.all_reduce(torch.ones(2), group=singletons[rank])  # 3 group (rank,), seq 0
    remove = tracing.register_label_provider(lambda: "from provider")
    dist.broadcast(torch.ones(5), src=0)  # 4 label from provider
    remove()
    funcol.all_reduce(torch.ones(3), "sum", dist.group.WORLD).wait()  # 5 funcol.all_reduce
    assert mesh_broadcast.__globals__["broadcast"].__trace_original__  # 6 broadcast (early-bound)
    mesh_broadcast.__globals__["broadcast"](torch.ones(6), src=0)
    peer = 1 - rank
    works = [dist.isend(torch.ones(7), peer), dist.irecv(torch.empty(7), peer)]  # 7, 8
    for work in works:
        work.wait()
    dist.all_reduce(torch.ones(1), async_op=True).wait()  # 9


def test_real_collectives_are_recorded_once_each_with_groups_seqs_and_labels(tmp_path):
    traces = spawn_ranks(_assorted_collectives, tmp_path)
    for rank in (0, 1):
        records = traces[rank]
        assert [r.op for r in records] == [
            "all_reduce",
            "all_gather_into_tensor",
            "all_gather_object",
            "all_reduce",
            "broadcast",
            "funcol.all_reduce",
            "broadcast",
            "isend",
            "irecv",
            "all_reduce",
        ]
        assert [r.index for r in records] == list(range(10))
        assert all(r.completed and r.rank == rank for r in records)
        world = [r for r in records if r.group == (0, 1) and not r.is_p2p]
        assert [r.seq for r in world] == list(range(len(world)))
        assert records[0].label == "1" and records[0].shapes == ((1, 3),)
        assert records[1].shapes == ((4,),) and records[1].numel == 4
        assert records[3].group == (rank,) and records[3].seq == 0
        assert records[4].label == "from provider" and records[5].label == ""
        assert records[7].peer == 1 - rank and records[8].peer == 1 - rank
        assert (records[7].seq, records[8].seq) == (0, 0)
    assert first_divergence(traces, [0, 1]) is None


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer1 = torch.nn.Linear(4, 4)
        self.layer2 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(self.layer1(x))


def _fsdp2_step(rank: int, world_size: int, out_dir: str) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyNet()
    fully_shard(model.layer1)
    fully_shard(model.layer2)
    fully_shard(model)
    model(torch.randn(2, 4)).sum().backward()


def test_fsdp2_all_gathers_and_reduce_scatters_are_traced_with_their_units_parameters(tmp_path):
    cannot_run = gate.unsupported(TorchFSDP2Adapter, "cpu", torch.__version__)
    if cannot_run is not None:  # the declared platform, proven in tests/conformance_tests/test_platforms.py
        pytest.skip(reason=f"fully_shard on this torch: {cannot_run}")
    traces = spawn_ranks(_fsdp2_step, tmp_path)
    ops = [(r.op, r.label) for r in traces[0]]
    # Forward all-gathers too, not by the module running (harness.rank.torch_fsdp_labels.gathering_unit).
    assert ops[:2] == [
        ("all_gather_into_tensor", "layer1.weight, layer1.bias"),
        ("all_gather_into_tensor", "layer2.0.weight, layer2.0.bias, layer2.2.weight, layer2.2.bias"),
    ]
    # Backward reduce-scatters run outside any forward: named by unit as well.
    assert [label for op, label in ops if op == "reduce_scatter_tensor"] == [
        "layer2.0.weight, layer2.0.bias, layer2.2.weight, layer2.2.bias",
        "layer1.weight, layer1.bias",
    ]
    assert first_divergence(traces, [0, 1]) is None


class UnitStack(torch.nn.Sequential):
    """A root whose children are FSDP2 units called by index ("0", "1"), plus parameters of its own."""

    def __init__(self) -> None:
        super().__init__(TinyNet(), TinyNet())
        self.head = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self[1](self[0](x).repeat(1, 2)))


def _fsdp2_training_steps(rank: int, world_size: int, out_dir: str, reshard: bool, prefetch: bool) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = UnitStack()
    for net in (model[0], model[1]):
        fully_shard(net.layer1, reshard_after_forward=reshard)
        fully_shard(net.layer2, reshard_after_forward=reshard)
        fully_shard(net, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    if prefetch:  # all-gathers issued from another unit's forward and backward hooks
        model[0].set_modules_to_forward_prefetch([model[1]])
        model[1].set_modules_to_backward_prefetch([model[0]])
        model[0].layer1.set_modules_to_forward_prefetch([model[0].layer2])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("prefetch", [False, True], ids=["implicit", "explicit-prefetch"])
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep-unsharded"])
def test_every_fsdp2_unit_all_gather_is_labelled_with_its_parameter_names(tmp_path, reshard, prefetch):
    """Forward, backward, prefetched, root and nested units: an all-gather names the parameters it
    gathers, never the module that happened to run when it was issued (a Sequential's "0")."""
    cannot_run = gate.unsupported(TorchFSDP2Adapter, "cpu", torch.__version__)
    if cannot_run is not None:
        pytest.skip(reason=f"fully_shard on this torch: {cannot_run}")
    traces = spawn_ranks(_fsdp2_training_steps, tmp_path, reshard, prefetch, timeout_s=30.0)
    parameters = {name for name, _ in UnitStack().named_parameters()}
    gathers = [record for record in traces[0] if record.op.startswith("all_gather")]
    assert len(gathers) >= 10, [(record.op, record.label) for record in traces[0]]
    unnamed = [(record.index, record.label) for record in gathers if not set(record.label.split(", ")) <= parameters]
    assert unnamed == [], f"all-gathers not labelled with parameter names: {unnamed}"
    assert first_divergence(traces, [0, 1]) is None


def _fsdp1_step(rank: int, world_size: int, out_dir: str) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = FullyShardedDataParallel(
        TinyNet(), device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear})
    )
    model(torch.randn(2, 4)).sum().backward()


def test_fsdp1_flat_parameter_collectives_are_traced_with_unwrapped_labels(tmp_path):
    traces = spawn_ranks(_fsdp1_step, tmp_path)
    forward_gathers = [r.label for r in traces[0] if r.op.startswith("all_gather")][:3]
    assert forward_gathers == ["layer1", "layer2.0", "layer2.2"]
    assert [r.label for r in traces[0] if r.op == "reduce_scatter_tensor"] == [
        "layer2.2.weight, layer2.2.bias",
        "layer2.0.weight, layer2.0.bias",
        "layer1.weight, layer1.bias",
    ]
    assert first_divergence(traces, [0, 1]) is None
