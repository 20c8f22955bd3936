"""The rank environment contract: every warm rank sees torchrun's variables with its own values,
libraries that need them start, and a CUDA pool's ranks see exactly the GPUs it reserved."""

from __future__ import annotations

import os
import subprocess
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from conftest import InnerSession
from harness.config import devices
from harness.process import rank_env
from harness.process.gpu_locks import GpuReservation
from harness.process.rank_env import LOOPBACK_ADDR, TORCHRUN_VARIABLES, AgentStore, loopback_interface, rank_environment
from tests.support.warm_pytest import run_pytest

TESTS = """
import os
from datetime import timedelta

import pytest
import torch.distributed as dist

CONTRACT = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

@pytest.mark.world_size([1, 3])
def test_a_torchrun_variables(rank, world_size):
    env = {name: os.environ.get(name) for name in CONTRACT}
    print(env)
    assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
    assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == str(world_size)
    assert env["MASTER_ADDR"] == "127.0.0.1"
    # MASTER_ADDR:MASTER_PORT is a live store, as torchrun's agent store is: every rank checks in.
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=60))
    store.add("checked-in", 1)
    dist.barrier()
    assert int(store.get("checked-in")) == world_size
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert "LOCAL_SIZE" not in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["EXPECTED_LOOPBACK"]
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"  # the user's value is kept
    os.environ["RANK"] = "99"  # a test that changes them does not change them for the next
    del os.environ["LOCAL_RANK"]

@pytest.mark.world_size([1, 3])
def test_b_next_test_sees_its_own_values_again(rank):
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"]) == (str(rank), str(rank))
"""

DEEPSPEED_TEST = """
import pytest, torch

@pytest.mark.world_size(2)
def test_deepspeed_engine_starts_without_help(rank):
    import deepspeed  # asserts LOCAL_RANK when it builds the engine
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    # Not what this proves: on CPU, DeepSpeed's first initialize JIT-compiles a shared-memory
    # all-reduce op (a minute or more without a build cache, past the test deadline on a loaded
    # 2-core machine). Marked absent, as the deepspeed adapter does; LOCAL_RANK is still asserted.
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False
    model = torch.nn.Linear(4, 4)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}},
    )
    assert engine.local_rank == rank
    engine.backward(engine(torch.ones(1, 4)).sum())
    engine.step()
"""


