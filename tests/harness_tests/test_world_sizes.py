"""World sizes as constraints: marker forms, which sizes a session runs, and what it deselects."""

from __future__ import annotations

import re
from subprocess import CompletedProcess

import pytest

import fixtures
from conftest import InnerSession
from harness.config.torchrun import TorchrunWorld
from harness.config.world_sizes import (
    DEFAULT_WORLD_SIZES,
    SessionWorldSizes,
    WorldShape,
    WorldSizeSpec,
    parse_marker,
    parse_sizes_option,
    session_world_sizes,
)


def spec(*args: object, **kwargs: object) -> WorldSizeSpec:
    return parse_marker(pytest.mark.world_size(*args, **kwargs).mark, "test_x")


def test_marker_forms() -> None:
    assert spec(2) == WorldSizeSpec(listed=(2,), pinned=True)
    assert spec([2, 4]) == WorldSizeSpec(listed=(2, 4))
    constrained = spec(min=4, multiple_of=2, max=16, default=4)
    assert constrained == WorldSizeSpec(minimum=4, maximum=16, multiple_of=2, default=(4,))
    assert [constrained.refusal(n) for n in (2, 4, 6, 7, 18)] == [
        "needs world size >= 4",
        None,
        None,
        "needs a world size divisible by 2",
        "needs world size <= 16",
    ]
    assert spec([2, 4]).refusal(3) == "runs only at world sizes 2, 4"


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((), {}, "use @pytest.mark.world_size(N)"),
        ((2,), {"min": 2}, "use @pytest.mark.world_size(N)"),
        ((), {"minimum": 2}, "use @pytest.mark.world_size(N)"),
        ((), {"min": 0}, "min must be >= 1, got 0"),
        ((), {"min": 4, "max": 2}, "world_size(max=2) is below min=4"),
        ((), {"multiple_of": 2, "default": [2, 3]}, "default world size 3 contradicts the marker"),
        ((), {"min": 2, "default": []}, "world_size(default=[]) is empty"),
        ((), {"min": 2, "exclude": "HYBRID"}, "exclude=...) takes a function"),
        (([2, 2.5],), {}, "world_size must be an int or a list of ints, got 2.5"),
    ],
)
def test_marker_errors_name_the_fix(args: tuple, kwargs: dict, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        spec(*args, **kwargs)


def test_sizes_a_session_generates() -> None:
    default = SessionWorldSizes(None, "defaults")
    on_8_gpus = SessionWorldSizes(None, "defaults", visible_gpus=8)
    chosen = SessionWorldSizes((3, 8), "--world-sizes 3,8")
    assert default.candidates(spec([1, 2])) == (1, 2)
    assert default.candidates(spec(min=2)) == (2, 4)  # DEFAULT_WORLD_SIZES as far as allowed
    assert default.candidates(spec(min=2, default=2)) == (2,)
    assert default.candidates(spec(min=8)) == ()
    assert on_8_gpus.candidates(spec(min=2, default=[2, 4])) == (2, 4, 8)
    assert on_8_gpus.candidates(spec(min=2, max=4, default=2)) == (2,)
    assert on_8_gpus.candidates(spec([2, 4])) == (2, 4)  # listed sizes are not widened
    # A chosen session generates its sizes and the test's own; what it does not run is deselected.
    assert chosen.candidates(spec([2, 4])) == (2, 3, 4, 8)
    assert chosen.candidates(spec(min=2, default=2)) == (2, 3, 8)
    assert chosen.refusal(spec([2, 4]), 2, {}) == "not among this session's world sizes"
    assert chosen.refusal(spec([2, 4]), 3, {}) == "runs only at world sizes 2, 4"
    assert chosen.refusal(spec(2), 2, {}) == "runs only at world size 2"
    assert chosen.refusal(spec(min=4), 3, {}) == "needs world size >= 4"
    assert default.refusal(spec(min=8), None, {}) == (
        "allows none of 1, 2, 4 (needs world size >= 8) and has no default= sizes"
    )
    assert DEFAULT_WORLD_SIZES == (1, 2, 4)


def test_exclude_sees_the_world_shape_and_the_parameters() -> None:
    seen = []

    def exclude(world: WorldShape, params: dict) -> str | None:
        seen.append((world, dict(params)))
        return "odd" if params["n"] % 2 else None

    marker = spec(min=2, exclude=exclude)
    torchrun = SessionWorldSizes((4,), "torchrun WORLD_SIZE=4", local_size=2)
    assert torchrun.refusal(marker, 4, {"n": 1}) == "odd"
    assert torchrun.refusal(marker, 4, {"n": 2}) is None
    assert seen[0][0] == WorldShape(4, 2) and seen[0][0].hosts == 2
    assert SessionWorldSizes(None, "defaults").shape(4) == WorldShape(4, 4)  # a pool is one host


@pytest.mark.parametrize(
    ("world", "local", "shard"),
    [
        (1, None, None),  # one rank: one group, HYBRID cannot run
        (2, None, 1),  # one host: two groups of one
        (3, None, 1),  # prime: three groups of one
        (4, None, 2),
        (6, None, 3),
        (8, None, 4),
        (4, 2, 2),  # two hosts of two: shard within a host, replicate across hosts
        (16, 8, 8),
        (8, 8, 4),  # a one-node torchrun world is one host
        (6, 4, 3),  # ranks per host that do not divide the world: as on one host
    ],
)
def test_hybrid_shard_group_size(world: int, local: int | None, shard: int | None) -> None:
    assert fixtures.hybrid_shard_group_size(world, local) == shard
    reason = fixtures.hybrid_shard_exclusion(world, local)
    assert (reason is None) == (shard is not None)
    if shard is not None:
        assert world // shard >= 2  # at least two shard groups, so gradients cross groups


def test_session_sizes_from_options_and_torchrun() -> None:
    assert parse_sizes_option("8,2, 4,2") == (2, 4, 8)
    with pytest.raises(pytest.UsageError, match="positive integers separated by commas"):
        parse_sizes_option("two")
    assert session_world_sizes("2,8", "cpu", 8, None).chosen == (2, 8)
    assert session_world_sizes(None, "cpu", 8, None).visible_gpus == 0  # --device cpu: GPUs do not count
    assert session_world_sizes(None, "auto", 8, None).visible_gpus == 8
    three_hosts = TorchrunWorld(rank=2, local_rank=0, world_size=3, local_world_size=1)
    torchrun = session_world_sizes(None, "cpu", 0, three_hosts)
    assert (torchrun.chosen, torchrun.local_size, torchrun.origin) == ((3,), 1, "torchrun WORLD_SIZE=3")
    with pytest.raises(pytest.UsageError, match="drop --world-sizes"):
        session_world_sizes("2,4", "cpu", 0, three_hosts)


TESTS = """
import pytest

def odd_n_refused(world, params):
    return f"n={params['n']} is odd" if params["n"] % 2 else None

@pytest.mark.world_size(2)
def test_pinned(rank):
    pass

@pytest.mark.world_size([1, 2])
def test_listed(rank):
    pass

@pytest.mark.world_size(min=2, default=2, exclude=odd_n_refused)
@pytest.mark.parametrize("n", [1, 2])
def test_constrained(rank, world_size, n):
    assert world_size >= 2

@pytest.mark.world_size(min=3, multiple_of=3)
def test_needs_three(rank, world_size):
    assert world_size % 3 == 0, "fails on purpose at a size it was not meant for"
"""


def _outcomes(output: str) -> dict[str, str]:
    return dict(reversed(line.split(" ", 1)) for line in output.splitlines() if line.startswith(("PASSED", "FAILED")))


def _ran(result: CompletedProcess[str]) -> list[str]:
    """The sorted ids of the tests a passing inner session over `TESTS` reports (-rA)."""
    assert result.returncode == 0, result.stdout
    return sorted(_outcomes(result.stdout))


def _ids(*names: str) -> list[str]:
    return [f"test_sizes.py::{name}" for name in names]


def test_sessions_run_what_the_markers_allow(inner: InnerSession) -> None:
    inner.write("test_sizes.py", TESTS)
    result = inner.run("-rA", "-q")
    assert _ran(result) == _ids("test_constrained[ws2-2]", "test_listed[ws1]", "test_listed[ws2]", "test_pinned")
    summary = re.search(r"harness: (\d+) deselected for their world size \(([^)]*)\): (.*)", result.stdout)
    assert summary is not None, result.stdout
    assert summary.groups()[:2] == ("2", "each test's default world sizes")
    assert "1 n=1 is odd" in summary.group(3)
    assert (
        "1 allows none of 1, 2, 4 (needs world size >= 3; needs a world size divisible by 3) "
        "and has no default= sizes" in summary.group(3)
    )

    result = inner.run("-rA", "--world-sizes", "2,3", "-v")
    assert _ran(result) == _ids(
        "test_constrained[ws2-2]", "test_constrained[ws3-2]", "test_listed[ws2]", "test_needs_three[ws3]", "test_pinned"
    )
    assert "5 passed, 5 deselected" in result.stdout
    for line in (
        "test_sizes.py::test_listed[ws1]: not among this session's world sizes",
        "test_sizes.py::test_listed[ws3]: runs only at world sizes 1, 2",
        "test_sizes.py::test_constrained[ws3-1]: n=1 is odd",
        "test_sizes.py::test_needs_three[ws2]: needs world size >= 3",
    ):
        assert line in result.stdout, result.stdout


def test_a_failure_at_a_chosen_size_repeats_it_in_its_repro_line(inner: InnerSession) -> None:
    inner.write(
        "test_one.py",
        "import pytest\n@pytest.mark.world_size(min=1, default=1)\n"
        "def test_only_one(world_size):\n    assert world_size == 1\n",
    )
    result = inner.run("-q", "--world-sizes", "2")
    assert result.returncode == 1, result.stdout
    repro = next(line for line in result.stdout.splitlines() if line.startswith("REPRO:"))
    assert "test_one.py::test_only_one[ws2]" in repro and "--world-sizes=2" in repro
