"""Process groups kept across a warm rank's tests (harness.rank.group_reuse), run in order on one warm
pool: the same request in a later test gets the same group, the k-th request of a test the k-th
group, a group a test destroyed is created anew, ranks that disagree about what they keep are
replaced, and a backend that keeps its groups alive beyond its test no longer leaks one per test.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import init_device_mesh

from harness.rank.worker import LEAKED_GROUP_LIMIT


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("group-reuse")


def _names(*groups: dist.ProcessGroup) -> str:
    return ",".join(c10d._world.pg_names[group] for group in groups)


def _works(group: dist.ProcessGroup, world_size: int) -> None:
    tensor = torch.ones(1)
    dist.all_reduce(tensor, group=group)
    assert tensor.item() == world_size


def _requests(world_size: int) -> tuple[dist.ProcessGroup, ...]:
    """What a typical test asks for: a group of every rank, one of the first two ranks (a
    non-member's answer on the others), and a 2-D mesh's two dimensions."""
    whole = dist.new_group(list(range(world_size)))
    pair = dist.new_group([0, 1])
    mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("replicate", "shard"))
    return whole, pair, mesh.get_group("replicate"), mesh.get_group("shard")


@pytest.mark.world_size([2, 4])
@pytest.mark.parametrize("index", [0, 1])
def test_1_the_same_requests_get_the_same_groups_in_a_later_test(
    rank: int, world_size: int, index: int, shared_dir: Path
) -> None:
    whole, pair, replicate, shard = _requests(world_size)
    for group in (whole, replicate, shard):
        _works(group, dist.get_world_size(group))
    if rank < 2:
        _works(pair, 2)
    else:
        assert pair == c10d.GroupMember.NON_GROUP_MEMBER  # a non-member's answer, kept alike
    state = shared_dir / f"groups-{world_size}-{rank}"
    seen = (_names(whole, replicate, shard), str(os.getpid()), str(c10d._world.group_count))
    if index == 0:
        state.write_text("\n".join(seen))
        return
    names, pid, group_count = state.read_text().split("\n")
    assert pid == str(os.getpid()), "the warm rank was not reused"
    assert _names(whole, replicate, shard) == names, "a later test's equal requests got other groups"
    assert str(c10d._world.group_count) == group_count, "torch created groups for requests already kept"


@pytest.mark.world_size(2)
def test_2_a_second_equal_request_in_one_test_gets_a_second_group(rank: int, world_size: int) -> None:
    first, second = dist.new_group([0, 1]), dist.new_group([0, 1])
    assert first is not second, "two requests of one test must get two groups, as without reuse"
    # Different options are another request: another group.
    longer = dist.new_group([0, 1], timeout=c10d.default_pg_timeout * 2)
    assert longer is not first and longer is not second
    for group in (first, second, longer):
        _works(group, world_size)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("step", ["destroy", "recreate"])
def test_3_a_kept_group_that_a_test_destroyed_is_created_anew(
    rank: int, world_size: int, step: str, shared_dir: Path
) -> None:
    group = dist.new_group([0, 1])
    _works(group, world_size)
    name_file = shared_dir / f"destroyed-{rank}"
    if step == "destroy":
        name_file.write_text(_names(group))
        dist.destroy_process_group(group)
        again = dist.new_group([0, 1])  # the same request, in the same test, after the destroy
        assert again in c10d._world.pg_map
        _works(again, world_size)
    else:
        assert _names(group) != name_file.read_text()


@pytest.mark.world_size(2)
@pytest.mark.parametrize("step", ["destroy-on-rank-0-only", "replaced"])
def test_4_ranks_that_keep_different_groups_are_replaced(
    rank: int, world_size: int, step: str, shared_dir: Path
) -> None:
    """Rank 0 destroys a kept group that rank 1 keeps: a later equal request would be served from
    the kept groups on rank 1 and created (a rendezvous rank 1 never joins) on rank 0, so the parent
    must replace the ranks after this test (their sync states differ)."""
    pid_file = shared_dir / f"asymmetric-pid-{rank}"
    if step == "destroy-on-rank-0-only":
        pid_file.write_text(str(os.getpid()))
        group = dist.new_group([0, 1])
        _works(group, world_size)
        if rank == 0:
            dist.destroy_process_group(group)
        return
    assert pid_file.read_text() != str(os.getpid()), "ranks that keep different groups were reused"
    group = dist.new_group([0, 1])
    _works(group, world_size)


# Groups this module keeps alive on purpose, as a backend whose objects outlive their test does.
_HELD: list[dist.ProcessGroup] = []


@pytest.mark.world_size(2)
@pytest.mark.parametrize("index", range(LEAKED_GROUP_LIMIT + 3))
def test_5_a_backend_that_holds_its_groups_beyond_its_test_leaks_nothing(
    rank: int, world_size: int, index: int, shared_dir: Path
) -> None:
    """Destroyed but referenced, each such group would keep its threads, and the rank would be
    replaced after LEAKED_GROUP_LIMIT of them (tests/harness_tests/test_isolation.py, test_5);
    kept, the same group serves every test and the rank lives on."""
    pid_file = shared_dir / f"holder-pid-{rank}"
    if index == 0:
        pid_file.write_text(str(os.getpid()))
    assert pid_file.read_text() == str(os.getpid()), f"replaced after {index} tests that held a group"
    group = dist.new_group([0, 1])
    _works(group, world_size)
    _HELD.append(group)
    assert all(held is group for held in _HELD)
