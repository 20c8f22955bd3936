"""An adapter built away from pytest to ask what it declares on a device kind: in a forked child.

The session gate (``conformance.suite.gate``) must know, before any rank exists, whether a backend
has an API form on each device kind this session's worlds may get; ``capabilities()`` may depend
on the device, so the adapter is built as a rank would build it. Built in pytest itself, it would
import its library there (the ranks are forked from pytest, through the zygote, and would inherit
it) and, for a library that fixes its device at first import (DeepSpeed's accelerator), the
second kind of a ``--device auto`` session on a GPU runner would fail against the first. So each
kind is asked of a child forked for it: the child builds, asks, closes and exits; pytest imports
nothing of the library and keeps nothing the adapter installed (a patched function, an
environment variable). A child that raises, dies or hangs is the adapter's failure, with its cause.

Where pytest has more than one thread a fork is not safe (a lock another thread holds stays
held in the child); the adapter is then built in pytest as before, its environment put back.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import time

import torch

from conformance.protocol import ApiForm, BackendAdapter, BackendEnv

DEADLINE_S = 300.0
"""How long a child may take to import the library and build the adapter (DeepSpeed: seconds)."""


class ProbeFailed(RuntimeError):
    """The adapter could not be built or asked on that device kind; the message says how it failed."""


def forms_on(adapter_cls: type[BackendAdapter], device_kind: str) -> list[ApiForm]:
    """The API forms ``adapter_cls`` has as rank 0 of a world of one on ``device_kind``."""
    if _threads() == 1 and hasattr(os, "fork"):
        return _in_child(adapter_cls, device_kind)
    return _here(adapter_cls, device_kind)


def _build_and_ask(adapter_cls: type[BackendAdapter], device_kind: str) -> list[ApiForm]:
    adapter = adapter_cls(BackendEnv(rank=0, world_size=1, device=torch.device(device_kind), local_rank=0))
    try:
        return list(adapter.forms())
    finally:
        adapter.close()


def _here(adapter_cls: type[BackendAdapter], device_kind: str) -> list[ApiForm]:
    saved = dict(os.environ)  # a constructor may set the environment (libraries read torchrun's)
    try:
        return _build_and_ask(adapter_cls, device_kind)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _in_child(adapter_cls: type[BackendAdapter], device_kind: str) -> list[ApiForm]:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child answers and leaves without pytest's cleanup
        os.close(read_end)
        try:
            try:
                answer: tuple = ("forms", [form.value for form in _build_and_ask(adapter_cls, device_kind)])
            except BaseException as error:  # noqa: BLE001 - every failure is the adapter's answer
                answer = ("raised", type(error).__name__, str(error))
            data = pickle.dumps(answer)
            while data:
                data = data[os.write(write_end, data) :]
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        data = _read_all(read_end, pid)
    finally:
        os.close(read_end)
    _, status = os.waitpid(pid, 0)
    if not data:
        how = (
            f"died by signal {signal.Signals(-os.waitstatus_to_exitcode(status)).name}"
            if os.WIFSIGNALED(status)
            else f"exited with status {os.waitstatus_to_exitcode(status)}"
        )
        raise ProbeFailed(f"the child that built it {how} before answering")
    answer = pickle.loads(data)
    if answer[0] == "raised":
        raise ProbeFailed(f"{answer[1]}: {answer[2]}")
    return [ApiForm(value) for value in answer[1]]


def _read_all(fd: int, pid: int) -> bytes:
    chunks: list[bytes] = []
    deadline = time.monotonic() + DEADLINE_S
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            os.kill(pid, signal.SIGKILL)
            raise ProbeFailed(f"building it did not finish within {DEADLINE_S:.0f} s (the child was killed)")
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 2  # cannot tell: do not fork
