"""The helpers several modules share instead of each writing its own (in-process, no ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import skip_reason, strip_path_components
from harness.message_text import group_text, ranks_text, shown_path


def _report(outcome: str, longrepr: object) -> pytest.TestReport:
    return pytest.TestReport("t.py::test", ("t.py", 1, "test"), {}, outcome, longrepr, "call")


def test_skip_reason_reads_pytest_skip_tuples_plugin_text_and_no_skip() -> None:
    assert skip_reason(_report("skipped", ("t.py", 3, "Skipped: unsupported: mixed precision"))) == (
        "unsupported: mixed precision"
    )
    # A plugin that replaced the longrepr with text: that text is the reason.
    assert skip_reason(_report("skipped", "Skipped: replaced by a plugin")) == "replaced by a plugin"
    assert skip_reason(_report("failed", "AssertionError")) == ""
    assert skip_reason(_report("passed", None)) == ""


def test_strip_path_components_drops_wrappers_and_empty_components() -> None:
    assert strip_path_components("_fsdp_wrapped_module.layer1._checkpoint_wrapped_module.weight") == "layer1.weight"
    assert strip_path_components("_orig_mod.net..0.bias") == "net.0.bias"
    # A declared set replaces the default one: torch's wrappers stay unless declared.
    assert strip_path_components("module._fsdp_wrapped_module.w", {"module"}) == "_fsdp_wrapped_module.w"
    assert strip_path_components("_fsdp_wrapped_module") == ""


def test_ranks_groups_and_paths_are_written_one_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert ranks_text([3]) == "rank 3"
    assert ranks_text([0, 2]) == "ranks 0, 2"
    assert group_text((0, 1)) == "[0, 1]"
    monkeypatch.chdir(tmp_path / "..")
    assert shown_path(str(tmp_path / "test_x.py")) == f"{tmp_path.name}/test_x.py"  # under the working directory
    monkeypatch.chdir(tmp_path)
    outside = str(tmp_path.parent / "elsewhere.py")
    assert shown_path(outside) == outside
