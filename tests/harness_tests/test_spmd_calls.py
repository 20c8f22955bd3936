"""Parent-side SPMD calls (`spmd_world`, `harness.SpmdWorld`): values, failures, restarts.

One inner session runs the behaviours that need ranks, in file order, each test asserting its own
result (a failing one prints the call's `describe()`): the pool a world_size test started serves
the calls; per-rank values and seeding; a rank that raises while its peer waits in a collective;
a hang past `timeout_s`; a rank that exits; failing calls in a row; a divergence between the
ranks' collectives; what cannot be pickled; `call_context()` outside a call. The errors that need
no ranks are checked in this process.
"""

from __future__ import annotations

import pickle
import threading
from types import SimpleNamespace

import pytest

import harness
from conftest import InnerSession
from harness.session import spmd
from harness.session.pool_session import PoolSession
from harness.session.spmd import UNDER_TORCHRUN, function_name, open_world, pickle_arguments

CALLS = r"""
import json, os, pathlib, sys, threading, time
import pytest, torch, torch.distributed as dist
import harness

HERE = pathlib.Path(__file__).parent
SOURCE = pathlib.Path(__file__).read_text().splitlines()
RAISE_LINE = next(number for number, line in enumerate(SOURCE, 1) if "rank 1 " + "refuses" in line)
DIVERGE_LINE = next(number for number, line in enumerate(SOURCE, 1) if "from another " + "line" in line)


def who(x, scale=1):
    context = harness.call_context()
    return {
        "rank": context.rank,
        "world_size": context.world_size,
        "value": x * scale * (context.rank + 1),
        "draw": torch.rand(1).item(),
        "grace": context.options["straggler_grace"],
        "pid": os.getpid(),
    }


def pid():
    return os.getpid()


def raise_on_one():
    tensor = torch.ones(1)
    if dist.get_rank() == 1:
        raise ValueError("rank 1 refuses")
    dist.all_reduce(tensor)  # rank 0 waits for a peer that never comes
    return tensor.item()


def hang_on_zero():
    if dist.get_rank() == 0:
        time.sleep(60)
    return "done"


def exit_on_one():
    if dist.get_rank() == 1:
        print("rank 1 says goodbye", file=sys.stderr, flush=True)
        os._exit(7)
    return os.getpid()


def diverge():
    tensor = torch.ones(8)
    if dist.get_rank() == 0:
        dist.all_reduce(tensor)  # the same op and size on both ranks, from another line
    else:
        dist.all_reduce(tensor)
    return tensor[0].item()


def returns_a_lock():
    return threading.Lock()


@pytest.mark.world_size(2)
def test_0_distributed_test_first(rank):
    (HERE / f"test-pid-{rank}").write_text(str(os.getpid()))
    with pytest.raises(RuntimeError, match="outside a parent-side SPMD call"):
        harness.call_context()


def test_1_calls_share_the_tests_pool(spmd_world):
    world = spmd_world(2)
    assert (world.world_size, world.device_kind) == (2, "cpu")
    assert world.call(pid) == [int((HERE / f"test-pid-{rank}").read_text()) for rank in range(2)]


def test_2_values_and_seeds(spmd_world):
    world = spmd_world(2)
    torch.manual_seed(1234)  # the session's --seed: each rank draws what this process draws
    expected = torch.rand(1).item()
    for trace, isolate in ((True, True), (False, False), (True, False), (False, True)):
        result = world.run(who, (3,), {"scale": 2}, trace=trace, isolate=isolate)
        assert result.ok and not result.restarted and not result.failures, result.describe()
        assert [value["value"] for value in result.ordered_values()] == [6, 12]
        assert [value["rank"] for value in result.values.values()] == [0, 1]
        assert {value["world_size"] for value in result.values.values()} == {2}
        assert {value["draw"] for value in result.values.values()} == {expected}
        assert {value["grace"] for value in result.values.values()} == {1.0}
        assert result.first_failure is None and result.divergence is None
    torch.manual_seed(7)
    seven = torch.rand(1).item()
    assert {value["draw"] for value in world.run(who, (1,), seed=7).values.values()} == {seven}


def test_3_a_raise_while_the_peer_waits(spmd_world):
    world = spmd_world(2)
    before = world.call(pid)
    started = time.monotonic()
    result = world.run(raise_on_one, trace=False, isolate=False)  # no trace: only the grace stops rank 0
    assert not result.ok and result.values == {} and result.restarted, result.describe()
    assert time.monotonic() - started < 10  # the straggler grace (1 s), not the collective timeout
    assert result.first_failure == (1, f"ValueError: rank 1 refuses at test_calls.py:{RAISE_LINE}"), result.describe()
    assert "Traceback (most recent call last)" in result.failures[1]
    assert f'test_calls.py", line {RAISE_LINE}, in raise_on_one' in result.failures[1]
    assert "1 s after another rank failed" in result.failures[0], result.failures[0]
    assert "--- rank 0 Python stacks ---" in result.failures[0]
    assert "in raise_on_one" in result.failures[0]
    text = result.describe()
    assert "rank 1 failed first: ValueError: rank 1 refuses" in text and "pool was restarted" in text
    after = world.call(pid)
    assert set(after).isdisjoint(before)  # fresh ranks
    with pytest.raises(harness.SpmdCallFailed) as failed:
        world.call(raise_on_one)  # traced: the one-sided watch stops rank 0 at once
    assert failed.value.result.failures[1].startswith("Traceback")
    assert "waited alone in collective #1" in failed.value.result.failures[0]
    assert "ValueError: rank 1 refuses" in str(failed.value)


def test_4_a_hang_past_timeout_s(spmd_world):
    world = spmd_world(2)
    result = world.run(hang_on_zero, timeout_s=2)
    assert result.values == {1: "done"} and result.restarted, result.describe()
    assert "hung: no result within the 2 s SPMD call deadline (the call's timeout_s=2)" in result.failures[0]
    assert "in hang_on_zero" in result.failures[0]  # its Python stack
    assert len(world.call(pid)) == 2


def test_5_a_rank_that_exits(spmd_world):
    world = spmd_world(2)
    result = world.run(exit_on_one)
    assert set(result.values) == {0} and result.restarted, result.describe()
    assert "rank 1 exited with code 7 while running the SPMD call" in result.failures[1]
    assert "rank 1 says goodbye" in result.failures[1]  # the tail of its stderr
    assert result.first_failure == (1, "exited with code 7 while running the SPMD call")
    assert result.values[0] not in world.call(pid)  # the next call runs on fresh ranks


def test_6_failing_calls_in_a_row_do_not_end_the_session(spmd_world):
    world = spmd_world(2)
    for _ in range(3):
        result = world.run(raise_on_one)
        assert not result.ok and result.first_failure[0] == 1, result.describe()
    assert len(world.call(pid)) == 2


def test_7_a_divergence(spmd_world):
    world = spmd_world(2)
    result = world.run(diverge)
    assert result.ok and result.values == {0: 2.0, 1: 2.0}, result.describe()
    assert "all_reduce" in result.divergence and f"test_calls.py:{DIVERGE_LINE}" in result.divergence
    assert [len(result.traces[rank]) for rank in range(2)] == [1, 1]
    with pytest.raises(harness.SpmdCallFailed, match="ranks issued divergent collectives"):
        world.call(diverge)
    assert world.run(diverge, trace=False).divergence is None


def test_8_what_cannot_be_pickled(spmd_world):
    world = spmd_world(2)
    with pytest.raises(TypeError, match=r"keyword argument 'lock' of the SPMD call of test_calls.pid \(a lock\)"):
        world.run(pid, kwargs={"lock": threading.Lock()})
    with pytest.raises(TypeError, match="cannot be called on the ranks"):
        world.run(lambda: 1)
    result = world.run(returns_a_lock)
    assert not result.ok and not result.restarted, result.describe()  # isolated, traced, clean: kept
    assert "cannot be sent to the parent" in result.failures[0] and "fix: return plain data" in result.failures[0]


def test_9_call_context_outside_a_call():
    with pytest.raises(RuntimeError, match="outside a parent-side SPMD call"):
        harness.call_context()
"""


