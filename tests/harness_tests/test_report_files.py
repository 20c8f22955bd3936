"""The per-rank files a CI reads, across sessions that share a directory.

In one directory, in order: a run with world sizes 4 and 2; a smaller `-x` run (stale rank-2/3
files go, -x stops where pytest stops); `--repro` of a failure with `--reports-dir` (the re-run
writes there, with the recorded seed and every rank's trace, and leaves the original reports
alone); two sessions at the same time (neither loses the other's results), while a third runs in
another directory: three pools alive at once, each reducing over its own ranks. Sessions share
nothing but the reports directory and pytest's cache when they run in one directory: each pool's
ranks rendezvous in a private directory and their MASTER_PORT store listens on an OS-assigned port.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import SYNCING_LAYERS, Case, InnerSession, read_cases, wait_for_no_leftovers

TESTS = (
    """
import os, pathlib, time
import pytest, torch, torch.distributed as dist
from torch import nn

HERE = pathlib.Path(__file__).parent
MEETING = HERE  # the session in another directory meets the others here too
SESSIONS = ("together_a", "together_b", "together_c")


"""
    + SYNCING_LAYERS
    + """

def meet(name, rank):
    # Three sessions at once: each waits until the others' tests are running too, then reduces
    # over its own ranks while every pool is alive (a rendezvous or port shared by two pools
    # would mix their ranks or hang).
    (MEETING / f"{name}-{rank}").touch()
    deadline = time.monotonic() + 240
    for other in SESSIONS:
        while not (MEETING / f"{other}-{rank}").exists():
            assert time.monotonic() < deadline, f"session {other} never ran while {name} did"
            time.sleep(0.05)
    summed = torch.full((4,), float(rank + 1))
    dist.all_reduce(summed)
    assert summed.tolist() == [3.0] * 4


@pytest.mark.world_size(4)
def test_ws4_fails_on_rank_3(rank):
    assert rank != 3, "rank 3 disagrees"

@pytest.mark.world_size(2)
def test_ws2_passes(rank):
    print(f"rank {rank} passes")

@pytest.mark.world_size(2)
def test_ws2_swaps_layers(rank):
    Model()(torch.ones(1), ["layer1", "layer2"] if rank == 0 else ["layer2", "layer1"])

@pytest.mark.world_size(2)
def test_ws2_after_the_failure(rank):
    pass

@pytest.mark.world_size(2)
def test_together_a(rank):
    meet("together_a", rank)

@pytest.mark.world_size(2)
def test_together_b(rank):
    meet("together_b", rank)

@pytest.mark.world_size(2)
def test_together_c(rank):
    meet("together_c", rank)
