"""Warm ranks are reused, yet each test starts from the state a fresh process would give it."""

from __future__ import annotations

import ast
import gc
import os
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import harness
from harness.rank.device_state import HAS_PRECISION_API
from harness.rank.isolation import GLOO_DESTRUCTOR_HOLDS_GIL
from harness.rank.worker import LEAKED_GROUP_LIMIT


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _sharding_cache_use() -> tuple[int, int]:
    """(hits, misses) of DTensor's sharding-propagation cache since it was last cleared.

    The C++ fast path serves every op on the torch versions that have it; older ones use the
    Python LRU cache.
    """
    stats = getattr(torch._C, "_get_DTensor_sharding_propagator_cache_stats", None)
    if stats is not None:
        return tuple(stats())
    from torch.distributed.tensor import DTensor

    info = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_info()
    return info.hits, info.misses


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("isolation")


@pytest.mark.world_size(2)
@pytest.mark.fresh_groups  # its group is destroyed after it, not kept (tests/harness_tests/test_group_reuse.py)
def test_1_dirty_every_kind_of_state(rank: int, shared_dir: Path) -> None:
    (shared_dir / f"pid-{rank}").write_text(str(os.getpid()))
    (shared_dir / f"seeded-{rank}").write_text(repr(torch.rand(3).tolist()))
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    os.environ["HARNESS_ISOLATION_PROBE"] = "1"
    (shared_dir / f"threads-{rank}").write_text(str(_threads()))
    group = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(1), group=group)
    # Garbage in a reference cycle that holds the group: refcounting alone never frees it.
    holder = types.SimpleNamespace(group=group)
    holder.itself = holder
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,))
    from torch.distributed.tensor import Shard, distribute_tensor

    sharded = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    for _ in range(2):
        assert torch.equal((sharded @ sharded).full_tensor(), torch.full((4, 4), 4.0))
    (shared_dir / f"sharding-cache-{rank}").write_text(repr(_sharding_cache_use()))
    # torch's device settings, as meta-device initialisation and numerics tests change them.
    if HAS_PRECISION_API:  # one API per test: torch refuses to read a mix of the two
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    else:
        torch.set_float32_matmul_precision("medium")
        torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    torch.set_default_device("meta")
    warnings.simplefilter("error")  # last: torch 2.6 warns in distribute_tensor on a CPU mesh
    os.chdir(shared_dir)


@pytest.mark.world_size(2)
def test_2_state_is_back_to_fresh(rank: int, shared_dir: Path) -> None:
    assert (shared_dir / f"pid-{rank}").read_text() == str(os.getpid()), "the warm rank was not reused"
    assert repr(torch.rand(3).tolist()) == (shared_dir / f"seeded-{rank}").read_text()
    assert torch.get_default_dtype() == torch.float32
    assert torch.empty(1).device.type == "cpu", "the default device the last test set is still on"
    if HAS_PRECISION_API:
        assert torch.backends.cuda.matmul.fp32_precision == "none"
        assert torch.backends.mkldnn.matmul.fp32_precision == "none"
    else:
        assert torch.get_float32_matmul_precision() == "highest"
        assert not torch.backends.cuda.matmul.allow_tf32
    assert not torch.backends.cudnn.benchmark
    assert torch.is_grad_enabled()
    assert dist.get_debug_level() == dist.DebugLevel.OFF
    warnings.warn("must not raise", UserWarning, stacklevel=1)
    assert "HARNESS_ISOLATION_PROBE" not in os.environ
    assert os.getcwd() != str(shared_dir)
    assert len(torch.distributed.distributed_c10d._world.pg_map) == 1  # only the default group is left
    # ... and the destroyed group is freed, with its backend's threads (gloo: a loop and two workers).
    assert _threads() == int((shared_dir / f"threads-{rank}").read_text())
    # DTensor's sharding decisions (cached per mesh) are forgotten with the mesh.
    hits, misses = ast.literal_eval((shared_dir / f"sharding-cache-{rank}").read_text())
    assert hits > 0 and misses > 0
    assert _sharding_cache_use() == (0, 0)
    group = dist.new_group([0, 1])  # group creation still works after the cleanup
    tensor = torch.ones(1)
    dist.all_reduce(tensor, group=group)
    assert tensor.item() == 2


@pytest.mark.world_size(2)
def test_3_same_seed_on_every_rank_unless_asked(rank: int, world_size: int) -> None:
    gathered = [torch.empty(4) for _ in range(world_size)]
    dist.all_gather(gathered, torch.rand(4))
    assert torch.equal(gathered[0], gathered[1])
    assert harness.rank_seed() != harness.rank_seed() - 1000 * rank or rank == 0
    torch.manual_seed(harness.rank_seed())
    dist.all_gather(gathered, torch.rand(4))
    assert not torch.equal(gathered[0], gathered[1])


@pytest.mark.world_size(2)
@pytest.mark.fresh_world
def test_4_fresh_world_gets_new_processes(rank: int, shared_dir: Path) -> None:
    assert (shared_dir / f"pid-{rank}").read_text() != str(os.getpid())
    # A new rank's first test: what it inherited from the zygote (torch and the preloaded
    # modules) is frozen, so its collections never traverse, and so never copy, that heap. (Where
    # the zygote cannot fork, on torch 2.6 whose preloads start a thread, ranks are spawned.)
    with open("/proc/self/cmdline", "rb") as handle:  # a spawned worker runs `-m harness.rank.worker`
        forked = b"harness.rank.worker" not in handle.read()
    assert gc.get_freeze_count() > 100_000 or not forked, gc.get_freeze_count()


