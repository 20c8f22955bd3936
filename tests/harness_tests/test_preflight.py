"""Bad input is refused before the first test and never costs a verdict (harness.config.preflight).

Each case: the command, the exit status, the text a user sees. The checks run as root here, where
permission bits do not stop a write, so a report location is made unusable the way root meets it
too: a file where a directory belongs (or the reverse).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import InnerSession
from harness.config import preflight

FAILING = """
import os, pytest

@pytest.mark.world_size(1)
def test_fails(rank):
    # The traces directory becomes unusable after the session checked it: the verdict must survive.
    os.makedirs("reports", exist_ok=True)
    open(os.path.join("reports", "traces"), "w").close()
    assert False, "the real failure"
"""

# What pytest-xdist's options look like to other plugins (it is not installed here; the check
# reads the parsed options, so this stand-in exercises the same path as the real -n).
XDIST_STAND_IN = """
def pytest_addoption(parser):
    group = parser.getgroup("xdist")
    group._addoption("-n", "--numprocesses", dest="numprocesses", default=None)  # as xdist does
    group.addoption("--dist", dest="dist", default="no")
    group.addoption("--tx", dest="tx", action="append", default=[])
"""


def test_a_missing_directory_is_judged_by_its_parent(tmp_path: Path) -> None:
    assert preflight.writable_directory_problem(str(tmp_path / "reports" / "junit")) is None
    assert not (tmp_path / "reports").exists()  # checking creates nothing
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    assert preflight.writable_directory_problem(str(blocker)) == "it is not a directory"
    assert preflight.writable_directory_problem(str(blocker / "junit")) == f"{blocker} is not a directory"


def test_the_reports_directory_is_created_or_refused_with_the_fix(tmp_path: Path) -> None:
    assert preflight.reports_directory(None, str(tmp_path)) == str(tmp_path / "reports")
    assert (tmp_path / "reports").is_dir()
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(pytest.UsageError, match=rf"not writable \({blocker} is not a directory\); pass --reports-dir"):
        preflight.reports_directory(str(blocker / "sub"), str(tmp_path))


def test_a_report_file_must_be_a_writable_file(tmp_path: Path) -> None:
    assert preflight.writable_file_problem(str(tmp_path / "conformance.md")) is None
    (tmp_path / "conformance.md").write_text("kept")
    assert preflight.writable_file_problem(str(tmp_path / "conformance.md")) is None
    assert (tmp_path / "conformance.md").read_text() == "kept"  # checking changes nothing
    (tmp_path / "conformance.html").mkdir()
    assert preflight.writable_file_problem(str(tmp_path / "conformance.html")) == "it is not a regular file"
    with pytest.raises(pytest.UsageError, match=r"conformance\.html \(the matrix\): it is not a regular file"):
        preflight.require_writable(files=[("the matrix", str(tmp_path / "conformance.html"))])


def test_oversubscription_is_one_line_naming_sizes_cores_and_the_fix() -> None:
    assert preflight.oversubscription_line([1, 2], cores=2) is None
    line = preflight.oversubscription_line([2, 4, 8, 4], cores=2)
    assert line is not None
    assert "world sizes 4, 8 on CPU exceed the 2 usable CPU cores" in line
    assert "--collective-timeout" in line and "--test-timeout" in line


@pytest.mark.parametrize(
    "blocked, what",
    [("traces", "the collective traces of failed tests"), ("junit", "the per-rank JUnit files")],
)
def test_an_unusable_report_directory_is_refused_before_any_test(inner: InnerSession, blocked: str, what: str) -> None:
    inner.write("test_x.py", FAILING)
    (inner.directory / "reports").mkdir()
    inner.write(f"reports/{blocked}", "")
    result = inner.run("-q")
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert f"reports/{blocked} ({what}): it is not a directory" in result.stderr, result.stderr
    assert "pass --reports-dir with a writable directory" in result.stderr
    assert "INTERNALERROR" not in result.stdout + result.stderr


def test_traces_lost_mid_run_leave_the_real_failure_and_its_repro(inner: InnerSession) -> None:
    inner.write("test_x.py", FAILING)
    result = inner.run("-q", "-rf")
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, result.stdout
    assert "the real failure" in result.stdout and "REPRO: " in result.stdout
    assert "could not write the collective traces" in result.stdout
    assert "PermissionError" not in result.stdout and "FileExistsError" not in result.stdout


@pytest.mark.parametrize("args", [["-n", "2"], ["--dist", "load"], ["--tx", "popen"]])
def test_xdist_is_refused_with_the_reason(inner: InnerSession, args: list[str]) -> None:
    inner.write("xdist_stand_in.py", XDIST_STAND_IN)
    inner.write("test_x.py", "def test_plain():\n    pass\n")
    result = inner.run("-p", "xdist_stand_in", *args)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert "pytest-xdist" in result.stderr and "is not supported" in result.stderr
    assert "drop -n" in result.stderr
    assert not (inner.directory / "reports" / "junit").exists()  # refused before any report


def test_oversubscribed_worlds_are_said_once_before_the_first_test(inner: InnerSession) -> None:
    cores = preflight.usable_cores()
    inner.write(
        "test_x.py",
        "import pytest\n"
        f"@pytest.mark.world_size({cores + 1})\ndef test_a(rank):\n    pass\n"
        f"@pytest.mark.world_size({cores + 1})\ndef test_b(rank):\n    pass\n",
    )
    result = inner.run("--collect-only", "-q", "--device", "cpu")
    said = [line for line in result.stdout.splitlines() if "oversubscribed" in line]
    assert said == [preflight.oversubscription_line([cores + 1], cores)], result.stdout
