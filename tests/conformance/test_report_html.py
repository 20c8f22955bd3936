"""The HTML report and what it reads: the harness's trace files, parsed back exactly; a page with
a legend, split cells, run details, expected failures, unsupported capabilities, failures with
their REPRO line, trace link and divergence timeline; incomplete runs marked (in-process)."""

from __future__ import annotations

import re
from pathlib import Path

from conformance.report.html import render_html
from conformance.report.matrix import render_markdown
from conformance.report.trace_view import read_trace_report
from harness.trace.divergence import first_divergence
from tests.conformance.report_samples import (
    FAILED_ID,
    LONG_LABEL,
    REPRO,
    SCENARIO,
    diverging_traces,
    sample_matrix,
    write_trace_file,
)


def test_trace_reports_read_back_every_cell(tmp_path: Path) -> None:
    traces = diverging_traces()
    report = read_trace_report(str(write_trace_file(tmp_path, FAILED_ID, traces)))
    assert report.nodeid == FAILED_ID and report.heading.startswith("first divergence: collective #3 on group [0, 1]")
    assert sorted(report.ranks) == [0, 1] and [len(rows) for rows in report.ranks.values()] == [4, 4]
    first = report.ranks[0][0].cells
    assert first["label"] == LONG_LABEL and len(first["label"]) > 300
    assert first["args"] == "op=SUM async" and first["tensors"] == "stem.weight,?" and first["status"] == "done"
    assert report.ranks[0][3].status == "NOT RETURNED"
    assert report.ranks[1][2].cells["site"] == "conformance/test_divergence.py:60 (asymmetric)"
    assert report.ranks[1][3].skipped and "fault: skip all_reduce on rank 1" in report.ranks[1][3].status
    # The marks are the records the harness's own diff names (numbers from 1).
    divergence = first_divergence(traces, [0, 1])
    assert divergence is not None
    assert report.first_divergence() == {rank: record.index + 1 for rank, record in divergence.issued.items()}


def test_a_rank_that_stopped_is_marked_after_its_last_collective(tmp_path: Path) -> None:
    traces = diverging_traces()
    traces[1] = traces[1][:2]  # rank 1 issued nothing after the broadcast
    report = read_trace_report(str(write_trace_file(tmp_path, FAILED_ID, traces)))
    assert report.first_divergence() == {0: 3, 1: None}
    assert "stopped before the first divergence" in render_html(sample_matrix(tmp_path, trace=traces))


def test_the_page_shows_what_the_run_was_and_why(tmp_path: Path) -> None:
    (tmp_path / "traces").mkdir()
    matrix = sample_matrix(tmp_path / "traces", trace=diverging_traces())
    page = render_html(matrix, str(tmp_path))
    # A legend, and a cell split by outcome: 2 pass and 2 unsupported are two equal segments.
    assert 'id="legend"' in page and "<b>unsupported</b>" in page and "<b>not run</b>" in page
    cell = re.search(r"<td title=\"2 pass / 2 unsupported\">(.*?)</td>", page)
    assert cell is not None, page
    assert 'class="seg-pass" style="flex:2' in cell.group(1) and 'class="seg-unsupported" style="flex:2' in cell.group(
        1
    )
    # Run details.
    for text in ("2026-11-25 17:00:00 UTC", "--backend torch-fsdp2", "2.13.0+cpu", "1234", "<td>2, 4</td>"):
        assert text in page, text
    # Expected failure with its reason and link; the unsupported table.
    assert "no order check" in page and '<a href="https://example.org/1">' in page
    assert "<h2 id='unsupported'>Unsupported capabilities</h2>" in page
    assert '<td class="name">torch-fsdp2</td><td>unsupported: HYBRID_SHARD: no replica groups</td><td>2</td>' in page
    # The failed cell links to its section; the failure has its reason, REPRO line, trace link, timeline.
    target = re.search(r'<td class="cellfail"[^>]*><a href="#([^"]+)">', page)
    assert target is not None and f'id="{target.group(1)}"' in page
    assert '<p class="reason">ranks issued divergent collectives</p>' in page
    assert f'<pre class="repro">{REPRO.replace("&", "&amp;").replace(chr(39), "&#x27;")}</pre>' in page
    assert 'href="traces/conformance_test_divergence.py_test_same_shape' in page
    svg = re.search(r"<svg .*?</svg>", page)
    assert svg is not None and svg.group(0).count('class="divergence"') == 2
    assert '<tr class="diverged">' in page  # the readable per-rank table marks the same row
    assert "http" not in page.replace("https://example.org/1", "").replace("http://www.w3.org/2000/svg", "")


def test_an_incomplete_run_says_so_and_counts_what_did_not_run(tmp_path: Path) -> None:
    matrix = sample_matrix(tmp_path)
    for _ in range(3):
        matrix.plan(SCENARIO, "reference")  # 3 selected, 1 reported
    matrix.incomplete = "interrupted (Ctrl-C) with 9 of 11 tests finished"
    page = render_html(matrix)
    assert 'class="banner" id="incomplete">INCOMPLETE: interrupted (Ctrl-C) with 9 of 11 tests finished' in page
    assert "1 pass / 2 not run" in page and 'class="seg-not-run"' in page
    markdown = render_markdown(matrix)
    assert "**INCOMPLETE: interrupted (Ctrl-C) with 9 of 11 tests finished**" in markdown
    assert (
        "| `test_divergence.py::test_same_shape_divergence_is_not_silent` | 1 pass / 2 not run | **1 fail** |"
        in markdown
    )
