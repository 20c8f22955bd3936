"""The shell scripts of scripts/ and .ci/ parse (`bash -n`): a script a maintainer runs only on
a GPU machine, or CI runs only after the session, must not first fail on a typo there."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted([*ROOT.glob("scripts/*.sh"), ROOT / ".ci" / "run", ROOT / ".ci" / "torch-leg"])


@pytest.mark.parametrize("script", SCRIPTS, ids=[str(path.relative_to(ROOT)) for path in SCRIPTS])
def test_the_script_parses(script: Path) -> None:
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_the_gpu_check_runs_every_documented_check() -> None:
    """docs/ci.md shows a passing run; each check it shows is one the script runs."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    shown = (ROOT / "docs" / "ci.md").read_text().split("gpu check on cpu:", 1)[1].split("```", 1)[0]
    names = [line.split()[1] for line in shown.strip().splitlines()[1:]]
    assert names and all(f"check {name} " in script for name in names), names
