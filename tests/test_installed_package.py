"""The suite from a pip install: a wheel built from this tree, installed (not editable) into a fresh
virtual environment that does not see this repository, run from an empty directory.

The venv reaches torch, pytest and the other dependencies through a ``.pth`` line naming this
interpreter's site-packages (so no download), but not this repository: its editable-install
finder lives in a ``.pth`` file of that directory, which a ``.pth`` line does not process, and the
test checks that ``conformance`` imports from the venv. Runs: the reference smoke tests through
``--pyargs conformance``; an adapter that lives only in the empty directory, through a test file
of one line (``from conformance.suite.scenarios import *``); torch-fsdp1's smoke tests with
``--strict-expectations`` (its expectations file must be in the wheel). Reports land in that
directory. Last, the self-tests themselves run from the tests/ directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

LOCAL_ADAPTER = """
from conformance.adapters.reference import ReferenceAdapter

class LocalAdapter(ReferenceAdapter):
    name = "local-reference"
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The venv's python, with the wheel of this tree installed."""
    root = tmp_path_factory.mktemp("installed")
    wheels = root / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(REPO)],
        check=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("fsdp_conformance-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for shipped in ("torch-fsdp1", "torch-fsdp2", "torch-zero", "deepspeed"):
        assert f"conformance/expectations/{shipped}.toml" in names, names
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (purelib / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(purelib), str(wheel)],
        check=True,
        timeout=300,
    )
    return python


def run_in(directory: Path, python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    return subprocess.run([str(python), *args], cwd=directory, env=env, capture_output=True, text=True, timeout=600)


def test_the_wheel_imports_from_the_venv_not_this_repository(installed: Path, tmp_path: Path) -> None:
    done = run_in(
        tmp_path, installed, "-c", "import conformance, harness; print(conformance.__file__, harness.__file__)"
    )
    assert done.returncode == 0, done.stderr
    assert str(REPO) not in done.stdout and str(installed.parents[1]) in done.stdout, done.stdout
    version = run_in(tmp_path, installed, "-m", "conformance", "--version")
    assert version.returncode == 0 and "adapter protocol" in version.stdout, version


def test_reference_smoke_by_pyargs_from_an_empty_directory(installed: Path, tmp_path: Path) -> None:
    done = run_in(
        tmp_path, installed, "-m", "pytest", "--pyargs", "conformance", "-k", "smoke", "--backend", "reference"
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "4 passed" in output and "harness reports: ./reports" in output, output
    assert (tmp_path / "reports" / "conformance.md").is_file() and (tmp_path / "reports" / "junit").is_dir()
    assert "test_smoke.py::test_" in (tmp_path / "reports" / "conformance.md").read_text()


def test_a_local_adapter_through_a_one_line_test_file(installed: Path, tmp_path: Path) -> None:
    (tmp_path / "local_adapter.py").write_text(LOCAL_ADAPTER)
    (tmp_path / "test_conformance.py").write_text("from conformance.suite.scenarios import *  # noqa: F403\n")
    done = run_in(
        tmp_path, installed, "-m", "pytest", "test_conformance.py", "-m", "smoke",
        "--backend", "local_adapter:LocalAdapter",
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "4 passed" in output, output
    assert "conformance backends: local-reference" in output, output
    matrix = (tmp_path / "reports" / "conformance.md").read_text()
    assert "| scenario | local-reference |" in matrix and "test_smoke.py::" in matrix, matrix


def test_torch_fsdp1_smoke_with_strict_expectations(installed: Path, tmp_path: Path) -> None:
    done = run_in(
        tmp_path, installed, "-m", "pytest", "--pyargs", "conformance.test_smoke", "--backend", "torch-fsdp1",
        "--strict-expectations",
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "torch-fsdp1: built-in" in output and "expectations/torch-fsdp1.toml" in output, output
    assert "stale" not in output, output


def test_self_tests_run_from_the_tests_directory(tmp_path: Path) -> None:
    """`cd tests && python -m pytest <dir>/...`: no directory of tests/ shadows an installed package
    (tests/harness once was a namespace package `harness` ahead of the real one)."""
    shadowing = [path.name for path in (REPO / "tests").iterdir() if path.name in ("harness", "engine", "conformance")]
    assert not shadowing, shadowing
    options = ["-q", "-p", "no:cacheprovider", "--reports-dir", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *options, "harness_tests/test_preflight.py"],
        cwd=REPO / "tests",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout + done.stderr
