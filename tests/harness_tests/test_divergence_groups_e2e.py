"""Through the real harness at the DEFAULT collective timeout: collectives whose members must pair
up what they exchange, and process groups told apart by identity, not by their members.

Each failing test is a bug as a user writes it: an MoE token exchange where one rank still sizes its
buffers with last step's capacity (gloo raises on one rank, the other would wait), a gather into a
stale buffer, two groups with the same members taken in opposite orders (a cross-group deadlock),
a pipeline stage group picked by the wrong index (a collective on a group the rank is not in,
which torch silently skips). Each must fail within seconds and name the disagreement; exchanges
that add up, groups taken in the same order and a non-member call torch tolerates must pass.
"""

from __future__ import annotations

import re

from conftest import InnerSession, read_cases
from tests.support.pytest_output import failure_sections

GROUPS = """
import pytest, torch, torch.distributed as dist

@pytest.mark.world_size(2)
def test_moe_token_exchange_with_a_stale_capacity(rank):
    # 8 tokens per rank; rank 1 still splits them (and sizes what it receives) by last step's routing.
    send_splits = [4, 4] if rank == 0 else [5, 3]
    receive_splits = [4, 4] if rank == 0 else [3, 5]
    received = torch.empty(sum(receive_splits))
    dist.all_to_all_single(received, torch.ones(8), receive_splits, send_splits)

@pytest.mark.world_size(2)
def test_uneven_token_exchange_that_adds_up(rank):
    send_splits = [1, 3] if rank == 0 else [2, 2]
    receive_splits = [1, 2] if rank == 0 else [3, 2]
    received = torch.empty(sum(receive_splits))
    dist.all_to_all_single(received, torch.full((4,), float(rank)), receive_splits, send_splits)
    assert received.tolist() == [0.0] * receive_splits[0] + [1.0] * receive_splits[1]

@pytest.mark.world_size(2)
def test_gather_into_a_stale_buffer(rank):
    # rank 0 collects 4 metrics per rank, into buffers sized for an older metric count on rank 1's slot
    buffers = [torch.empty(4), torch.empty(3)] if rank == 0 else None
    dist.gather(torch.ones(4), buffers, dst=0)

@pytest.mark.world_size(2)
def test_two_groups_taken_in_opposite_orders(rank):
    data_parallel = dist.new_group([0, 1])
    model_parallel = dist.new_group([0, 1])
    first, second = (model_parallel, data_parallel) if rank == 0 else (data_parallel, model_parallel)
    dist.all_reduce(torch.ones(3), group=first)
    dist.all_reduce(torch.ones(3), group=second)

@pytest.mark.world_size(2)
def test_two_groups_taken_in_the_same_order(rank):
    data_parallel = dist.new_group([0, 1])
    model_parallel = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(3), group=data_parallel)
    dist.all_reduce(torch.ones(5), group=model_parallel)
    dist.all_reduce(torch.ones(7))

@pytest.mark.world_size(4)
def test_a_call_torch_skips_on_non_members_passes(rank):
    low = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(3), group=low)  # ranks 2 and 3 are not in it: torch returns at once there

@pytest.mark.world_size(4)
def test_stage_group_picked_by_the_wrong_index(rank):
    stages = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = stages[rank % 2]  # meant: stages[rank // 2]
    dist.all_reduce(torch.ones(3), group=mine)
"""

SITE = r"test_groups\.py:\d+"
EXPECTED = {
    "test_moe_token_exchange_with_a_stale_capacity": (
        rf"ranks issued divergent collectives: collective #1 on group \[0, 1\] at {SITE}: all_to_all_single: "
        r"rank 0 sends 4 to rank 1 but rank 1 expects 3 from rank 0 .*; elements per member: "
        r"rank 0 sends \[4, 4\], expects \[4, 4\]; rank 1 sends \[5, 3\], expects \[3, 5\]"
    ),
    "test_gather_into_a_stale_buffer": (
        rf"ranks issued divergent collectives: collective #1 on group \[0, 1\] at {SITE}: gather: "
        r"rank 1 sends 4 to rank 0 but rank 0 expects 3 from rank 1; elements per member: "
        r"rank 0 sends \[4, 0\], expects \[4, 3\]; rank 1 sends \[4, 0\], expects \[0, 0\]"
    ),
    "test_two_groups_taken_in_opposite_orders": (
        rf"stopped by the harness [\d.]+ s into the test: deadlock: rank 0 waits in all_reduce on group #2 "
        rf"\[0, 1\] \({SITE}\) for rank 1, which waits in all_reduce on group #1 \[0, 1\] \({SITE}\) for rank 0.*"
        r"ranks issued divergent collectives: deadlock: rank 0 waits in all_reduce on group #2 \[0, 1\]"
    ),
    "test_stage_group_picked_by_the_wrong_index": (
        r"ranks issued divergent collectives: collective #1 on group \[0, 1\]: rank 1 called all_reduce on "
        rf"group \[2, 3\] \({SITE}\), which it is not a member of \(rank 0 issued all_reduce 3 float32"
    ),
}
# The first failed rank's peer is stopped because its wait can never end, not left to hang.
NOT_HUNG = ("test_moe_token_exchange_with_a_stale_capacity", "test_gather_into_a_stale_buffer")
VERDICT_LIMIT_S = 15.0


def test_exchanges_and_groups_are_diagnosed_in_seconds(inner: InnerSession) -> None:
    inner.write("test_groups.py", GROUPS)
    result = inner.run("-q")
    failures = failure_sections(result.stdout)
    assert sorted(failures) == sorted(EXPECTED), result.stdout
    for name, pattern in EXPECTED.items():
        assert re.search(pattern, failures[name], re.S), f"{name}:\n{failures[name]}"
    for name in NOT_HUNG:
        assert "hung" not in failures[name] and "which can never match" in failures[name], failures[name]
    assert f"{len(EXPECTED)} failed, 3 passed" in result.stdout, result.stdout
    cases = read_cases(inner.junit(0))
    for name in EXPECTED:
        assert cases[name].time_s < VERDICT_LIMIT_S, f"{name} took {cases[name].time_s:.1f} s (timeout: 30 s)"
