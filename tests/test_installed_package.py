"""The suite from a pip install: a wheel built from this tree, installed (not editable) into a fresh
virtual environment that does not see this repository, run from an empty directory.

The venv reaches torch, pytest and the other dependencies through a ``.pth`` line naming this
interpreter's site-packages (so no download), but not this repository: its editable-install
finder lives in a ``.pth`` file of that directory, which a ``.pth`` line does not process, and the
test checks that ``conformance`` imports from the venv. Runs: the reference smoke tests through
``--pyargs conformance``; an adapter that lives only in the empty directory, through a test file
of one line (``from conformance.suite.scenarios import *``); torch-fsdp1's smoke tests with
``--strict-expectations`` (its expectations file must be in the wheel); the example backend
repository (examples/zero2-backend), its own wheel installed beside the suite's, its tests run from
a copy of its checkout without its package (so the installed one, found by its entry point, with
the expectations file its wheel carries, is what runs). Reports land in that directory. Last, the
self-tests themselves run from the tests/ directory.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "zero2-backend"

LOCAL_ADAPTER = """
from conformance.adapters.reference import ReferenceAdapter

class LocalAdapter(ReferenceAdapter):
    name = "local-reference"
"""


def _purelib(python: Path) -> Path:
    """The site-packages directory of the venv whose interpreter is ``python``."""
    query = [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
    return Path(subprocess.run(query, check=True, capture_output=True, text=True).stdout.strip())


def _install_wheel(source: Path, python: Path, wheels: Path) -> Path:
    """Build the wheel of the project at ``source`` into ``wheels`` and install it, without its
    dependencies, into the venv whose interpreter is ``python``; the wheel's path."""
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels)]
    subprocess.run([*build, str(source)], check=True, timeout=300)
    (wheel,) = wheels.glob("*.whl")
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(_purelib(python))]
    subprocess.run([*install, str(wheel)], check=True, timeout=300)
    return wheel


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The venv's python, with the wheel of this tree installed."""
    root = tmp_path_factory.mktemp("installed")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    (_purelib(python) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    wheel = _install_wheel(REPO, python, root / "wheels")
    assert wheel.name.startswith("fsdp_conformance-"), wheel
    names = zipfile.ZipFile(wheel).namelist()
    for shipped in ("torch-fsdp1", "torch-fsdp2", "torch-zero", "deepspeed"):
        assert f"conformance/expectations/{shipped}.toml" in names, names
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


def test_the_example_backend_repository_runs_its_own_suite(installed: Path, tmp_path: Path) -> None:
    wheel = _install_wheel(EXAMPLE, installed, tmp_path / "wheels")
    assert "zero2_backend/expectations.toml" in zipfile.ZipFile(wheel).namelist()
    checkout = tmp_path / "zero2-backend"
    shutil.copytree(EXAMPLE, checkout, ignore=shutil.ignore_patterns("zero2_backend", "reports", "__pycache__"))
    done = run_in(checkout, installed, "-m", "pytest", "--strict-expectations", "-rA")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    # The backend came from the installed package's entry point, its expectations from its wheel.
    assert re.search(r"zero2-from-docs: entry point of zero2-backend 0\.1\.0", output), output
    assert str(installed.parents[1]) in output.partition("zero2-from-docs: entry point")[2].splitlines()[0], output
    passed = re.findall(r"^PASSED (tests/\S+)", output, re.MULTILINE)
    assert not re.search(r"^(FAILED|ERROR) ", output, re.MULTILINE), output
    proofs = [
        test for test in passed if test.startswith("tests/test_declared_absences.py::test_declared_absence_is_real")
    ]
    assert len(proofs) == 15, proofs  # one per proof: every declared gap shown on the library
    scenarios = [test for test in passed if test.startswith("tests/test_conformance.py::")]
    for family in ("test_training[", "test_storage_claim[", "test_generated_programs[", "test_gradient_accumulation["):
        assert any(family in test for test in scenarios), (family, scenarios)
    assert "stale" not in output, output
    matrix = (checkout / "reports" / "conformance.md").read_text()
    assert "| scenario | zero2-from-docs |" in matrix, matrix
    assert {"rank-0.xml", "rank-1.xml"} <= {path.name for path in (checkout / "reports" / "junit").iterdir()}


def test_the_example_workflow_runs_the_suite_on_cpu_and_on_gpu() -> None:
    """The example's CI file (GitHub Actions) cannot run here: this holds it to what it must do,
    each job installing the suite as a package and running the repository's tests strictly on
    its device, reports kept whatever the outcome."""
    import yaml

    workflow = yaml.safe_load((EXAMPLE / ".github" / "workflows" / "conformance.yml").read_text())
    assert set(workflow["jobs"]) == {"cpu", "gpu"}, workflow["jobs"]
    assert "gpu" in workflow["jobs"]["gpu"]["runs-on"], workflow["jobs"]["gpu"]
    for name, job in workflow["jobs"].items():
        device = {"cpu": "cpu", "gpu": "cuda"}[name]
        commands = [step["run"] for step in job["steps"] if "run" in step]
        assert any("$SUITE" in command and "-e '.[test]'" in command for command in commands), commands
        assert f"python -m pytest --device {device} --strict-expectations" in commands, commands
        uploads = [step for step in job["steps"] if step.get("uses", "").startswith("actions/upload-artifact")]
        assert uploads and uploads[0]["if"] == "always()" and uploads[0]["with"]["path"] == "reports/", uploads
    assert workflow["env"]["SUITE"].startswith("fsdp-conformance"), workflow["env"]
    project = (EXAMPLE / "pyproject.toml").read_text()
    assert '[project.entry-points."fsdp_conformance.backends"]' in project and "fsdp-conformance" in project
