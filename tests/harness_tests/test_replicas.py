"""Replica checks: which tensors each rule takes as replicated, over which group, and what a drift says.

The rules run on two real ranks of this session's warm pool (distributed tests: no inner
session), each test naming the structures it builds (DDP, DTensor placements, FSDP1 strategies,
FSDP2, a ZeRO-3 partitioned parameter, plain models named or proven replicated by their
all-reduced gradients, the reference engine's strategies under the automatic check). The
comparison, the verdict's use of it and the one-line reasons are pure and checked in this process.
The user's view (a test that fails on seeded drift, through the real plugin) is
tests/harness_tests/test_replicas_e2e.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

import harness
from conformance.adapters.torch_fsdp2 import TorchFSDP2Adapter
from conformance.suite import gate
from harness.messages import RankLoss, RankOutcome
from harness.rank import replicas
from harness.report.results import FailureReason
from harness.report.run_summary import failure_reason
from harness.session.flow import check_replicas
from harness.session.verdict import decide
from harness.trace.checksums import ReplicaSnapshot, TensorChecksum, compare, comparison


# ------------------------------------------------------------------ rank side: what a rank compares
def digests(model: nn.Module, group: dist.ProcessGroup | None = None) -> dict[str, TensorChecksum]:
    """This rank's snapshot of `model`, by tensor name."""
    return {checksum.name: checksum for checksum in harness.replica_snapshot(model, group).tensors.values()}


def seeded(rank: int, module: type[nn.Module] | None = None) -> nn.Module:
    """A model built after seeding by rank: the bug."""
    torch.manual_seed(rank)
    return module() if module is not None else nn.Linear(4, 3)


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


@pytest.mark.world_size(2)
def test_ddp_parameters_over_its_group_buffers_only_without_broadcast_ignored_ones_never(rank):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = WithBuffer()
    DDP._set_params_and_buffers_to_ignore_for_model(model, ["fc.bias"])
    ddp = DDP(model)  # broadcasts rank 0's state: replicas agree
    found = digests(ddp)
    assert sorted(found) == ["fc.weight"], found  # bias ignored, buffers re-broadcast at each forward
    assert (found["fc.weight"].group, found["fc.weight"].rule) == ((0, 1), "DDP")
    with torch.no_grad():
        model.fc.bias.add_(rank)  # ignored: DDP never syncs it
        model.scale.add_(rank)  # DDP broadcasts buffers at the next forward
    assert harness.check_replicas(ddp).compared == 1
    unsynced = DDP(WithBuffer(), broadcast_buffers=False)
    assert sorted(digests(unsynced)) == ["fc.bias", "fc.weight", "scale"]
    with torch.no_grad():
        unsynced.module.scale.add_(rank)
    with pytest.raises(harness.ReplicaDrift, match=r"scale \(buffer, .*broadcast_buffers=False"):
        harness.check_replicas(unsynced)
    # Over its own group: a DDP of one rank per group compares nothing across ranks.
    alone = [dist.new_group([0]), dist.new_group([1])][rank]
    lonely = DDP(seeded(rank), process_group=alone)
    assert {checksum.group for checksum in digests(lonely).values()} == {(rank,)}
    assert harness.check_replicas(lonely).compared == 0


def local_dtensor(mesh, placements, rank: int):
    from torch.distributed.tensor import DTensor

    return nn.Parameter(DTensor.from_local(torch.full((2,), float(rank)), mesh, placements, run_check=False))


