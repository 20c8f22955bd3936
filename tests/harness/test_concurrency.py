"""Pytest sessions at once on one machine, in one directory or in two, all pass.

Each session's ranks rendezvous in a private directory and their MASTER_PORT store listens on an
OS-assigned port, so sessions share nothing but the reports directory and pytest's cache when
they run in one directory (report files are replaced atomically, under names of their own while
written). The tests wait for each other, so every session's pool is alive at the same time.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from conftest import InnerSession, leftover_processes

TESTS = """
import os, pathlib, time
import pytest, torch, torch.distributed as dist

MEETING = pathlib.Path(os.environ["MEETING_DIR"])

@pytest.mark.world_size(2)
def test_a_meet_the_other_sessions(rank):
    (MEETING / f"{os.environ['SESSION_NAME']}-{rank}").touch()
    deadline = time.monotonic() + 240
    for other in os.environ["OTHER_SESSIONS"].split(","):
        while not (MEETING / f"{other}-{rank}").exists():
            assert time.monotonic() < deadline, f"session {other} never ran while this one did"
            time.sleep(0.1)

@pytest.mark.world_size(2)
@pytest.mark.parametrize("n", range(3))
def test_b_collectives(rank, world_size, n):
    t = torch.full((4,), float(rank + n))
    dist.all_reduce(t)
    assert t.tolist() == [float(sum(range(world_size)) + n * world_size)] * 4
"""


def test_three_sessions_at_once_two_in_one_directory(tmp_path: Path) -> None:
    meeting = tmp_path / "meeting"
    meeting.mkdir()
    layout = {"first": tmp_path / "shared", "second": tmp_path / "shared", "third": tmp_path / "own"}
    processes = {}
    sessions = []
    for name, directory in layout.items():
        directory.mkdir(exist_ok=True)
        session = InnerSession(directory)
        session.write("test_shared.py", TESTS)
        sessions.append(session)
        env = {
            **session.env(),
            "SESSION_NAME": name,
            "OTHER_SESSIONS": ",".join(other for other in layout if other != name),
            "MEETING_DIR": str(meeting),
        }
        processes[name] = subprocess.Popen(
            session.command("-q", "--device", "cpu", "--collective-timeout=60", cache=True),
            cwd=directory,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
    for name, process in processes.items():
        output = process.communicate(timeout=600)[0]
        assert process.returncode == 0, f"session {name}:\n{output}"
        assert "4 passed" in output, f"session {name}:\n{output}"
    for directory in set(layout.values()):
        for rank in range(2):
            assert (directory / "reports" / "junit" / f"rank-{rank}.xml").stat().st_size > 0
    assert not any(leftover_processes(session.marker) for session in sessions)
