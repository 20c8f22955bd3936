"""No self-test asks the CUDA runtime in pytest's own process: found on CPU, before a GPU runner.

On a CUDA build of torch, a process that asked the CUDA runtime anything (`torch.cuda.is_available`,
`device_count` where NVML cannot answer, `memory_allocated`, ...) is marked so that every later
fork of it is unable to use CUDA; pytest's process forks the warm zygote, so one such call in a
self-test turns every later zygote start into a refusal and fails the zygote tests (CI's torch
2.14.1 leg found one: a test that patched `torch.cuda.is_initialized` to True, after which the
harness's device-memory check called the real `device_count`). On the CPU wheel those calls
return at once and mark nothing, so nothing shows here: this guard makes them visible.

`install()` replaces the asking functions of `torch.cuda` for the life of the session with ones
that call the original and, in pytest's own process and while CUDA is really uninitialised, note
the call with where it came from; each phase of each test (`check`) fails when it made one,
naming the call and the fix. A fork (zygote, ranks) inherits the wrappers but notes nothing.
"""

from __future__ import annotations

import functools
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch

ASKING = (
    "is_available",
    "device_count",
    "current_device",
    "memory_allocated",
    "memory_reserved",
    "synchronize",
    "get_device_properties",
    "get_device_name",
    "get_device_capability",
    "mem_get_info",
    "set_device",
    "init",
    "_lazy_init",
)
"""The `torch.cuda` functions that ask the runtime unless CUDA is initialised already (on a CUDA build)."""

_calls: list[str] = []
_process: list[int] = []


def install() -> None:
    """Wrap the asking functions, once, in this (pytest's) process."""
    if _process:
        return
    _process.append(os.getpid())
    for name in ASKING:
        original = getattr(torch.cuda, name, None)
        if original is not None:
            setattr(torch.cuda, name, _noting(name, original))
    if hasattr(torch._C, "_cuda_getDeviceCount"):  # a CUDA build: what is_available() itself calls
        torch._C._cuda_getDeviceCount = _noting("_C._cuda_getDeviceCount", torch._C._cuda_getDeviceCount)


def _noting(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def noted(*args: Any, **kwargs: Any) -> Any:
        # torch.cuda._initialized, not is_initialized(): tests patch the latter to simulate a GPU.
        if os.getpid() == _process[0] and not getattr(torch.cuda, "_initialized", False):
            caller = traceback.extract_stack(limit=2)[0]
            where = "torch." if name.startswith("_C") else "torch.cuda."
            _calls.append(f"{where}{name}() at {caller.filename}:{caller.lineno}")
        return original(*args, **kwargs)

    return noted


def check(phase: str) -> None:
    """Fail the test phase that asked the CUDA runtime in pytest's process (and forget its calls)."""
    calls, _calls[:] = list(_calls), []
    if calls:
        raise AssertionError(
            f"the test's {phase} asked the CUDA runtime in pytest's own process ({'; '.join(dict.fromkeys(calls))}): "
            "on a CUDA build torch then marks every later fork, the warm zygote's included, unable to use CUDA. "
            "Count GPUs with harness.config.gpu_count.visible_gpu_count(), or simulate a GPU with a stand-in "
            "for torch.cuda (see tests/harness_tests/test_isolation.py) instead of patching torch.cuda"
        )


def forget() -> None:
    _calls.clear()