@pytest.mark.world_size(2)
def test_dtensors_are_compared_along_their_replicate_dimensions_only(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard

    flat = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    wide = init_device_mesh("cpu", (1, 2), mesh_dim_names=("rep", "tp"))
    tall = init_device_mesh("cpu", (2, 1), mesh_dim_names=("rep", "shard"))
    model = nn.Module()
    model.replicated = local_dtensor(flat, [Replicate()], rank)  # differs by rank: drift
    model.sharded = local_dtensor(flat, [Shard(0)], rank)
    model.partial = local_dtensor(flat, [Partial()], rank)
    model.hsdp = local_dtensor(tall, [Replicate(), Shard(0)], 0)  # HSDP: replicate dim 0 spans both ranks
    model.tp_replicated = local_dtensor(wide, [Replicate(), Replicate()], 0)
    model.alone = local_dtensor(wide, [Replicate(), Shard(0)], rank)  # its replicate dim has one rank
    found = digests(model)
    assert {name: c.group for name, c in found.items()} == {
        "replicated": (0, 1),
        "hsdp": (0, 1),
        "tp_replicated": (0, 1),
        "alone": (rank,),
    }
    assert found["hsdp"].rule == "DTensor Replicate() on mesh dim 0 ('rep')"
    assert found["tp_replicated"].rule == "DTensor Replicate() on mesh dims 0 ('rep'), 1 ('tp')"
    with pytest.raises(harness.ReplicaDrift) as caught:
        harness.check_replicas(model)
    assert [drift.name for drift in caught.value.report.drifts] == ["replicated"]


@pytest.mark.world_size(2)
def test_fsdp1_flat_parameters_no_shard_whole_hybrid_over_the_replicate_group_full_shard_never(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    cpu = torch.device("cpu")
    found = {}
    for strategy in (ShardingStrategy.NO_SHARD, ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        torch.manual_seed(0)
        model = FSDP(WithBuffer(), sharding_strategy=strategy, device_id=cpu)
        model(torch.full((2, 4), float(rank))).sum().backward()
        found[strategy.name] = {name: (c.kind, c.rule, c.group) for name, c in digests(model).items()}
        harness.check_replicas(model)
    flat = "flat parameter of fc.weight, fc.bias"
    # FSDP1 never syncs buffers; FULL_SHARD and SHARD_GRAD_OP keep shards.
    assert found == {
        "NO_SHARD": {"_flat_param": (flat, "FSDP1 NO_SHARD", (0, 1))},
        "FULL_SHARD": {},
        "SHARD_GRAD_OP": {},
    }
    # HYBRID_SHARD: a unit's shard over its replicate group (ranks 0 and 1 hold shard 0 of a one-rank
    # shard group here), as FSDP1 keeps it when the shard group has several ranks.
    unit = SimpleNamespace(
        _handle=SimpleNamespace(flat_param=model._handle.flat_param),
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        process_group=[dist.new_group([0]), dist.new_group([1])][rank],
        _inter_node_pg=dist.new_group([0, 1]),
    )
    assert replicas._fsdp1_flat_parameter("layer", unit)[:4] == (
        "layer._flat_param",
        f"{flat}, this rank's shard",
        "FSDP1 HYBRID_SHARD replicate group",
        (0, 1),
    )
    # A shard group of one rank: FSDP1 runs HYBRID_SHARD as NO_SHARD over it and reduces no
    # gradient across the replicate group, so per-rank batches drift the replicas it was asked for.
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 1))
    hybrid = FSDP(WithBuffer(), sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_id=cpu, device_mesh=mesh)
    assert hybrid.sharding_strategy is ShardingStrategy.NO_SHARD
    harness.check_replicas(hybrid)  # the same seed: equal so far
    optimizer = torch.optim.SGD(hybrid.parameters(), lr=0.1)
    hybrid(torch.full((2, 4), float(rank))).sum().backward()
    optimizer.step()
    with pytest.raises(
        harness.ReplicaDrift, match=r"_flat_param \(flat parameter of fc.weight, fc.bias, .*one rank"
    ) as caught:
        harness.check_replicas(hybrid)
    assert "(torch FSDP1 runs HYBRID_SHARD on a shard group of one rank as NO_SHARD" in str(caught.value)


# fully_shard runs on CPU only where the torch FSDP2 adapter declares it (conformance.suite.gate).
FSDP2_CANNOT_RUN = gate.unsupported(TorchFSDP2Adapter, "cpu", torch.__version__)


@pytest.mark.world_size(2)
@pytest.mark.check_replicas
@pytest.mark.skipif(FSDP2_CANNOT_RUN is not None, reason=f"fully_shard on this torch: {FSDP2_CANNOT_RUN}")
def test_fsdp2_shards_never_hsdp_replicas_over_the_replicate_dimension(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    sharded = fully_shard(WithBuffer())
    hsdp = fully_shard(WithBuffer(), mesh=init_device_mesh("cpu", (2, 1), mesh_dim_names=("rep", "shard")))
    for model in (sharded, hsdp):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.full((2, 4), float(rank))).sum().backward()
            optimizer.step()
    assert digests(sharded) == {}  # Shard(0) parameters; the plain buffer is never FSDP2's to sync
    assert {name: c.group for name, c in digests(hsdp).items()} == {"fc.weight": (0, 1), "fc.bias": (0, 1)}
    harness.check_replicas(hsdp)  # and the automatic check (the marker) finds no drift either


@pytest.mark.world_size(2)
def test_a_partitioned_parameter_makes_a_model_structured_its_plain_tensors_uncompared(rank):
    model = seeded(rank, WithBuffer)
    model.fc.weight.ds_tensor = torch.zeros(1)  # DeepSpeed ZeRO-3's mark: this rank's partition
    assert digests(model) == {}
    assert harness.check_replicas(model).compared == 0


@pytest.mark.world_size(2)
def test_a_named_plain_model_is_compared_whole_over_its_group(rank):
    model = seeded(rank, WithBuffer)
    assert sorted(digests(model)) == ["fc.bias", "fc.weight", "scale"]
    assert {c.rule for c in digests(model).values()} == {"named replicated by the test (harness.check_replicas)"}
    with pytest.raises(harness.ReplicaDrift) as caught:
        harness.check_replicas(model)
    assert sorted(drift.name for drift in caught.value.report.drifts) == ["fc.bias", "fc.weight"]
    alone = [dist.new_group([0]), dist.new_group([1])][rank]
    assert {c.group for c in digests(model, alone).values()} == {(rank,)}
    assert harness.check_replicas(model, alone).compared == 0  # a group of one: nothing to compare


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.synced = nn.Linear(4, 4)
        self.local = nn.Linear(4, 2)  # its gradient stays this rank's: may differ

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.local(self.synced(x))


@pytest.mark.world_size(2)
@pytest.mark.check_replicas
def test_the_automatic_check_compares_a_plain_parameter_whose_gradient_was_all_reduced_whole(rank):
    torch.manual_seed(0)
    model = TwoLayers()
    with torch.no_grad():
        model.local.weight.add_(rank)  # never synced, never compared
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.full((2, 4), float(rank))).sum().backward()
        for parameter in model.synced.parameters():
            dist.all_reduce(parameter.grad)
        dist.all_reduce(model.local.bias.grad[:1])  # a part of it: no evidence
        optimizer.step()
        optimizer.zero_grad()
    taken = replicas.active_recorder().finish()
    assert {c.name: (c.rule, c.group) for c in taken.tensors.values()} == {
        "synced.weight": ("its gradient was all-reduced whole", (0, 1)),
        "synced.bias": ("its gradient was all-reduced whole", (0, 1)),
    }
    assert len(taken.steps) == 3 and set(taken.steps[0]) == set(taken.tensors)  # before step 1, after 1 and 2


