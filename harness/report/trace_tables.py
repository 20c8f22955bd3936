"""The built-in report of collective traces: `reports/traces/<test>.txt` for every distributed
test whose ranks failed or diverged (expected or not), with every rank's trace side by side.

A report plugin like `harness.report.junit.JUnitReport` (registered by `harness.plugin`): it writes
each file as the test is published, so a session that dies later keeps the traces of the tests
before.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

from harness.report.results import DistributedTestResult
from harness.trace.divergence import format_trace_table


def trace_file_name(nodeid: str) -> str:
    """`tests/test_x.py::test_y[p]` -> `tests_test_x.py_test_y_p.txt`."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_") + ".txt"


class TraceFiles:
    """Writes the trace file of each test that needs one; lists the directory among the reports."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.written: dict[str, str] = {}
        """node id -> the trace file written for it in this session."""

    def pytest_harness_test_result(self, result: DistributedTestResult) -> None:
        # A failure reported as expected (xfail, an expected-failure entry) is still a failure to read.
        if not result.traces or not (result.divergence or result.outcome in ("failed", "xfailed")):
            return
        header = f"first divergence: {result.divergence}" if result.divergence else "no divergence between ranks"
        path = os.path.join(self.directory, trace_file_name(result.nodeid))
        try:
            os.makedirs(self.directory, exist_ok=True)
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(f"{result.nodeid}\n{header}\n\n{format_trace_table(dict(result.traces))}\n")
        except (
            OSError
        ) as error:  # checked at session start (harness.config.preflight); the verdict must survive a later loss
            sys.stdout.write(
                f"harness: could not write the collective traces to {self.directory} ({error}); the verdict stands\n"
            )
            return
        self.written[result.nodeid] = path

    def pytest_harness_write_reports(self) -> list[str]:
        return [self.directory] if self.written else []


def written_trace_file(config: pytest.Config, nodeid: str) -> str | None:
    """The trace file this session's `TraceFiles` wrote for `nodeid`, None when it wrote none (the
    test passed with agreeing traces, ran no ranks, or the file could not be written)."""
    for plugin in config.pluginmanager.get_plugins():
        if isinstance(plugin, TraceFiles):
            return plugin.written.get(nodeid)
    return None
