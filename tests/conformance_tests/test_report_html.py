"""The HTML report and what it shows: the harness's trace records in the harness's own columns,
the first divergence where the harness found it; a page with a legend, split cells, run details,
expected failures, unsupported capabilities, failures with their REPRO line, trace link and
divergence timeline; incomplete runs marked (in-process)."""

from __future__ import annotations

import re
from html import escape
from pathlib import Path

from conformance.report.html import SHOWN_COLUMNS, render_html
from conformance.report.matrix import render_markdown
from conformance.report.trace_view import describe
from harness.trace.divergence import TRACE_COLUMNS, first_divergence, format_trace_table
from tests.conformance_tests.report_samples import (
    LONG_LABEL,
    REPRO,
    SCENARIO,
    diverging_traces,
    sample_matrix,
)


def _trace_tables(page: str) -> dict[int, list[list[str]]]:
    """rank -> the rows (cell texts, unescaped) of its readable trace table on the page."""
    tables = {}
    for rank, table in re.findall(r"<summary>rank (\d+): \d+ collectives</summary>(.*?)</table>", page):
        rows = re.findall(r"<tr(?: class=\"diverged\")?>(.*?)</tr>", table)
        tables[int(rank)] = [
            [
                cell.replace("&gt;", ">").replace("&lt;", "<").replace("&amp;", "&")
                for cell in re.findall(r"<t[dh]>(.*?)</t[dh]>", row)
            ]
            for row in rows
        ]
    return tables


def test_the_trace_tables_have_the_harness_columns_and_every_cell(tmp_path: Path) -> None:
    traces = diverging_traces()
    page = render_html(sample_matrix(tmp_path, trace=traces))
    # One definition of the columns: the text table's header, and the page's shown columns among them.
    names = [column.name for column in TRACE_COLUMNS]
    assert re.split(r"\s{2,}", format_trace_table(traces).splitlines()[1].strip()) == names
    assert set(SHOWN_COLUMNS) <= set(names)
    tables = _trace_tables(page)
    assert sorted(tables) == [0, 1] and [len(rows) for rows in tables.values()] == [5, 5]  # a header and 4 rows
    assert tables[0][0] == list(SHOWN_COLUMNS)
    first = dict(zip(SHOWN_COLUMNS, tables[0][1]))
    assert first["label"] == LONG_LABEL and len(first["label"]) > 300
    assert first["tensors"] == "stem.weight,?" and first["status"] == "done" and first["#"] == "1"
    assert dict(zip(SHOWN_COLUMNS, tables[0][4]))["status"] == "NOT COMPLETED"
    assert dict(zip(SHOWN_COLUMNS, tables[1][3]))["site"] == "conformance/test_divergence.py:60 (asymmetric)"
    assert dict(zip(SHOWN_COLUMNS, tables[1][4]))["status"] == "skipped (fault: skip all_reduce on rank 1)"
    # The tooltip names every cell that says something, in the harness's words.
    assert describe(0, traces[0][0]) == (
        f"rank 0 #1 all_gather_into_tensor [{LONG_LABEL}] numel 36 dtypes float32 shapes [36] args op=SUM async "
        "tensors stem.weight,? site conformance/test_divergence.py:60 done"
    )
    assert f"<title>{escape(describe(1, traces[1][3]))}</title>" in page
    # The marked rows are the records the harness's own diff names.
    divergence = first_divergence(traces, [0, 1])
    assert divergence is not None and divergence.positions() == {0: 2, 1: 2}
    assert page.count('<tr class="diverged">') == 2
    assert "<p>first divergence: collective #3 on group [0, 1]" in page


def test_a_rank_that_stopped_is_marked_after_its_last_collective(tmp_path: Path) -> None:
    traces = diverging_traces()
    traces[1] = traces[1][:2]  # rank 1 issued nothing after the broadcast
    divergence = first_divergence(traces, [0, 1])
    assert divergence is not None and divergence.positions() == {0: 2, 1: None}
    page = render_html(sample_matrix(tmp_path, trace=traces))
    assert "stopped before the first divergence" in page and page.count('<tr class="diverged">') == 1


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
