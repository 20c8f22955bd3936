"""A conformance matrix as a run would leave it, with a failure's traces as the harness hands them
over and its trace file as the harness writes it, for the report tests (test_report_html.py
in-process, test_report_browser.py in Chromium)."""

from __future__ import annotations

from pathlib import Path

from conformance.report.matrix import Matrix, RunDetails
from conformance.report.trace_view import TraceView
from harness.report.trace_tables import trace_file_name
from harness.trace.divergence import first_divergence, format_trace_table
from harness.trace.records import CollectiveRecord

LONG_LABEL = "layers.0.attention.q_proj.weight, " * 10 + "layers.0.mlp.weight"
FAILED_ID = "conformance/test_divergence.py::test_same_shape_divergence_is_not_silent[torch-fsdp2-ws2]"
SCENARIO = "test_divergence.py::test_same_shape_divergence_is_not_silent"
REPRO = f"REPRO: cd /x && python -m pytest '{FAILED_ID}' --backend torch-fsdp2"


def _record(rank: int, index: int, label: str, **fields: object) -> CollectiveRecord:
    values: dict = {
        "rank": rank,
        "index": index,
        "seq": index,
        "op": "all_gather_into_tensor",
        "group": (0, 1),
        "shapes": ((36,),),
        "dtypes": ("float32",),
        "numel": 36,
        "label": label,
        "completed": True,
        "site": "conformance/test_divergence.py:60",
    }
    values.update(fields)
    return CollectiveRecord(**values)  # type: ignore[arg-type]


def diverging_traces() -> dict[int, list[CollectiveRecord]]:
    """Rank 0 gathers `first` where rank 1 gathers `second` (collective #3); every column the
    table has is used, with a label of 300+ characters."""
    shared = [
        _record(0, 0, LONG_LABEL, args=(("op", "SUM"),), async_op=True, tensors=("stem.weight", "")),
        _record(0, 1, "stem.bias", op="broadcast", args=(("root", "0"),)),
    ]
    rank0 = [*shared, _record(0, 2, "first.weight"), _record(0, 3, "second.weight", completed=False)]
    rank1 = [
        *[_record(1, r.index, r.label, op=r.op, args=r.args, async_op=r.async_op, tensors=r.tensors) for r in shared],
        _record(1, 2, "second.weight", asymmetric=True),
        _record(1, 3, "", op="all_reduce", skipped=True, fault="skip all_reduce on rank 1"),
    ]
    return {0: rank0, 1: rank1}


def trace_view(nodeid: str, traces: dict[int, list[CollectiveRecord]]) -> TraceView:
    """The traces of a failed test and their first divergence, as the harness's result carries them
    (`DistributedTestResult.traces`, `.divergence`, `.diverged_at`)."""
    divergence = first_divergence(traces, sorted(traces))
    if divergence is None:
        return TraceView(nodeid, traces)
    return TraceView(nodeid, traces, divergence.describe(), divergence.positions())


def write_trace_file(directory: Path, nodeid: str, traces: dict[int, list[CollectiveRecord]]) -> Path:
    """A trace file as the harness writes one (`harness.report.trace_tables.TraceFiles`): the page links to it."""
    divergence = first_divergence(traces, sorted(traces))
    header = f"first divergence: {divergence.describe()}" if divergence else "no divergence between ranks"
    path = directory / trace_file_name(nodeid)
    path.write_text(f"{nodeid}\n{header}\n\n{format_trace_table(traces)}\n", encoding="utf-8")
    return path


def sample_matrix(tmp_path: Path, trace: dict | None = None) -> Matrix:
    """Cells of every kind, one divergence failure (with its traces, and its trace file in
    `tmp_path`, when `trace` is given)."""
    matrix = Matrix(
        run=RunDetails(
            command="cd /x && python -m pytest conformance --backend reference --backend torch-fsdp2",
            date="2026-11-25 17:00:00 UTC",
            seed="1234",
            torch_version="2.13.0+cpu",
            python_version="3.11.7",
            backends={"reference": "built-in reference", "torch-fsdp2": "built-in torch_fsdp2"},
        )
    )
    for index in range(2):
        matrix.record(
            "test_runtime.py::test_training", "reference", f"r{index}", "pass", "", device="cpu", world_size=2
        )
        matrix.record("test_runtime.py::test_training", "torch-fsdp2", f"f{index}", "pass", "", world_size=4)
        matrix.record(
            "test_runtime.py::test_training",
            "torch-fsdp2",
            f"u{index}",
            "unsupported",
            "unsupported: HYBRID_SHARD: no replica groups",
        )
    matrix.record(
        "test_exec_order.py::test_first",
        "torch-fsdp2",
        "x0",
        "expected-fail",
        "t",
        reason="no order check",
        link="https://example.org/1",
    )
    matrix.record(
        SCENARIO,
        "torch-fsdp2",
        FAILED_ID,
        "fail",
        "boom",
        reason="ranks issued divergent collectives",
        repro=REPRO,
        trace=trace_view(FAILED_ID, trace) if trace is not None else None,
    )
    matrix.record(SCENARIO, "reference", "ok", "pass", "")
    if trace is not None:
        matrix.traces[FAILED_ID] = str(write_trace_file(tmp_path, FAILED_ID, trace))
    return matrix