@pytest.mark.world_size(2)
@pytest.mark.check_replicas
@pytest.mark.parametrize(
    "strategy",
    ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "SHARD_OPTIM_STATE", "SHARD_GRAD_AND_OPTIM_STATE"],
)
def test_the_reference_engine_trained_under_the_check_gives_no_false_verdict(rank, strategy):
    import engine

    torch.manual_seed(0)
    options = {"shard_group_size": 1} if strategy == "HYBRID_SHARD" else {}
    model = engine.fully_shard(TwoLayers(), strategy=engine.ShardingStrategy[strategy], **options)
    if strategy == "SHARD_GRAD_AND_OPTIM_STATE":  # ZeRO-2 keeps gradients in its optimizer's partitions
        optimizer = engine.ShardedOptimizer(model, lambda params: torch.optim.SGD(params, lr=0.1))
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.full((2, 4), float(rank))).sum().backward()  # per-rank batches: shards differ
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.world_size(2)
def test_check_replicas_raises_the_same_drift_on_every_rank_and_passes_once_broadcast(rank):
    model = seeded(rank)  # the bug: ranks seeded differently, no broadcast
    with pytest.raises(harness.ReplicaDrift) as caught:
        harness.check_replicas(model)
    messages = [None, None]
    dist.all_gather_object(messages, str(caught.value))
    assert messages[0] == messages[1]
    assert "weight (parameter, float32 [3, 4], replicated over ranks [0, 1]" in messages[0]
    assert "rank 0 sum " in messages[0] and " vs rank 1 sum " in messages[0]
    for tensor in model.parameters():
        dist.broadcast(tensor.data, src=0)  # the fix
    report = harness.check_replicas(model)
    assert (report.ok, report.compared, report.names) == (True, 2, ("weight", "bias"))


