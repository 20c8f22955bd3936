"""A collective's identity beyond op, shape and dtype: tensor names, call sites, the arguments that
must agree, asymmetric regions, and a trace that never raises into the code it wraps.

The real-rank cases run in ONE 2-rank spawn: each scenario records into its own trace files.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.distributed as dist
from test_trace import spawn_ranks

from conformance.adapters.torch_fsdp2 import TorchFSDP2Adapter
from conformance.suite import gate
from harness import asymmetric, name_tensor, skip_call_sites_in
from harness.rank import call_sites, tracing
from harness.rank.collective_ops import C10D_SPECS
from harness.trace.divergence import first_divergence
from harness.trace.records import CollectiveRecord, read_trace


class TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 8, bias=False)
        self.fc2 = torch.nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


def _swapped_gradients(rank: int) -> None:
    """A hand-written gradient sync: two [8,8] gradients reduced in swapped order, one line."""
    model = TwoLayers()
    model(torch.ones(2, 8)).sum().backward()
    order = [model.fc1, model.fc2] if rank == 0 else [model.fc2, model.fc1]
    for layer in order:
        dist.all_reduce(layer.weight.grad)


def _swapped_parameters_before_forward(rank: int) -> None:
    """A parameter broadcast at initialisation (no forward yet): the module is named by the user."""
    model = TwoLayers()
    name_tensor(model, "model")
    order = [model.fc1, model.fc2] if rank == 0 else [model.fc2, model.fc1]
    for layer in order:
        dist.broadcast(layer.weight.data, src=0)


def _swapped_bare_tensors(rank: int) -> None:
    """Two bare metric tensors reduced in swapped order, from different lines."""
    loss_sum, correct = torch.ones(8, 8), torch.ones(8, 8)
    if rank == 0:
        dist.all_reduce(loss_sum)
        dist.all_reduce(correct)
    else:
        dist.all_reduce(correct)
        dist.all_reduce(loss_sum)


def _swapped_named_tensors(rank: int) -> None:
    """Bare tensors reduced in swapped order from one line: only the user's names tell them apart."""
    loss_sum, correct = torch.ones(8, 8), torch.ones(8, 8)
    name_tensor(loss_sum, "metrics/loss_sum")
    name_tensor(correct, "metrics/correct")
    for tensor in [loss_sum, correct] if rank == 0 else [correct, loss_sum]:
        dist.all_reduce(tensor)


def _different_reductions(rank: int) -> None:
    dist.all_reduce(torch.ones(4), op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)


def _asymmetric_region(rank: int) -> None:
    """Rank-conditional code that legitimately issues the same collective from different lines."""
    total = torch.ones(8, 8)
    with asymmetric():
        if rank == 0:
            dist.all_reduce(total)
        else:
            dist.all_reduce(total)


def _agreeing_gradient_sync(rank: int) -> None:
    model = TwoLayers()
    model(torch.ones(2, 8)).sum().backward()
    for layer in [model.fc1, model.fc2]:
        dist.all_reduce(layer.weight.grad)
    dist.broadcast(model.fc1.weight.data[0], src=0)  # a view of a parameter


def _fsdp2_units_called_one_by_one(rank: int) -> None:
    """Two same-size FSDP2 units called one by one (no container forward), in swapped order: only
    the container registered with name_tensor gives them names that differ."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(8, 8), "b": torch.nn.Linear(8, 8)})
    for layer in model.values():
        fully_shard(layer)
    name_tensor(model)
    x = torch.ones(2, 8)
    for name in ["a", "b"] if rank == 0 else ["b", "a"]:
        x = model[name](x)
    x.sum().backward()


SCENARIOS = {
    "swapped_gradients": _swapped_gradients,
    "swapped_parameters_before_forward": _swapped_parameters_before_forward,
    "swapped_bare_tensors": _swapped_bare_tensors,
    "swapped_named_tensors": _swapped_named_tensors,
    "different_reductions": _different_reductions,
    "asymmetric_region": _asymmetric_region,
    "agreeing_gradient_sync": _agreeing_gradient_sync,
    "fsdp2_units_called_one_by_one": _fsdp2_units_called_one_by_one,
}


# fully_shard runs on CPU only where the torch FSDP2 adapter declares it (conformance.suite.gate).
FSDP2_CANNOT_RUN = gate.unsupported(TorchFSDP2Adapter, "cpu", torch.__version__)
RUNNABLE = {name: body for name, body in SCENARIOS.items() if "fsdp2" not in name or FSDP2_CANNOT_RUN is None}


def _run_scenarios(rank: int, world_size: int, out_dir: str) -> None:
    for name, body in RUNNABLE.items():
        tracing.begin_test(f"{out_dir}/{name}-{rank}.jsonl")
        body(rank)
        tracing.end_test()
        dist.barrier()


@pytest.fixture(scope="module")
def diffs(tmp_path_factory) -> dict[str, str | None]:
    """Each scenario's first divergence as text (None: the ranks agree), from one spawn."""
    directory = tmp_path_factory.mktemp("identity")
    spawn_ranks(_run_scenarios, directory)
    found = {}
    for name in RUNNABLE:
        traces = {rank: read_trace(str(directory / f"{name}-{rank}.jsonl")) for rank in (0, 1)}
        divergence = first_divergence(traces, [0, 1])
        found[name] = divergence.describe() if divergence else None
    return found


