"""Robustness: time from a hang to a failed test with its diagnosis (per-rank cause and stacks).

Runs two inner pytest sessions at world size 2 with a short collective timeout: one whose only
test passes (pool start + dispatch) and one where rank 1 hangs in Python while rank 0 waits in a
barrier. The difference is the time the harness needs to turn the hang into a failed test.

    python bench/hang_to_report.py [--collective-timeout 5] [--straggler-grace 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BODY = """
import time, pytest, torch.distributed as dist

@pytest.mark.world_size(2)
def test_body(rank):
    if {hang} and rank == 1:
        time.sleep(3600)
    dist.barrier()
"""


def session_seconds(hang: bool, collective_timeout: float, grace: float) -> tuple[float, str]:
    with tempfile.TemporaryDirectory() as scratch:
        Path(scratch, "test_body.py").write_text(BODY.format(hang=hang))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        started = time.perf_counter()
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-p",
                "harness.plugin",
                "-p",
                "no:cacheprovider",
                "-q",
                "--rootdir",
                scratch,
                f"--collective-timeout={collective_timeout}",
                f"--straggler-grace={grace}",
                "test_body.py",
            ],
            cwd=scratch,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        return time.perf_counter() - started, result.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collective-timeout", type=float, default=5.0)
    parser.add_argument("--straggler-grace", type=float, default=5.0)
    args = parser.parse_args()
    baseline, _ = session_seconds(False, args.collective_timeout, args.straggler_grace)
    hung, output = session_seconds(True, args.collective_timeout, args.straggler_grace)
    assert "rank 1 Python stacks" in output, output
    print(
        f"hang -> failed test with per-rank stacks: {hung - baseline:.1f} s "
        f"(collective timeout {args.collective_timeout:g} s + straggler grace {args.straggler_grace:g} s; "
        f"bound collective timeout + 15 s)"
    )


if __name__ == "__main__":
    main()