# ------------------------------------------------------------------ parent side: the comparison
def checksum(name: str, bits: int, group=(0, 1), total: float = 1.0, **fields) -> TensorChecksum:
    values = {"kind": "parameter", "rule": "DDP", "dtype": "float32", "shape": (2,), "squares": 1.0, **fields}
    return TensorChecksum(f"Net#0/{name}", name, group=tuple(group), bits=bits, total=total, **values)


def snapshot(rank: int, *checksums: TensorChecksum, steps=()) -> ReplicaSnapshot:
    return ReplicaSnapshot(rank, {c.key: c for c in checksums}, [dict(step) for step in steps])


def test_the_comparison_is_per_group_and_finds_the_first_step_a_replica_differed() -> None:
    key, trio = "Net#0/w", (0, 1, 2)
    history = [{key: 1}, {key: 2}, {key: 3}]
    snapshots = {
        0: snapshot(0, checksum("w", 7, trio, total=1.275), checksum("h", 1, (0, 2)), steps=history),
        1: snapshot(1, checksum("w", 8, trio, total=-1.178), checksum("h", 5, (1, 3)), steps=[*history[:2], {key: 4}]),
        2: snapshot(2, checksum("w", 7, trio, total=1.275), checksum("h", 1, (0, 2)), steps=history),
        3: snapshot(3, checksum("h", 5, (1, 3))),  # no w: left out of its comparison
    }
    report = comparison(snapshots)
    assert (report.compared, report.names, report.ranks) == (3, ("w", "h"), (0, 1, 2, 3))
    assert report.drift is not None and [d.name for d in report.drift.drifts] == ["w"]
    drift = report.drift.drifts[0]
    assert drift.values() == "ranks 0, 2 sum 1.275 vs rank 1 sum -1.178"
    assert drift.when() == "first differed after optimizer step 2 (equal after step 1)"
    assert report.drift.line() == (
        "replicas drifted: w: ranks 0, 2 sum 1.275 vs rank 1 sum -1.178, first differed after optimizer step 2 "
        "(equal after step 1)"
    )
    assert report.drift.describe().startswith(
        "replicas drifted: 1 of 3 replicated tensors differs across ranks\n  w (parameter, float32 [2], "
        "replicated over ranks [0, 1, 2]: DDP): ranks 0, 2 sum 1.275 vs rank 1 sum -1.178; first differed after "
        "optimizer step 2 (equal after step 1)\n"
    )
    # A snapshot travels as JSON-able data (files), and compares the same.
    assert compare({rank: snap.to_dict() for rank, snap in snapshots.items()}) == report.drift
    assert ReplicaSnapshot.from_dict(snapshots[0].to_dict()) == snapshots[0]
    assert compare({0: snapshots[0], 2: snapshots[2]}) is None


@pytest.mark.parametrize(
    ("steps", "when"),
    [
        ([], "first differed: unknown (no optimizer step recorded)"),
        ([({"Net#0/w": 1}, {"Net#0/w": 2})], "first differed before the first optimizer step"),
        (
            [({}, {}), ({"Net#0/w": 1}, {"Net#0/w": 2})],
            "first differed after optimizer step 1, when it was first watched",
        ),
        (
            [({"Net#0/w": 1}, {"Net#0/w": 1}), ({"Net#0/w": 2}, {"Net#0/w": 2})],
            "first differed after the last optimizer step (1), by the end of the test",
        ),
    ],
)
def test_when_a_drift_first_appeared(steps, when) -> None:
    mine = snapshot(0, checksum("w", 1), steps=[pair[0] for pair in steps])
    theirs = snapshot(1, checksum("w", 2), steps=[pair[1] for pair in steps])
    assert compare({0: mine, 1: theirs}).drifts[0].when() == when


