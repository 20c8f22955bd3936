"""The built-in report: per-rank JUnit XML files, written by the parent from what each rank reported.

One file per rank (`rank-<r>.xml`), one <testsuite> per suite key (world size, device and the
properties other plugins supply, e.g. the conformance backend) so that the run's properties sit
where every JUnit consumer (Jenkins, GitLab, GitHub reporters) reads them. A rank that died still
gets its test case, with the cause as the failure.

`JUnitReport` is a pytest plugin object (registered by `harness.plugin`, like pytest's own
junitxml plugin) implementing the report hooks of `harness.hookspecs`.
"""

from __future__ import annotations

import os
import re
import socket
import xml.etree.ElementTree as ET
from collections import defaultdict
from datetime import UTC, datetime

from harness.reports import DistributedTestResult, RankCase, SuiteKey

_ILLEGAL_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")
_MAX_CAPTURE = 256 * 1024


def _clean(text: str) -> str:
    text = _ILLEGAL_XML.sub("\N{REPLACEMENT CHARACTER}", text)
    if len(text) > _MAX_CAPTURE:
        text = f"[... {len(text) - _MAX_CAPTURE} characters cut ...]\n" + text[-_MAX_CAPTURE:]
    return text


def junit_classname(nodeid: str) -> str:
    """`tests/test_x.py::TestY::test_z[p]` -> `tests.test_x.TestY`, as pytest's junitxml names it."""
    path, _, rest = nodeid.partition("::")
    classname = path.removesuffix(".py").replace("/", ".")
    if "::" in rest:
        classname += "." + rest.rsplit("::", 1)[0].replace("::", ".")
    return classname


class JUnitReport:
    """Collects every rank's cases during the session; writes `rank-<r>.xml` files at its end."""

    def __init__(self, directory: str, session_properties: dict[str, str]) -> None:
        self.directory = directory
        self.session_properties = session_properties
        # rank -> suite -> [(classname, name, case)], in the order tests ran
        self._ranks: dict[int, dict[SuiteKey, list[tuple[str, str, RankCase]]]] = defaultdict(lambda: defaultdict(list))
        self._started = datetime.now(UTC).replace(microsecond=0).isoformat()

    # -- hook implementations ------------------------------------------------------------
    def pytest_harness_test_result(self, result: DistributedTestResult) -> None:
        classname = junit_classname(result.nodeid)
        for rank in result.own_ranks:
            self._ranks[rank][result.suite].append((classname, result.name, result.cases[rank]))

    def pytest_harness_write_reports(self) -> list[str]:
        return self.write()

    # -- writing -------------------------------------------------------------------------
    def write(self) -> list[str]:
        """Write every rank's file (atomically: a reader never sees half a file); return the paths."""
        os.makedirs(self.directory, exist_ok=True)
        written = []
        for rank, suites in sorted(self._ranks.items()):
            path = os.path.join(self.directory, f"rank-{rank}.xml")
            tree = ET.ElementTree(self._rank_element(rank, suites))
            ET.indent(tree)
            temporary = f"{path}.{os.getpid()}.tmp"  # another session may be writing this report too
            tree.write(temporary, encoding="utf-8", xml_declaration=True)
            os.replace(temporary, path)
            written.append(path)
        return written

    def _rank_element(self, rank: int, suites: dict[SuiteKey, list[tuple[str, str, RankCase]]]) -> ET.Element:
        root = ET.Element("testsuites", name=f"rank {rank}")
        totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        total_time = 0.0
        for index, (key, cases) in enumerate(suites.items()):
            suite = self._suite_element(index, rank, key, cases)
            for counter in totals:
                totals[counter] += int(suite.get(counter, "0"))
            total_time += float(suite.get("time", "0"))
            root.append(suite)
        for counter, value in totals.items():
            root.set(counter, str(value))
        root.set("time", f"{total_time:.3f}")
        return root

    def _suite_element(
        self, index: int, rank: int, key: SuiteKey, cases: list[tuple[str, str, RankCase]]
    ) -> ET.Element:
        failures = sum(case.status == "failed" for _, _, case in cases)
        skipped = sum(case.status in ("skipped", "xfailed") for _, _, case in cases)
        prefix = "-".join(value for _, value in key.properties) or "harness"
        suite = ET.Element(
            "testsuite",
            {
                "name": f"{prefix}-ws{key.world_size}-{key.device}-rank{rank}",
                "tests": str(len(cases)),
                "failures": str(failures),
                "errors": "0",
                "skipped": str(skipped),
                "time": f"{sum(case.time_s for _, _, case in cases):.3f}",
                "timestamp": self._started,
                "hostname": socket.gethostname(),
                "id": str(index),
            },
        )
        properties = ET.SubElement(suite, "properties")
        values = dict(self.session_properties)
        values.update(rank=str(rank), world_size=str(key.world_size), device=key.device)
        values.update(key.properties)
        for name, value in values.items():
            ET.SubElement(properties, "property", name=name, value=value)
        for classname, name, case in cases:
            suite.append(_case_element(classname, name, case))
        return suite


def _case_element(classname: str, name: str, case: RankCase) -> ET.Element:
    element = ET.Element("testcase", classname=classname, name=name, time=f"{case.time_s:.3f}")
    if case.status == "failed":
        failure = ET.SubElement(element, "failure", message=_clean(case.message)[:1000])
        failure.text = _clean(case.text)
    elif case.status in ("skipped", "xfailed"):
        prefix = "expected failure: " if case.status == "xfailed" else ""
        ET.SubElement(element, "skipped", message=_clean(prefix + case.message)[:1000])
    if case.stdout:
        ET.SubElement(element, "system-out").text = _clean(case.stdout)
    if case.stderr:
        ET.SubElement(element, "system-err").text = _clean(case.stderr)
    return element
