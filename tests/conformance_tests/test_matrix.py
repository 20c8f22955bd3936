"""The conformance matrix counts every outcome in its cell and links failures to their text."""

from __future__ import annotations

from conformance.report.html import render_html
from conformance.report.matrix import Matrix, classify, render_markdown


def test_outcomes_are_classified() -> None:
    assert classify("passed", None, "") == "pass"
    assert classify("failed", None, "") == "fail"
    assert classify("skipped", "expected-fail: known bug", "") == "expected-fail"
    assert classify("skipped", None, "unsupported: exec order: none") == "unsupported"
    assert classify("skipped", None, "needs 4 GPUs, found 0") == "skip"


def test_matrix_renders_counts_and_failure_links() -> None:
    matrix = Matrix()
    matrix.record("test_runtime.py::test_training", "reference", "t[reference-a]", "pass", "")
    matrix.record(
        "test_runtime.py::test_training",
        "torch-fsdp2",
        "t[torch-fsdp2-a]",
        "fail",
        "boom",
        repro="REPRO: cd /x && python -m pytest t --backend torch-fsdp2",
    )
    matrix.record(
        "test_exec_order.py::test_first",
        "torch-fsdp2",
        "e[torch-fsdp2]",
        "unsupported",
        "unsupported: execution order validation: FSDP2 has none",
    )
    markdown = render_markdown(matrix)
    assert "| `test_runtime.py::test_training` | 1 pass | **1 fail** |" in markdown
    assert "| **total** | 1 pass | 1 fail / 1 unsupported |" in markdown
    assert "REPRO: cd /x && python -m pytest t --backend torch-fsdp2" in markdown
    assert "| torch-fsdp2 | unsupported: execution order validation: FSDP2 has none | 1 |" in markdown
    page = render_html(matrix)
    assert '<a href="#fail-torch-fsdp2-test-runtime-py-test-training">' in page
    assert '<div class="counts">1 fail</div>' in page
    assert 'id="fail-torch-fsdp2-test-runtime-py-test-training"' in page
    # The REPRO line, data of its own, is shown above the failure text and last in it, as pytest printed it.
    assert '<pre class="repro">REPRO: cd /x &amp;&amp; python -m pytest t --backend torch-fsdp2</pre>' in page
    assert "<pre>boom\nREPRO: cd /x &amp;&amp; python -m pytest t --backend torch-fsdp2</pre>" in page