def _run(inner: InnerSession, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """The session with extra variables, forked from the warm interpreter like `InnerSession.run`:
    the variables here are read by the ranks (the zygote is a fresh process with this environment)
    and by DeepSpeed at its import in a rank, never by the session's own torch import."""
    return run_pytest(inner.command(*args), cwd=inner.directory, env={**inner.env(), **env}, timeout=600)


def test_every_rank_sees_the_torchrun_variables(inner: InnerSession) -> None:
    inner.write("test_env.py", TESTS)
    env = {
        "LOCAL_SIZE": "7",  # would switch DeepSpeed to a shared-memory all-reduce: not passed on
        "GLOO_SOCKET_IFNAME": "no-such-interface",  # a one-host pool binds to loopback regardless
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "EXPECTED_LOOPBACK": loopback_interface(),
    }
    result = _run(inner, env, "-q", "-rA")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 passed" in result.stdout
    for rank in range(3):  # each rank's own values, as printed by the rank
        assert f"'RANK': '{rank}', 'LOCAL_RANK': '{rank}', 'WORLD_SIZE': '3'" in result.stdout


def test_a_library_that_asserts_local_rank_starts(inner: InnerSession) -> None:
    pytest.importorskip("deepspeed", reason="the DeepSpeed proof needs deepspeed installed")
    inner.write("test_ds.py", DEEPSPEED_TEST)
    result = _run(inner, {"DS_ACCELERATOR": "cpu"}, "-q")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout


def test_rank_environment_names_the_reserved_gpus() -> None:
    base = {"PATH": "/bin", "TORCHELASTIC_RUN_ID": "outer", "LOCAL_SIZE": "2", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    env = rank_environment(base, rank=1, world_size=2, master_port=1234, cuda_devices=["3", "GPU-5f2e"])
    assert {name: env[name] for name in TORCHRUN_VARIABLES} == {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1234",
    }
    # cuda:{LOCAL_RANK} = cuda:1 is the second reserved GPU, whatever its machine-wide name.
    assert env["CUDA_VISIBLE_DEVICES"] == "3,GPU-5f2e"
    assert "TORCHELASTIC_RUN_ID" not in env and "LOCAL_SIZE" not in env and env["PATH"] == "/bin"
    assert rank_environment(base, rank=0, world_size=1, master_port=1)["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


@pytest.fixture
def four_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend four GPUs are visible, under the names CUDA_VISIBLE_DEVICES gives them."""
    monkeypatch.setattr(devices, "visible_gpu_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,GPU-aa,GPU-bb")


def test_pools_reserve_any_free_gpus(four_gpus: None, tmp_path: os.PathLike[str]) -> None:
    lock_dir = str(tmp_path)
    first = GpuReservation(2, lock_dir=lock_dir)
    second = GpuReservation(2, lock_dir=lock_dir)  # not 0..1 again: the two that are free
    assert (first.names, second.names) == (["3", "5"], ["GPU-aa", "GPU-bb"])
    with pytest.raises(RuntimeError, match=r"1 of the 4 visible GPUs \(3, 5, GPU-aa, GPU-bb\) did not come free"):
        GpuReservation(1, timeout_s=0.3, poll_s=0.1, lock_dir=lock_dir)
    first.release()
    # All or nothing: three are wanted, two are free; it gives back what it took while it waits.
    with pytest.raises(RuntimeError, match="3 of the 4"):
        GpuReservation(3, timeout_s=0.3, poll_s=0.1, lock_dir=lock_dir)
    third = GpuReservation(2, lock_dir=lock_dir)
    assert third.names == ["3", "5"]
    with pytest.raises(RuntimeError, match="a pool of 5 ranks needs 5 GPUs; 4 are visible"):
        GpuReservation(5, lock_dir=lock_dir)
    second.release()
    third.release()


# -- the agent store: built on every supported torch, and a failure fails the test ------------------


def _built(store: AgentStore) -> AgentStore:
    store._thread.join(timeout=60)
    assert not store._thread.is_alive(), "the store was not built within 60 s"
    return store


def test_agent_store_serves_on_this_torch() -> None:
    store = _built(AgentStore())
    try:
        assert store.failure is None
        client = dist.TCPStore(LOOPBACK_ADDR, store.port, is_master=False, timeout=timedelta(seconds=30))
        client.set("key", "value")
        assert client.get("key") == b"value"
    finally:
        store.close()


def test_agent_store_falls_back_when_the_store_refuses_the_listening_fd(monkeypatch: pytest.MonkeyPatch) -> None:
    # What torch 2.6's libuv server does with master_listen_fd; the older server takes the fd.
    calls: list[dict[str, object]] = []
    real = dist.TCPStore

    def libuv_refuses_fds(*args: object, **kwargs: object) -> dist.TCPStore:
        calls.append(kwargs)
        if "master_listen_fd" in kwargs and kwargs.get("use_libuv", True):
            raise NotImplementedError("The libuv TCPStore backend does not support initialization with an listen fd")
        return real(*args, **kwargs)

    monkeypatch.setattr(rank_env.dist, "TCPStore", libuv_refuses_fds)
    store = _built(AgentStore())
    try:
        assert store.failure is None and store._store is not None
        assert [call.get("use_libuv", True) for call in calls] == [True, False]
    finally:
        store.close()


def test_agent_store_failure_is_kept_not_raised_in_its_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_store(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no store today")

    escaped: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda hook_args: escaped.append(hook_args.exc_value))
    monkeypatch.setattr(rank_env.dist, "TCPStore", no_store)
    store = _built(AgentStore())
    assert store.failure == "RuntimeError: no store today"
    assert escaped == []
    store.close()


STORE_FAILS_CONFTEST = """
import harness.process.rank_env as rank_env

def _no_store(listener, port):
    raise RuntimeError("injected: this torch cannot build the store")

rank_env._listening_store = _no_store
"""


def test_a_store_failure_fails_the_test_as_a_harness_error(inner: InnerSession) -> None:
    inner.write("conftest.py", STORE_FAILS_CONFTEST)
    inner.write("test_store.py", "import pytest\n\n@pytest.mark.world_size(1)\ndef test_passes(rank):\n    pass\n")
    result = inner.run("-q")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 failed" in result.stdout
    assert "harness error: the store behind MASTER_ADDR:MASTER_PORT" in result.stdout
    assert "RuntimeError: injected: this torch cannot build the store" in result.stdout


def test_a_cuda_pool_records_its_collectives_for_the_watchdog_and_a_cpu_pool_does_not() -> None:
    """An NCCL watchdog timeout leaves nothing to read unless Flight Recorder was on from the
    start: a CUDA pool's ranks get it (the user's own values kept), a CPU pool's nothing new."""
    from harness.process.rank_env import FLIGHT_RECORDER_DEFAULTS, rank_environment

    cuda = rank_environment(
        {"TORCH_FR_BUFFER_SIZE": "50"}, rank=1, world_size=2, master_port=1, cuda_devices=["3", "5"]
    )
    assert cuda["CUDA_VISIBLE_DEVICES"] == "3,5"
    assert cuda["TORCH_FR_BUFFER_SIZE"] == "50"  # the user's
    assert cuda["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000" and cuda["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    cpu = rank_environment({}, rank=1, world_size=2, master_port=1)
    assert not set(FLIGHT_RECORDER_DEFAULTS) & set(cpu)