"""
)

SWAP = (
    r"collective #1 on group \[0, 1\] at test_shared.py:\d+: rank 0 all_reduce \[layer1\] 36 float32 "
    r"of layer1.weight vs rank 1 all_reduce \[layer2\] 36 float32 of layer2.weight"
)
NODE = "test_shared.py::test_ws2_swaps_layers"


@dataclass
class Runs:
    inner: InnerSession
    first: tuple[str, list[str], dict[int, dict[str, Case]]]
    second: tuple[str, list[str], dict[int, dict[str, Case]]]
    repro: tuple[str, list[str], dict[int, dict[str, Case]]]
    untouched: bool
    together: list[tuple[str, list[str]]]
    elsewhere: tuple[InnerSession, str]
    """The session in another directory that ran at the same time, and its output."""
    directory_after: list[str]
    verdict_s: dict[str, float]
    """Seconds to each test's verdict (pytest's own --junitxml times) and to each whole session."""


def _files(inner: InnerSession, directory: Path | None = None) -> tuple[list[str], dict[int, dict[str, Case]]]:
    junit = directory or inner.directory / "reports" / "junit"
    names = inner.rank_files(junit)
    return names, {int(name.split("-")[1].split(".")[0]): read_cases(junit / name) for name in names}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    inner = InnerSession(tmp_path_factory.mktemp("shared"))
    inner.write("test_shared.py", TESTS)
    common = ("-q", "--collective-timeout=5", "--seed=77", "-k", "not together")
    first = inner.run(*common, "--junitxml=first.xml", cache=True)
    first_files = _files(inner)
    second = inner.run(*common[:-1], "ws2", "-x", "--junitxml=second.xml", cache=True)
    second_files = _files(inner)
    verdict_s = {
        f"{run}: {name}": case.time_s
        for run in ("first", "second")
        for name, case in read_cases(inner.directory / f"{run}.xml").items()
    }
    before = {name: (inner.directory / "reports" / "junit" / name).read_bytes() for name in second_files[0]}
    elsewhere = inner.directory / "elsewhere"
    started = time.monotonic()
    repro = inner.run("--repro", NODE, "--reports-dir", str(elsewhere), cache=True)
    verdict_s["repro session"] = time.monotonic() - started
    repro_files = _files(inner, elsewhere / "junit")
    untouched = before == {name: (inner.directory / "reports" / "junit" / name).read_bytes() for name in before}
    other = InnerSession(tmp_path_factory.mktemp("own"))
    other.write("test_shared.py", TESTS.replace("MEETING = HERE", f"MEETING = pathlib.Path({str(inner.directory)!r})"))
    sessions = [inner.popen("-q", "-k", name, cache=True) for name in ("together_a", "together_b")]
    sessions.append(other.popen("-q", "-k", "together_c", cache=True))
    started = time.monotonic()
    outputs = [session.communicate(timeout=300)[0] for session in sessions]
    verdict_s["concurrent sessions"] = time.monotonic() - started
    together = [(output, _files(inner)[0]) for output in outputs[:2]]
    assert wait_for_no_leftovers(inner.marker) == [] and wait_for_no_leftovers(other.marker) == []
    return Runs(
        inner,
        (first.stdout, *first_files),
        (second.stdout, *second_files),
        (repro.stdout + repro.stderr, *repro_files),
        untouched,
        together,
        (other, outputs[2]),
        inner.rank_files(),
        verdict_s,
    )


def test_every_rank_of_the_first_run_has_every_test(runs: Runs) -> None:
    output, names, cases = runs.first
    assert "2 failed, 2 passed, 3 deselected" in output, output
    assert f"pytest --repro {NODE}" in output  # how to re-run the failure, printed with it
    assert names == ["rank-0.xml", "rank-1.xml", "rank-2.xml", "rank-3.xml"]
    for rank in (0, 1):
        assert sorted(cases[rank]) == [
            "test_ws2_after_the_failure",
            "test_ws2_passes",
            "test_ws2_swaps_layers",
            "test_ws4_fails_on_rank_3",
        ]
        assert re.search(SWAP, cases[rank]["test_ws2_swaps_layers"].message), cases[rank]
    for rank in (2, 3):
        assert sorted(cases[rank]) == ["test_ws4_fails_on_rank_3"]
    assert "rank 3 disagrees" in cases[3]["test_ws4_fails_on_rank_3"].message
    assert cases[0]["test_ws4_fails_on_rank_3"].message.startswith("failed on another rank (this rank: passed)")


def test_a_smaller_run_removes_the_files_it_does_not_rewrite_and_x_stops_both(runs: Runs) -> None:
    output, names, cases = runs.second
    assert "1 failed, 1 passed" in output and "stopping after 1 failures" in output, output
    assert names == ["rank-0.xml", "rank-1.xml"]
    assert "harness: removed per-rank files of an earlier run: rank-2.xml, rank-3.xml" in output
    for rank in (0, 1):
        assert {name: case.status for name, case in cases[rank].items()} == {
            "test_ws2_passes": "passed",
            "test_ws2_swaps_layers": "failed",
        }


def test_repro_writes_where_it_is_told_with_the_recorded_seed_and_traces(runs: Runs) -> None:
    output, names, cases = runs.repro
    assert "1 failed" in output and "--seed=77" in output, output
    assert "--- collective traces ---" in output and "rank 1: 2 collectives" in output
    assert re.search(SWAP, output)
    assert names == ["rank-0.xml", "rank-1.xml"]
    assert {name: case.status for name, case in cases[0].items()} == {"test_ws2_swaps_layers": "failed"}
    assert runs.untouched, "--repro overwrote the reports of the run it reproduces"


def test_two_sessions_at_once_keep_both_results(runs: Runs) -> None:
    (first, _), (second, _) = runs.together
    assert "1 passed" in first and "1 passed" in second, (first, second)
    notices = [output for output in (first, second) if "is in use by pytest session pid" in output]
    assert len(notices) == 1, (first, second)  # the second to start says where its files went
    suffix = re.search(r"per-rank files are rank-<r>(\.[0-9a-f]+)\.xml", notices[0])
    assert suffix is not None, notices[0]
    junit = runs.inner.directory / "reports" / "junit"
    assert runs.directory_after == sorted(
        ["rank-0.xml", "rank-1.xml", f"rank-0{suffix[1]}.xml", f"rank-1{suffix[1]}.xml"]
    )
    for rank in (0, 1):
        mine = read_cases(junit / f"rank-{rank}{suffix[1]}.xml")
        theirs = read_cases(junit / f"rank-{rank}.xml")
        assert len(mine) == len(theirs) == 1 and set(mine) | set(theirs) == {"test_together_a", "test_together_b"}
        assert all(case.status == "passed" for case in [*mine.values(), *theirs.values()])


def test_a_session_in_another_directory_at_the_same_time_passes(runs: Runs) -> None:
    other, output = runs.elsewhere
    assert "1 passed" in output, output
    assert sorted(read_cases(other.junit(0))) == sorted(read_cases(other.junit(1))) == ["test_together_c"]


def test_each_verdict_comes_within_its_bound(runs: Runs) -> None:
    # A test's verdict: at once (the swap is found in the traces when both ranks return), plus a
    # pool start for the first test of a world size (the zygote forks; the session's first start
    # imports torch). Whole sessions (interpreter start and torch import in the parent and the
    # zygote, then one test) only have to end: a few seconds when quiet, minutes under a load of
    # 100+ on 2 cores. The bounds allow a loaded machine.
    first_of_a_pool = {"first: test_ws4_fails_on_rank_3", "first: test_ws2_passes", "second: test_ws2_passes"}
    bounds = {
        name: 300.0 if "session" in name else 60.0 if name in first_of_a_pool else 10.0 for name in runs.verdict_s
    }
    slow = {name: round(seconds, 1) for name, seconds in runs.verdict_s.items() if seconds > bounds[name]}
    assert slow == {}, slow