def test_values_are_shown_as_precisely_as_it_takes_to_tell_them_apart() -> None:
    close = {0: snapshot(0, checksum("w", 1, total=1.0000001)), 1: snapshot(1, checksum("w", 2, total=1.0000002))}
    assert compare(close).drifts[0].values() == "rank 0 sum 1.0000001 vs rank 1 sum 1.0000002"
    same_sum = {0: snapshot(0, checksum("w", 1)), 1: snapshot(1, checksum("w", 2))}
    assert compare(same_sum).drifts[0].values() == "rank 0 sum 1 bits 0x1 vs rank 1 sum 1 bits 0x2"
    shapes = {0: snapshot(0, checksum("w", 1)), 1: snapshot(1, checksum("w", 1, shape=(3,)))}
    assert compare(shapes).drifts[0].values() == "rank 0 float32 [2] sum 1 vs rank 1 float32 [3] sum 1"


def outcome(rank: int, drifting: bool = False, status: str = "passed", summary: str = "") -> RankOutcome:
    digest = checksum("weight", 2 if drifting and rank == 1 else 1, total=float(rank if drifting else 0))
    return RankOutcome(rank, status, 1.0, summary, replicas=snapshot(rank, digest))  # type: ignore[arg-type]


def test_a_drift_fails_a_passing_test_and_comes_after_any_other_reason() -> None:
    passed = decide({0: outcome(0, True), 1: outcome(1, True)})
    assert passed.outcome == "failed" and passed.message.startswith("replicas drifted: 1 of 1 replicated tensor ")
    assert passed.drift == "replicas drifted: 1 of 1 replicated tensor differs across ranks"
    line = (
        "replicas drifted: weight: rank 0 sum 0 vs rank 1 sum 1, first differed: unknown (no optimizer step recorded)"
    )
    assert passed.reason is not None and failure_reason(passed.reason) == line
    assert decide({0: outcome(0), 1: outcome(1)}).outcome == "passed"
    failed = decide({0: outcome(0, True), 1: outcome(1, True, "failed", "AssertionError: mine")})
    assert failure_reason(failed.reason) == "rank 1: AssertionError: mine"
    assert failed.message.endswith(passed.message)  # the drift follows the account
    diverged = decide({0: outcome(0, True), 1: outcome(1, True)}, "collective #1 on group [0, 1]: x vs y")
    assert (
        failure_reason(diverged.reason) == "ranks issued divergent collectives: collective #1 on group [0, 1]: x vs y"
    )
    assert diverged.message.endswith(passed.message) and diverged.drift == passed.drift
    # Ranks without digests (lost) leave the comparison: nothing to compare with one rank.
    assert decide({0: outcome(0, True), 1: RankLoss(1, "was killed by SIGKILL (9)")}).drift == ""


def test_the_failed_line_names_a_divergence_before_its_consequences() -> None:
    heading = "ranks issued divergent collectives: collective #1 on group [0, 1]: rank 0 all_reduce 212 float32 vs ..."
    aborted = FailureReason(1, "was killed by SIGABRT (6)", divergence=heading, first_by="message")
    assert failure_reason(aborted) == f"{heading}; then rank 1 failed first: was killed by SIGABRT (6)"
    timed_out = FailureReason(ranks_by_cause=(("RuntimeError: timed out", (0, 1)),), divergence=heading)
    assert failure_reason(timed_out) == f"{heading}; then ranks 0, 1: RuntimeError: timed out"
    long = FailureReason(1, "x" * 400, divergence=heading)
    assert failure_reason(long).startswith(heading) and len(failure_reason(long)) == 300
    assert failure_reason(FailureReason(divergence=heading)) == heading  # the divergence alone: as before


def test_the_marker_decides_and_the_option_is_its_default() -> None:
    def item(option: bool, *marker_args: object):
        marker = SimpleNamespace(args=marker_args, kwargs={}) if marker_args != (None,) else None
        return SimpleNamespace(
            config=SimpleNamespace(option=SimpleNamespace(check_replicas=option)),
            get_closest_marker=lambda name: marker,
        )

    assert [check_replicas(item(False, None)), check_replicas(item(True, None))] == [False, True]
    assert [check_replicas(item(False)), check_replicas(item(True, False))] == [True, False]