def test_spmd_calls_in_a_session(inner: InnerSession) -> None:
    inner.write("test_calls.py", CALLS)
    result = inner.run("-q", "--straggler-grace=1", "--test-timeout=30")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "10 passed" in result.stdout, result.stdout
    assert "parent-side SPMD calls" in result.stdout, result.stdout


def test_a_function_the_ranks_cannot_import_by_name_is_refused_before_sending() -> None:
    def nested() -> None:
        pass

    with pytest.raises(TypeError, match=r"does not name it there .* Define it at module level"):
        function_name(nested)
    assert str(function_name(pickle_arguments)) == "harness.session.spmd.pickle_arguments"
    # Imported by name on the ranks, unless pytest rewrote the module's asserts: it does so for the
    # modules of a plugin's distribution when the project is installed with its pytest11 entry
    # point (CI's torch legs), and the ranks then load the same rewritten file.
    assert function_name(pickle_arguments).module_file in (None, spmd.__file__)


def test_an_argument_that_cannot_be_pickled_is_named() -> None:
    name = function_name(pickle_arguments)
    with pytest.raises(TypeError, match=r"argument 1 of the SPMD call of .* \(a lock\) cannot be sent to the ranks"):
        pickle_arguments(name, (1, threading.Lock()), {})
    assert pickle.loads(pickle_arguments(name, (1,), {"x": 2})) == ((1,), {"x": 2})


def test_call_context_outside_a_call_says_where_it_works() -> None:
    with pytest.raises(RuntimeError, match=r"outside a parent-side SPMD call.*rank, world_size and device fixtures"):
        harness.call_context()


def test_no_world_under_torchrun_nor_without_the_device() -> None:
    with pytest.raises(pytest.skip.Exception, match="not exist under torchrun") as skipped:
        open_world(object(), 2)
    assert skipped.value.msg == UNDER_TORCHRUN
    lacking = PoolSession.__new__(PoolSession)
    lacking.options = SimpleNamespace(device="cuda")
    noted = []
    with pytest.raises(pytest.skip.Exception, match="needs 1000 GPUs"):
        open_world(lacking, 1000, noted.append)
    assert [plan.kind for plan in noted] == [None]