SITE = r"tests/harness_tests/test_divergence_identity.py:\d+"
EXPECTED = {
    "swapped_gradients": rf"collective #1 on group \[0, 1\] at {SITE}: rank 0 all_reduce 64 float32 "
    r"of fc1.weight.grad vs rank 1 all_reduce 64 float32 of fc2.weight.grad",
    "swapped_parameters_before_forward": r"collective #1 .*: rank 0 broadcast 64 float32 of "
    r"model.fc1.weight vs rank 1 broadcast 64 float32 of model.fc2.weight",
    "swapped_bare_tensors": rf"collective #1 on group \[0, 1\]: rank 0 all_reduce 64 float32 at {SITE} "
    rf"vs rank 1 all_reduce 64 float32 at {SITE}",
    "swapped_named_tensors": r"collective #1 .*: rank 0 all_reduce .* of metrics/loss_sum vs "
    r"rank 1 all_reduce .* of metrics/correct",
    "fsdp2_units_called_one_by_one": rf"collective #1 on group \[0, 1\] at {SITE}: "
    r"rank 0 all_gather_into_tensor \[a.weight, a.bias\] 36 float32 "
    r"vs rank 1 all_gather_into_tensor \[b.weight, b.bias\] 36 float32",
    "different_reductions": r"collective #1 .*: rank 0 all_reduce 4 float32 op=SUM "
    r"vs rank 1 all_reduce 4 float32 op=MAX",
}


@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_same_shape_mispairings_are_named(diffs, scenario):
    if scenario not in RUNNABLE:
        pytest.skip(reason=f"fully_shard on this torch: {FSDP2_CANNOT_RUN}")
    assert diffs[scenario] is not None, f"{scenario}: the ranks' traces agree"
    assert re.fullmatch(EXPECTED[scenario], diffs[scenario]), diffs[scenario]


def test_a_marked_asymmetric_region_and_agreeing_ranks_pass(diffs):
    assert diffs["asymmetric_region"] is None
    assert diffs["agreeing_gradient_sync"] is None


# ------------------------------------------------------------------- the trace never raises


def test_a_record_that_cannot_be_built_becomes_a_note_and_the_call_runs(tmp_path, capsys):
    """No process group exists here, so resolving the call's group raises inside the trace (as
    torch 2.6's DeviceMesh.get_group did inside DTensor): the call must run as if untraced."""
    calls = []

    def collective(tensor, op=None, group=None, async_op=False):
        calls.append(tensor)
        return "result"

    traced = tracing.wrap(collective, C10D_SPECS["all_reduce"])
    path = tmp_path / "tracing.jsonl"
    tracing.begin_test(str(path))
    try:
        assert traced(torch.ones(2)) == "result"
        assert traced(torch.ones(3)) == "result"
    finally:
        tracing.end_test()
    assert len(calls) == 2
    assert capsys.readouterr().err.count("[harness] all_reduce not recorded") == 1  # kept in the report
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 1, lines  # one note per kind of failure, not one per call
    assert re.match(r"all_reduce not recorded: \w+Error: .*the call ran untraced", lines[0]["note"]), lines
    notes: list[str] = []
    assert read_trace(str(path), notes) == [] and notes == [lines[0]["note"]]


def test_name_tensor_refuses_what_it_cannot_name():
    with pytest.raises(ValueError, match="needs a non-empty name"):
        name_tensor(torch.ones(1), "")
    with pytest.raises(TypeError, match="takes a tensor or a module"):
        name_tensor([1, 2], "list")  # type: ignore[arg-type]


# ------------------------------------------------------------------ call sites, fabricated diffs


def _issue_from_here() -> str:
    return call_sites.call_site(1)


def test_call_site_is_the_innermost_frame_outside_skipped_code():
    assert re.fullmatch(r"tests/harness_tests/test_divergence_identity.py:\d+", _issue_from_here())
    here = _issue_from_here()
    skip_call_sites_in("test_divergence_identity")  # this module: now its caller's line (pytest's)
    try:
        assert _issue_from_here() != here and "test_divergence_identity" not in _issue_from_here()
    finally:
        call_sites._skipped_dirs.pop()
        call_sites._code_files.clear()
    with pytest.raises(ValueError, match="nothing importable by that name"):
        skip_call_sites_in("no_such_package_anywhere")


def _record(rank: int, **fields) -> CollectiveRecord:
    base = {"index": 0, "seq": 0, "op": "all_reduce", "group": (0, 1), "shapes": ((8, 8),)}
    base.update(dtypes=("float32",), numel=64, label="", site="train.py:10")
    base.update(fields)
    return CollectiveRecord(rank=rank, **base)


def test_a_tensor_one_rank_could_not_name_is_no_evidence_but_two_names_are():
    unnamed = {0: [_record(0, tensors=("fc1.weight",))], 1: [_record(1)]}
    assert first_divergence(unnamed, [0, 1]) is None
    swapped = {0: [_record(0, tensors=("fc1.weight",))], 1: [_record(1, tensors=("fc2.weight",))]}
    assert first_divergence(swapped, [0, 1]) is not None
    other_line = {0: [_record(0)], 1: [_record(1, site="train.py:12")]}
    assert first_divergence(other_line, [0, 1]) is not None
    marked = {0: [_record(0, asymmetric=True)], 1: [_record(1, site="train.py:12", asymmetric=True)]}
    assert first_divergence(marked, [0, 1]) is None
    other_root = {0: [_record(0, asymmetric=True, args=(("root", "0"),))], 1: [_record(1, args=(("root", "1"),))]}
    assert "root=0 vs rank 1" in first_divergence(other_root, [0, 1]).describe()
