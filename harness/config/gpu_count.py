"""How many GPUs this process may use, counted without asking the CUDA runtime here.

The pytest process forks the warm zygote (``harness.process.zygote_fork``), and torch marks
every fork of a process that asked the CUDA runtime anything as unable to use CUDA
(``harness.process.fork_probe``): ``torch.cuda.is_available()`` or ``device_count()`` in pytest
would leave every forked rank in a bad fork ("Cannot re-initialize CUDA in forked subprocess"
at its first ``set_device``). So the count comes, in this order, from:

- nothing at all where it is known: a torch without CUDA, or ``CUDA_VISIBLE_DEVICES`` empty;
- torch's own count where CUDA is initialised already (nothing left to protect);
- NVML (``torch.cuda._device_count_nvml``, honouring ``CUDA_VISIBLE_DEVICES``), which is not the
  CUDA runtime;
- else a short-lived child interpreter that asks the CUDA driver through ``ctypes`` (no torch
  import: milliseconds), with the same environment; no driver there means no usable GPU.

The count is kept per value of ``CUDA_VISIBLE_DEVICES`` for the life of the process.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import torch

_DRIVER_COUNT = r"""
import ctypes, sys
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError:
    print(0); sys.exit(0)
count = ctypes.c_int(0)
if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
    print(0); sys.exit(0)
print(count.value)
"""
_HIP_COUNT = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"


def visible_gpu_count() -> int:
    """GPUs this process may use, without marking its forks bad for CUDA."""
    return _count(os.environ.get("CUDA_VISIBLE_DEVICES"))


@functools.cache
def _count(visible: str | None) -> int:
    version = torch.version
    if not (getattr(version, "cuda", None) or getattr(version, "hip", None)):
        return 0  # a CPU build: no GPU, and nothing asked
    if visible is not None and visible.strip() in ("", "-1"):
        return 0
    if torch.cuda.is_initialized():
        return torch.cuda.device_count()  # the runtime was asked already; forks are marked anyway
    by_nvml = getattr(torch.cuda, "_device_count_nvml", None)
    if by_nvml is not None and not getattr(version, "hip", None):
        try:
            counted = int(by_nvml())
        except Exception:  # noqa: BLE001 - NVML absent or broken: ask the driver below
            counted = -1
        if counted >= 0:
            return counted
    return _count_in_child(_HIP_COUNT if getattr(version, "hip", None) else _DRIVER_COUNT)


def _count_in_child(code: str) -> int:
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=dict(os.environ)
        )
        return max(0, int(done.stdout.strip().splitlines()[-1]))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 0  # the child could not say: no GPU this session can count on
