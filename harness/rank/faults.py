"""Fault injection for scenarios and users, built on the collective trace (works with any backend).

Inject a fault into a collective that one rank issues: `at` matching collectives pass untouched
(counted from when the fault is armed), the next one is hit; `op` restricts the count to one op
(canonical names, see `harness.rank.tracing.KNOWN_OPS`). Descriptions number collectives from 1, like the
divergence report (`at=0` is "collective #1"):

    from harness import faults

    with faults.inject(rank=1, at=0, action="skip", op="all_reduce"):
        dist.all_reduce(t)            # rank 1 does not issue it: rank 0 hangs until the timeout

    faults.inject(rank=0, at=2, action="delay", seconds=1.5)   # armed until faults.clear()

    if faults.on_rank(1, "skips the optimizer step"):          # rank 1 takes another code path
        ...

Actions: "skip" (not issued; async callers get a completed Work; functional collectives cannot be
skipped), "delay" (sleep `seconds` before issuing), "corrupt" (add `delta` to the op's output tensors
after it completed), "raise" (raise `InjectedFault`), "exit" (`os._exit(exit_code)` without cleanup,
like a crashed rank), "hang" (sleep forever before issuing, like a stuck rank).

Every rank runs the same `inject`/`on_rank` calls (SPMD), so `active_faults()` returns the same
descriptions on every rank: the harness reads it to treat the test as "divergence expected".
`clear()` disarms everything and forgets the descriptions (the harness calls it between tests).
The collective a fault acts on carries the fault's description in its trace record.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from harness.rank import tracing

__all__ = ["ACTIONS", "Fault", "InjectedFault", "active_faults", "clear", "inject", "on_rank"]

ACTIONS = ("skip", "delay", "corrupt", "raise", "exit", "hang")


class InjectedFault(RuntimeError):
    """Raised on the faulty rank by the "raise" action."""


@dataclass
class Fault:
    """One armed fault; also a context manager that disarms it on exit."""

    rank: int
    at: int
    action: str
    op: str | None = None
    seconds: float = 0.0
    delta: float = 1.0
    exit_code: int = 1
    seen: int = field(default=0, init=False)
    fired: bool = field(default=False, init=False)

    def describe(self) -> str:
        counted = f"{self.op} collective" if self.op else "collective"
        detail = {
            "delay": f" by {self.seconds:g}s",
            "corrupt": f" (output += {self.delta:g})",
            "exit": f" (exit code {self.exit_code})",
        }.get(self.action, "")
        return f"rank {self.rank}: {self.action} {counted} #{self.at + 1}{detail}"

    def __enter__(self) -> Fault:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _disarm(self)

    def _runner(self, record: tracing.CollectiveRecord) -> tracing.Runner:
        record.fault = self.describe()
        if self.action == "skip":
            record.skipped = True
            return lambda call: call.skipped_result()
        if self.action == "delay":
            return self._delayed
        if self.action == "corrupt":
            return self._corrupted
        if self.action == "raise":
            return self._raise
        if self.action == "exit":
            return self._exit
        return self._hang

    def _delayed(self, call: tracing.CollectiveCall) -> Any:
        time.sleep(self.seconds)
        return call.issue()

    def _corrupted(self, call: tracing.CollectiveCall) -> Any:
        result = call.issue()
        outputs = call.output_tensors(result)
        if not outputs:
            raise ValueError(
                f"cannot corrupt {call.record.op}: it has no output tensors "
                f"(fault {self.describe()!r}); pick a tensor collective with op=..."
            )
        with torch.no_grad():
            for tensor in outputs:
                tensor.add_(self.delta)
        return result

    def _raise(self, call: tracing.CollectiveCall) -> Any:
        raise InjectedFault(f"injected fault: {self.describe()} ({call.record.op} [{call.record.label}])")

    def _exit(self, call: tracing.CollectiveCall) -> Any:
        os._exit(self.exit_code)

    def _hang(self, call: tracing.CollectiveCall) -> Any:
        while True:
            time.sleep(3600)


_lock = threading.Lock()
_armed: list[Fault] = []
_descriptions: list[str] = []


def inject(
    *,
    rank: int,
    at: int,
    action: str,
    op: str | None = None,
    seconds: float = 0.0,
    delta: float = 1.0,
    exit_code: int = 1,
) -> Fault:
    """Arm a fault on the collective `rank` issues after `at` matching ones (only `op` ones count if given).

    Call it on every rank. Returns the armed `Fault`; use it with `with` to disarm it on exit,
    otherwise it stays armed until it fires once or `clear()` is called.
    """
    if action not in ACTIONS:
        raise ValueError(f"unknown fault action {action!r}; use one of {', '.join(ACTIONS)}")
    if op is not None and op not in tracing.KNOWN_OPS:
        raise ValueError(
            f"unknown op {op!r}; use a canonical name such as 'all_reduce', "
            f"'all_gather_into_tensor' (see harness.rank.tracing.KNOWN_OPS)"
        )
    if at < 0 or rank < 0:
        raise ValueError(f"rank and at must be >= 0, got rank={rank}, at={at}")
    if action == "delay" and seconds <= 0:
        raise ValueError("action 'delay' needs seconds > 0")
    fault = Fault(rank=rank, at=at, action=action, op=op, seconds=seconds, delta=delta, exit_code=exit_code)
    tracing.install()
    with _lock:
        _armed.append(fault)
        _descriptions.append(fault.describe())
        tracing.set_interceptor(_intercept)
    return fault


def on_rank(rank: int, why: str = "takes another code path") -> bool:
    """True on `rank` only; records that this test makes ranks diverge on purpose."""
    if not dist.is_initialized():
        raise RuntimeError("faults.on_rank needs an initialised default process group")
    description = f"rank {rank}: {why}"
    with _lock:
        if description not in _descriptions:
            _descriptions.append(description)
    return dist.get_rank() == rank


def active_faults() -> list[str]:
    """Descriptions of the faults injected (armed or fired) and code paths diverged since `clear()`."""
    with _lock:
        return list(_descriptions)


def clear() -> None:
    """Disarm every fault and forget the descriptions."""
    with _lock:
        _armed.clear()
        _descriptions.clear()
        tracing.set_interceptor(None)


def _disarm(fault: Fault) -> None:
    with _lock:
        if fault in _armed:
            _armed.remove(fault)
        if not _armed:
            tracing.set_interceptor(None)


def _intercept(record: tracing.CollectiveRecord) -> tracing.Runner | None:
    """Count this collective for every armed fault of this rank; fire the first one that is due."""
    due: Fault | None = None
    with _lock:
        for fault in list(_armed):
            if fault.rank != record.rank or (fault.op is not None and fault.op != record.op):
                continue
            if fault.seen < fault.at:
                fault.seen += 1
            elif due is None:
                due = fault
                fault.fired = True
                _armed.remove(fault)
            # else: due too, but one fault per collective; it acts on the next matching one
        if not _armed:
            tracing.set_interceptor(None)
    return due._runner(record) if due is not None else None
