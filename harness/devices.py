"""Which device and communication backend a world of N ranks gets, and GPU reservations.

N ranks get cuda:0..N-1 with NCCL when this machine has at least N GPUs; otherwise CPU with
gloo. GPUs are reserved with machine-wide file locks so two pytest sessions never share one.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Literal

import torch
from filelock import FileLock, Timeout

DeviceKind = Literal["cpu", "cuda"]
DEVICE_CHOICES = ("auto", "cpu", "cuda")
LOCK_DIR_ENV = "FSDP_HARNESS_LOCK_DIR"


def lock_dir() -> str:
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
        return "nccl" if self.kind == "cuda" else "gloo"


def plan_devices(requested: str, world_size: int) -> DevicePlan:
    """Resolve `--device` for one world size; `kind=None` means the test must be skipped."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "cpu":
        return DevicePlan("cpu")
    if requested == "cuda":
        if gpus >= world_size:
            return DevicePlan("cuda")
        return DevicePlan(None, f"needs {world_size} GPUs, found {gpus}")
    if requested == "auto":
        return DevicePlan("cuda" if gpus >= world_size else "cpu")
    raise ValueError(f"unknown device {requested!r}: use one of {', '.join(DEVICE_CHOICES)}")


def rank_device(kind: DeviceKind, local_rank: int) -> torch.device:
    return torch.device(f"cuda:{local_rank}") if kind == "cuda" else torch.device("cpu")


class GpuReservation:
    """Holds file locks on GPUs 0..n-1 for as long as a pool uses them."""

    def __init__(self, count: int, timeout_s: float = 600.0) -> None:
        directory = lock_dir()
        self._locks: list[FileLock] = []
        try:
            for index in range(count):
                lock = FileLock(os.path.join(directory, f"gpu-{index}.lock"), mode=0o666)
                lock.acquire(timeout=timeout_s)
                self._locks.append(lock)
        except Timeout:
            self.release()
            raise RuntimeError(
                f"GPU {len(self._locks)} stayed reserved by another pytest session for "
                f"{timeout_s:.0f} s; wait for it to finish or run with --device cpu"
            ) from None

    def release(self) -> None:
        for lock in self._locks:
            lock.release()
        self._locks.clear()
