"""The built-in report: per-rank JUnit XML files, written by the parent from what each rank reported.

One file per rank (`rank-<r>.xml`), one <testsuite> per suite key (world size, device and the
properties other plugins supply, e.g. the conformance backend) so that the run's properties sit
where every JUnit consumer (Jenkins, GitLab, GitHub reporters) reads them.

Every distributed test pytest reports is in every rank's file with pytest's verdict (a CI that
reads only one rank's file sees the run's outcome); the message and text say what that rank
itself did: its own failure, "failed on another rank (this rank: passed)", or how it was lost.
That reconciliation is the harness's (`harness.report.results.rank_cases`): this module only writes
each rank's `RankCase` as JUnit XML.

The directory is shared across sessions:
  * a session that ran tests removes the `rank-*.xml` files it found at its start and did not
    rewrite (a world-size-4 run followed by a world-size-2 run must not leave rank-3.xml behind);
  * sessions running at the same time in one directory do not overwrite each other: the first
    holds the directory's lock and writes `rank-<r>.xml`; any other writes
    `rank-<r>.<session id>.xml` and says so in its summary.
Under torchrun every pytest process is one rank and writes only its own file, so the lock and
the clean-up are per rank (`rank-<r>.lock`); rank 0 also removes the files of ranks beyond the
world size.

`JUnitReport` is a pytest plugin object (registered by `harness.plugin`, like pytest's own
junitxml plugin) implementing the report hooks of `harness.hookspecs`.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import re
import socket
import uuid
import xml.etree.ElementTree as ET
from collections import defaultdict
from datetime import UTC, datetime
from typing import IO, Any

import pytest

from harness.config.torchrun import TorchrunWorld
from harness.message_text import clip
from harness.report.results import DistributedTestResult, RankCase, SuiteKey

_ILLEGAL_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")
_MAX_TEXT = 512 * 1024  # characters per element; captured output arrives already cut (harness.message_text)
_LOCK = ".session.lock"


def _clean(text: str) -> str:
    return clip(_ILLEGAL_XML.sub("\N{REPLACEMENT CHARACTER}", text), _MAX_TEXT)


def _attribute(text: str) -> str:
    """A one-line message attribute: its start is what a CI shows."""
    return _ILLEGAL_XML.sub("\N{REPLACEMENT CHARACTER}", text[:1000])


def junit_classname(nodeid: str) -> str:
    """`tests/test_x.py::TestY::test_z[p]` -> `tests.test_x.TestY`, as pytest's junitxml names it."""
    path, _, rest = nodeid.partition("::")
    classname = path.removesuffix(".py").replace("/", ".")
    if "::" in rest:
        classname += "." + rest.rsplit("::", 1)[0].replace("::", ".")
    return classname


class _SharedDirectory:
    """This session's claim on a JUnit directory that other sessions may use at the same time.

    `torchrun`: the torchrun world this process is one rank of, if any: it claims only that rank's
    file, since the other ranks' processes write theirs into the same directory.
    """

    def __init__(self, directory: str, torchrun: TorchrunWorld | None = None) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        lock = _LOCK if torchrun is None else f".rank-{torchrun.rank}.lock"
        self._lock: IO[str] | None = open(os.path.join(directory, lock), "a+")  # noqa: SIM115 - held for the session
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.seek(0)
            self.holder = self._lock.read().strip() or "another pytest session"
            self._lock.close()
            self._lock = None
            self.suffix = f".{uuid.uuid4().hex[:8]}"
        else:
            self._lock.truncate(0)
            self._lock.write(f"pytest session pid {os.getpid()}\n")
            self._lock.flush()
            self.holder = ""
            self.suffix = ""
        # What earlier sessions left; only the lock holder removes (what it does not rewrite).
        self.found_at_start = set(self._claimed(torchrun)) if self.owner else set()

    def _claimed(self, torchrun: TorchrunWorld | None) -> list[str]:
        """The files of earlier sessions this one answers for."""
        found = glob.glob(os.path.join(self.directory, "rank-*.xml"))
        if torchrun is None:
            return found
        rank, world_size = torchrun.rank, torchrun.world_size

        def file_rank(path: str) -> int | None:
            number = os.path.basename(path).removeprefix("rank-").partition(".")[0]
            return int(number) if number.isdigit() else None

        return [
            path for path in found if file_rank(path) == rank or (rank == 0 and (file_rank(path) or 0) >= world_size)
        ]

    @property
    def owner(self) -> bool:
        return self._lock is not None

    def path(self, rank: int) -> str:
        return os.path.join(self.directory, f"rank-{rank}{self.suffix}.xml")

    def remove_stale(self, written: list[str]) -> list[str]:
        stale = sorted(self.found_at_start - set(written))
        for path in stale:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        self.found_at_start.clear()
        return stale

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None


