"""Which device and communication backend a world of N ranks gets, and GPU reservations.

N ranks get N GPUs with NCCL when this machine has at least N visible GPUs; otherwise CPU with
gloo. A pool reserves any N GPUs that no other pool holds (machine-wide file locks), so pytest
sessions sharing a GPU runner run side by side; its ranks see only those GPUs
(CUDA_VISIBLE_DEVICES), so rank r's device is cuda:r whichever GPUs the pool got.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from filelock import FileLock, Timeout

DeviceKind = Literal["cpu", "cuda"]
DEVICE_CHOICES = ("auto", "cpu", "cuda")
LOCK_DIR_ENV = "FSDP_HARNESS_LOCK_DIR"


def default_lock_dir() -> str:
    """Where GPU reservations live: one place per machine, not per TMPDIR (sessions run with
    different TMPDIRs must still see each other's locks); `FSDP_HARNESS_LOCK_DIR` overrides it."""
    directory = os.environ.get(LOCK_DIR_ENV) or "/tmp/fsdp-harness-locks"
    if not os.path.isdir(directory):
        os.makedirs(directory, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(directory, 0o1777)  # every user's sessions reserve GPUs here; sticky: none deletes another's
    return directory


@dataclass(frozen=True)
class DevicePlan:
    kind: DeviceKind | None
    skip_reason: str = ""

    @property
    def comm_backend(self) -> str:
        return comm_backend(self.kind)


def comm_backend(kind: str | None) -> str:
    """The process group backend for a device kind: NCCL on CUDA, gloo on CPU."""
    return "nccl" if kind == "cuda" else "gloo"


def visible_gpu_count() -> int:
    """GPUs this process may use (counted without creating a CUDA context)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def visible_gpu_names(count: int) -> list[str]:
    """Machine-wide names of the visible GPUs in CUDA index order: CUDA_VISIBLE_DEVICES's entries
    (indices or UUIDs) when it is set, else 0..count-1. Reserving by these names keeps two sessions
    apart even when each sees the GPUs under other indices; each name is also what a rank's
    CUDA_VISIBLE_DEVICES lists for that GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(index) for index in range(count)]
    return [entry.strip() for entry in visible.split(",") if entry.strip()][:count]


def plan_devices(requested: str, world_size: int) -> DevicePlan:
    """Resolve `--device` for one world size; `kind=None` means the test must be skipped."""
    gpus = visible_gpu_count()
    if requested == "cpu":
        return DevicePlan("cpu")
    if requested == "cuda":
        if gpus >= world_size:
            return DevicePlan("cuda")
        return DevicePlan(None, f"needs {world_size} GPUs, found {gpus}")
    if requested == "auto":
        return DevicePlan("cuda" if gpus >= world_size else "cpu")
    raise ValueError(f"unknown device {requested!r}: use one of {', '.join(DEVICE_CHOICES)}")


def plan_world(requested: str, world_size: int, torchrun: tuple[int, int] | None = None) -> DevicePlan:
    """The one device decision of a session: what a world of `world_size` ranks gets.

    `torchrun` is (WORLD_SIZE, LOCAL_WORLD_SIZE) when torchrun launched this process: the world
    exists already, so only its own size can run, and GPUs are counted per node (a 2-node world
    of 8 ranks needs 4 GPUs on each node, not 8).
    """
    if torchrun is None:
        return plan_devices(requested, world_size)
    world, local_world = torchrun
    if world_size != world:
        return DevicePlan(None, f"needs world size {world_size}; this torchrun world has {world} ranks")
    return plan_devices(requested, local_world)


def device_kinds(requested: str, torchrun: tuple[int, int] | None = None) -> tuple[DeviceKind, ...]:
    """The device kinds worlds of a session may get for `--device requested`.

    `auto` gives CUDA to a world that fits on the visible GPUs and CPU to any larger one, so with
    GPUs it may use both; under torchrun there is one world, and its device.
    """
    if requested in ("cpu", "cuda"):
        return (requested,)  # type: ignore[return-value]
    if torchrun is not None:
        return (plan_world(requested, torchrun[0], torchrun).kind or "cpu",)
    return ("cuda", "cpu") if visible_gpu_count() else ("cpu",)


@dataclass(frozen=True)
class RunContext:
    """The world size and device the harness chose for one test (`harness.run_context`)."""

    world_size: int | None
    """None for a test without ranks (no `world_size` marker)."""
    device: DeviceKind | None
    """None when the test's world cannot have its devices here (it is skipped: too few GPUs)."""


@dataclass
class DeviceTally:
    """How many distributed tests of a session got their devices and how many could not, so a
    session where none could (`--device cuda` on a runner that lost its GPUs) is not green."""

    requested: str
    got: int = 0
    lacked: dict[str, int] = field(default_factory=dict)  # skip reason -> tests

    def note(self, plan: DevicePlan) -> None:
        if plan.kind is None:
            self.lacked[plan.skip_reason] = self.lacked.get(plan.skip_reason, 0) + 1
        else:
            self.got += 1

    def nothing_ran(self) -> str | None:
        """Why the session must fail, or None: only when tests needed devices and none got them."""
        if self.got or not self.lacked:
            return None
        reasons = "; ".join(f"{count} {reason}" for reason, count in self.lacked.items())
        return (
            f"harness: --device {self.requested}: no distributed test got its devices ({reasons}); "
            "nothing ran, so the run fails: run on a machine with the GPUs or pass --device cpu"
        )


def rank_device(kind: DeviceKind, local_rank: int) -> torch.device:
    return torch.device(f"cuda:{local_rank}") if kind == "cuda" else torch.device("cpu")


def join_world(device: torch.device, collective_timeout_s: float, **rendezvous: Any) -> None:
    """Initialise this rank's default process group on `device`: NCCL bound to its GPU (made the
    current device first, and passed as `device_id` so NCCL connects eagerly), gloo on CPU.

    `rendezvous`: how the ranks find each other (`store=`, `rank=`, `world_size=` for a pool's
    FileStore; `init_method="env://"` under torchrun), passed to `init_process_group` as is. A
    process that joined already (a torchrun script's own code before pytest) keeps its group; only
    the current device is set.
    """
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    if dist.is_initialized():
        return
    dist.init_process_group(
        comm_backend(device.type),
        timeout=timedelta(seconds=collective_timeout_s),
        **rendezvous,
        **kwargs,
    )


class GpuReservation:
    """Holds machine-wide file locks on `count` GPUs, any that are free, for as long as a pool uses them.

    All or nothing: GPUs are taken without waiting and given back at once unless `count` of them
    were free, then tried again, so two sessions that each hold some GPUs never wait for each other.
    `names` are the reserved GPUs (see `visible_gpu_names`), for the ranks' CUDA_VISIBLE_DEVICES.
    """

    def __init__(self, count: int, timeout_s: float = 600.0, poll_s: float = 0.5, lock_dir: str | None = None) -> None:
        candidates = visible_gpu_names(visible_gpu_count())
        if count > len(candidates):
            raise RuntimeError(f"a pool of {count} ranks needs {count} GPUs; {len(candidates)} are visible")
        self._lock_dir = lock_dir or default_lock_dir()
        os.makedirs(self._lock_dir, exist_ok=True)
        self._locks: list[FileLock] = []
        self.names: list[str] = []
        deadline = time.monotonic() + timeout_s
        while not self._take(candidates, count):
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"{count} of the {len(candidates)} visible GPUs ({', '.join(candidates)}) did not come free "
                    f"within {timeout_s:.0f} s: other pytest sessions hold them; wait, or run with --device cpu"
                )
            time.sleep(poll_s)

    def _take(self, candidates: list[str], count: int) -> bool:
        for name in candidates:
            lock = FileLock(os.path.join(self._lock_dir, f"gpu-{_lock_name(name)}.lock"), mode=0o666)
            try:
                lock.acquire(timeout=0)
            except Timeout:
                continue
            self._locks.append(lock)
            self.names.append(name)
            if len(self._locks) == count:
                return True
        self.release()
        return False

    def release(self) -> None:
        for lock in self._locks:
            lock.release()
        self._locks.clear()
        self.names.clear()


def _lock_name(gpu: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", gpu)
