"""Helpers for the harness self-tests: run an inner pytest session and inspect what it left."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest
import xmlschema

from tests.support.warm_pytest import run_pytest

SCHEMA = xmlschema.XMLSchema(str(Path(__file__).with_name("junit.xsd")))
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Case:
    """One test case of a JUnit file, as a CI reads it."""

    status: str  # passed, failed, skipped or xfailed ("expected failure: " skips)
    message: str
    text: str
    stdout: str
    stderr: str
    time_s: float


# Source text for inner test modules (needs torch, nn, dist imported): two layers whose forward
# all-reduces its own weight, so the collective's label is that layer's FQN, and a model that runs
# them in the order a test asks; the same-shape swap passes every torch check.
SYNCING_LAYERS = """
class Syncing(nn.Module):
    \"\"\"Forward all-reduces its own weight: the collective's label is this module's FQN.\"\"\"
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(36))
    def forward(self, x):
        dist.all_reduce(self.weight.data)
        return x

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = Syncing()
        self.layer2 = Syncing()
    def forward(self, x, order):
        for name in order:
            x = getattr(self, name)(x)
        return x
"""


def read_cases(path: Path) -> dict[str, Case]:
    """Test name -> its case, from a schema-valid JUnit file (ours or pytest's --junitxml)."""
    SCHEMA.validate(str(path))
    cases = {}
    for element in ET.parse(path).iter("testcase"):
        status, message, text = "passed", "", ""
        for kind in ("failure", "error", "skipped"):
            found = element.find(kind)
            if found is not None:
                message, text = found.get("message", ""), found.text or ""
                status = "failed" if kind != "skipped" else "skipped"
                if kind == "skipped" and message.startswith("expected failure: "):
                    status, message = "xfailed", message.removeprefix("expected failure: ")
        cases[element.get("name", "")] = Case(
            status,
            message,
            text,
            element.findtext("system-out") or "",
            element.findtext("system-err") or "",
            float(element.get("time", "0")),
        )
    return cases


def wait_for_no_leftovers(marker: str, timeout_s: float = 10.0) -> list[int]:
    """Leftover processes once `timeout_s` has passed without them all gone (a killed session's
    reaper needs a moment)."""
    deadline = time.monotonic() + timeout_s
    while (found := leftover_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def still_running(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    """Those of `pids` still running once `timeout_s` has passed without them all ended. A process
    sent SIGKILL is not gone at once: its exit unmaps its memory first (a rank's fork shares the
    rank's mappings, hundreds of megabytes with a CUDA torch build), and /proc shows it running,
    with SIGKILL pending and no environment left, until it has."""
    deadline = time.monotonic() + timeout_s
    while (alive := [pid for pid in pids if running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def running(pid: int) -> bool:
    """Whether a process exists and is not a zombie (a killed orphan waits for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def leftover_processes(marker: str) -> list[int]:
    """PIDs whose environment carries `marker`: ranks an inner session failed to clean up."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if marker.encode() in handle.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


class InnerSession:
    """Runs pytest in a subprocess on a scratch directory, tagged so its ranks can be found."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.marker = f"HARNESS_SELFTEST_{uuid.uuid4().hex}"

    def write(self, name: str, source: str) -> Path:
        path = self.directory / name
        path.write_text(source)
        return path

    def command(self, *args: str, cache: bool = False) -> list[str]:
        no_cache = [] if cache else ["-p", "no:cacheprovider"]
        return [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "harness.plugin",
            # The harness alone: the installed package's entry point would load the conformance
            # plugin too (its rank fixture and preloads in every inner session's zygote).
            "-p",
            "no:conformance.suite.backend_plugin",
            *no_cache,
            "--rootdir",
            str(self.directory),
            "-o",
            "rank_fixture_modules=",
            *args,
        ]

    @property
    def tmpdir(self) -> Path:
        """The session's TMPDIR (its run directories live there), private to it."""
        path = self.directory / "tmp"
        path.mkdir(exist_ok=True)
        return path

    def run_dirs(self) -> list[Path]:
        return sorted(self.tmpdir.glob("fsdp-harness-*"))

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
        env["TMPDIR"] = str(self.tmpdir)
        env[self.marker] = "1"
        return env

    def run(self, *args: str, timeout: float = 600, cache: bool = False) -> subprocess.CompletedProcess[str]:
        """The session as `subprocess.run` reports it, forked from a warm interpreter (see
        tests.support.warm_pytest: only torch's import is skipped)."""
        return run_pytest(self.command(*args, cache=cache), cwd=self.directory, env=self.env(), timeout=timeout)

    def popen(self, *args: str, cache: bool = False) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.command(*args, cache=cache),
            cwd=self.directory,
            env=self.env(),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )

    def junit(self, rank: int) -> Path:
        return self.directory / "reports" / "junit" / f"rank-{rank}.xml"

    def rank_files(self, directory: Path | None = None) -> list[str]:
        junit = directory or self.directory / "reports" / "junit"
        return sorted(path.name for path in junit.glob("rank-*.xml"))


@pytest.fixture
def inner(tmp_path: Path) -> InnerSession:
    session = InnerSession(tmp_path)
    yield session
    assert leftover_processes(session.marker) == []
