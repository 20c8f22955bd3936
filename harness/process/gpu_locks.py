"""GPU reservations: which of this machine's GPUs a pool may give its ranks.

A pool reserves any N GPUs that no other pool holds, with machine-wide file locks, so pytest
sessions sharing a GPU runner run side by side; its ranks see only those GPUs
(CUDA_VISIBLE_DEVICES, `harness.process.rank_env`), so rank r's device is cuda:r whichever GPUs
the pool got. Whether a world gets GPUs at all is the device decision (`harness.config.devices`).
"""

from __future__ import annotations

import contextlib
import os
import re
import time

from filelock import FileLock, Timeout

from harness.config import devices

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


def visible_gpu_names(count: int) -> list[str]:
    """Machine-wide names of the visible GPUs in CUDA index order: CUDA_VISIBLE_DEVICES's entries
    (indices or UUIDs) when it is set, else 0..count-1. Reserving by these names keeps two sessions
    apart even when each sees the GPUs under other indices; each name is also what a rank's
    CUDA_VISIBLE_DEVICES lists for that GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(index) for index in range(count)]
    return [entry.strip() for entry in visible.split(",") if entry.strip()][:count]


class GpuReservation:
    """Holds machine-wide file locks on `count` GPUs, any that are free, for as long as a pool uses them.

    All or nothing: GPUs are taken without waiting and given back at once unless `count` of them
    were free, then tried again, so two sessions that each hold some GPUs never wait for each other.
    `names` are the reserved GPUs (see `visible_gpu_names`), for the ranks' CUDA_VISIBLE_DEVICES.
    """

    def __init__(self, count: int, timeout_s: float = 600.0, poll_s: float = 0.5, lock_dir: str | None = None) -> None:
        candidates = visible_gpu_names(devices.visible_gpu_count())
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