# Groups test_5 keeps alive on purpose (a backend whose objects outlive their test does this).
_KEPT: list[dist.ProcessGroup] = []


# Where destroyed groups are released when the next test starts, a leak is seen a test later.
_LEAK_SEEN_AFTER = 1 if GLOO_DESTRUCTOR_HOLDS_GIL else 0


@pytest.mark.world_size(2)
@pytest.mark.fresh_groups  # kept for reuse, its groups would not be destroyed, so never leaked
@pytest.mark.parametrize(
    "index", [pytest.param(0, marks=pytest.mark.fresh_world), *range(1, LEAKED_GROUP_LIMIT + 2 + _LEAK_SEEN_AFTER)]
)
def test_5_leaked_groups_are_bounded_by_replacing_the_rank(rank: int, index: int, shared_dir: Path) -> None:
    """Index 0 leaves fresh ranks behind (no earlier test's leaks); 1..LIMIT each leak a group on
    the same ranks; once LIMIT are held the ranks are replaced, which index LIMIT+1 sees (one
    index later on a torch whose groups are released a test late)."""
    recorded = shared_dir / f"leak-pid-{rank}"
    if index == 0:
        return
    if index == 1:
        recorded.write_text(str(os.getpid()))
    if index <= LEAKED_GROUP_LIMIT + _LEAK_SEEN_AFTER:
        assert recorded.read_text() == str(os.getpid()), f"replaced after {index - 1} leaked groups"
        if index <= LEAKED_GROUP_LIMIT:
            group = dist.new_group([0, 1])
            dist.all_reduce(torch.ones(1), group=group)
            _KEPT.append(group)
    else:
        assert recorded.read_text() != str(os.getpid()), f"still the same rank after {LEAKED_GROUP_LIMIT} leaked groups"
        assert not _KEPT


@pytest.mark.world_size([1, 2])
@pytest.mark.parametrize("label", ["a", "b"])
def test_parametrize_and_world_size_lists_combine(rank: int, world_size: int, device: torch.device, label: str) -> None:
    assert label in ("a", "b")
    assert dist.get_world_size() == world_size and dist.get_rank() == rank
    assert device.type in ("cpu", "cuda")


class TestClassesWork:
    @pytest.mark.world_size(2)
    def test_method(self, rank: int) -> None:
        assert isinstance(self, TestClassesWork)
        assert rank in (0, 1)


@pytest.mark.world_size(2)
def test_skip_on_every_rank_is_a_skip(rank: int) -> None:
    pytest.skip("unsupported: demo capability")


def test_a_sticky_cuda_error_makes_the_rank_unusable() -> None:
    """Simulated (no GPU here): after a device-side assert every CUDA call fails, synchronize
    included; the test's exit says why the rank cannot run another test, so the pool replaces it
    (the reason travels as the outcome's replace_reason, as for a destroyed default group).

    A stand-in for torch.cuda, not torch.cuda patched: on a CUDA build the real device_count or
    memory_allocated in this (pytest's) process would ask the CUDA runtime, and torch would mark
    every later fork, the warm zygote's included, unable to use CUDA."""
    from types import SimpleNamespace

    from harness.rank import device_state

    def sticky() -> None:
        raise RuntimeError("CUDA error: device-side assert triggered\nCUDA kernel errors might be ...")

    cuda = SimpleNamespace(
        is_initialized=lambda: True,
        current_device=lambda: 0,
        device_count=lambda: 1,
        memory_allocated=lambda index: 0,
        synchronize=sticky,
    )
    state = device_state.CudaState(cuda, tensor_device="cpu")
    state.enter()
    assert state.exit() == (
        "a CUDA error left this rank unable to use its GPU (CUDA error: device-side assert triggered): "
        "the rank is replaced"
    )
    cuda.is_initialized = lambda: False
    assert state.exit() == ""  # a rank that never used CUDA has nothing to check


# A test's leak: a module-level cache that keeps a device tensor alive after the test.
LEAKED_CACHE: dict[str, torch.Tensor] = {}


def test_device_memory_a_test_leaves_allocated_is_reported_with_its_size_and_holder() -> None:
    """Simulated (no GPU here): a stand-in for torch.cuda whose allocator count grows by 4 MiB during
    the test, and the rank's tensors on the CPU standing for device tensors. The note names the
    device, the growth, and the largest live tensors with the global that holds them; a test that
    left nothing allocated gets no note, nor does a rank that never initialised CUDA."""
    from types import SimpleNamespace

    from harness.rank import device_state

    allocated = {0: 1 << 20}
    cuda = SimpleNamespace(
        is_initialized=lambda: True,
        current_device=lambda: 0,
        device_count=lambda: 1,
        memory_allocated=lambda index: allocated[index],
    )
    state = device_state.CudaState(cuda, tensor_device="cpu")
    state.enter()
    assert state.leaked_memory() == ""
    LEAKED_CACHE["activations"] = torch.empty(1024, 1024, dtype=torch.float32)  # 4 MiB, the largest
    allocated[0] += 4 << 20
    note = state.leaked_memory()
    assert note.startswith(
        "the test left device memory allocated: cuda:0 4.0 MiB (1.0 MiB before the test, 5.0 MiB after)"
    ), note
    assert "(1024, 1024) float32 (4.0 MiB) held by " + __name__ + ".LEAKED_CACHE" in note, note
    LEAKED_CACHE.clear()
    cuda.is_initialized = lambda: False
    assert state.leaked_memory() == ""