class JUnitReport:
    """Collects every rank's cases during the session; writes `rank-<r>.xml` files at its end."""

    def __init__(
        self, directory: str, session_properties: dict[str, str], torchrun: TorchrunWorld | None = None
    ) -> None:
        self.directory = directory
        self.session_properties = session_properties
        # rank -> suite -> [(classname, name, result)], in the order tests ran
        self._ranks: dict[int, dict[SuiteKey, list[tuple[str, str, DistributedTestResult]]]] = defaultdict(
            lambda: defaultdict(list)
        )
        self._started = datetime.now(UTC).replace(microsecond=0).isoformat()
        self._shared = _SharedDirectory(directory, torchrun)
        self._ran_tests = False
        self.removed: list[str] = []

    # -- hook implementations ------------------------------------------------------------
    def pytest_runtest_logstart(self) -> None:
        self._ran_tests = True

    def pytest_harness_test_result(self, result: DistributedTestResult) -> None:
        classname = junit_classname(result.nodeid)
        for rank in result.own_ranks:
            self._ranks[rank][result.suite].append((classname, result.name, result))

    def pytest_harness_write_reports(self) -> list[str]:
        return self.write()

    @pytest.hookimpl(trylast=True)  # after harness.plugin's summary, which has the reports written
    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self._shared.owner and self._ranks:
            terminalreporter.write_line(
                f"harness: {self.directory} is in use by {self._shared.holder} at the same time; this session's "
                f"per-rank files are rank-<r>{self._shared.suffix}.xml (pass --reports-dir to keep runs apart)"
            )
        if self.removed:
            names = ", ".join(os.path.basename(path) for path in self.removed)
            terminalreporter.write_line(f"harness: removed per-rank files of an earlier run: {names}")

    def release(self) -> None:
        """The session is over: another may own the directory now."""
        self._shared.release()

    # -- writing -------------------------------------------------------------------------
    def write(self) -> list[str]:
        """Write every rank's file (atomically: a reader never sees half a file); return the paths."""
        os.makedirs(self.directory, exist_ok=True)
        written = []
        for rank, suites in sorted(self._ranks.items()):
            path = self._shared.path(rank)
            tree = ET.ElementTree(self._rank_element(rank, suites))
            ET.indent(tree)
            temporary = f"{path}.{os.getpid()}.tmp"  # another session may be writing this report too
            tree.write(temporary, encoding="utf-8", xml_declaration=True)
            os.replace(temporary, path)
            written.append(path)
        if self._shared.owner and self._ran_tests:
            self.removed = self._shared.remove_stale(written)
        return written

    def _rank_element(
        self, rank: int, suites: dict[SuiteKey, list[tuple[str, str, DistributedTestResult]]]
    ) -> ET.Element:
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
        self, index: int, rank: int, key: SuiteKey, entries: list[tuple[str, str, DistributedTestResult]]
    ) -> ET.Element:
        outcomes = [result.outcome for _, _, result in entries]
        cases = [result.cases[rank] for _, _, result in entries]
        prefix = "-".join(value for _, value in key.properties) or "harness"
        suite = ET.Element(
            "testsuite",
            {
                "name": _attribute(f"{prefix}-ws{key.world_size}-{key.device}-rank{rank}"),
                "tests": str(len(entries)),
                "failures": str(outcomes.count("failed")),
                "errors": "0",
                "skipped": str(outcomes.count("skipped") + outcomes.count("xfailed")),
                "time": f"{sum(case.time_s for case in cases):.3f}",
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
            ET.SubElement(properties, "property", name=_attribute(name), value=_attribute(value))
        for (classname, name, _), case in zip(entries, cases):
            suite.append(_case_element(classname, name, case))
        return suite


def _case_element(classname: str, name: str, case: RankCase) -> ET.Element:
    element = ET.Element("testcase", classname=_attribute(classname), name=_attribute(name), time=f"{case.time_s:.3f}")
    if case.status == "failed":
        failure = ET.SubElement(element, "failure", message=_attribute(case.message))
        failure.text = _clean(case.text)
    elif case.status in ("skipped", "xfailed"):
        prefix = "expected failure: " if case.status == "xfailed" else ""
        skipped = ET.SubElement(element, "skipped", message=_attribute(prefix + case.message))
        if case.status == "xfailed" and case.text:
            skipped.text = _clean(case.text)  # what the expected failure was, on this rank
    if case.stdout:
        ET.SubElement(element, "system-out").text = _clean(case.stdout)
    if case.stderr:
        ET.SubElement(element, "system-err").text = _clean(case.stderr)
    return element
