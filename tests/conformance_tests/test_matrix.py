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


def test_a_run_on_several_devices_names_each_verdicts_device() -> None:
    """Under --device auto a GPU runner runs a scenario on CUDA at one world size and on CPU at
    another: each cell counts by device, and each failure and expected failure names its own."""
    matrix = Matrix()
    scenario = "test_runtime.py::test_training"
    matrix.record(scenario, "reference", "t[ws1-reference]", "pass", "", device="cuda", world_size=1)
    matrix.record(scenario, "reference", "t[ws2-reference]", "pass", "", device="cpu", world_size=2)
    matrix.record(scenario, "reference", "t[ws4-reference]", "fail", "boom", device="cpu", world_size=4)
    matrix.record(scenario, "deepspeed", "t[ws2-deepspeed]", "expected-fail", "", reason="known", device="cpu")
    markdown = render_markdown(matrix)
    assert f"| `{scenario}` | **cpu: 1 pass / 1 fail; cuda: 1 pass** | cpu: 1 expected-fail |" in markdown
    assert "- `t[ws4-reference]` (on cpu): boom" in markdown
    page = render_html(matrix)
    assert '<div class="counts">cpu: 1 pass / 1 fail; cuda: 1 pass</div>' in page
    assert "<h4>t[ws4-reference] (on cpu)</h4>" in page
    assert "<code>t[ws2-deepspeed]</code> (on cpu)</td>" in page
    # One device: the header names it, the cells stay as they were.
    single = Matrix()
    single.record(scenario, "reference", "t[ws2-reference]", "fail", "boom", device="cpu", world_size=2)
    assert f"| `{scenario}` | **1 fail** |" in render_markdown(single)
    assert "- `t[ws2-reference]`: boom" in render_markdown(single)
