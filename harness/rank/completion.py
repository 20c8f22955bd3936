"""When a traced collective has completed: observed from its work, not assumed when the call returns.

A collective's "done" line (`harness.trace.records.done_line`) is what the one-sided watch, the
"unfinished collectives" report and the pool's reuse rule read. A synchronous call has completed
when it returns (torch waits on its work before returning). An asynchronous one has not: gloo runs
it on a worker thread and NCCL on a stream, and the caller waits later, or never. So:

  * a call that returned a `Work` (async_op=True, or a collective torch's C++ issued, such as DDP's
    bucket all-reduce) is done when the work says so. A daemon thread polls the pending works
    (`_POLL_S`; `_Poller`: one thread per process, never woken per collective). On NCCL
    `Work.is_completed()` queries the CUDA event recorded after the kernel: the truth. On CPU it
    is the state gloo's worker sets when it finishes, except for works that never set it (gloo's
    `reduce_scatter_tensor` returns one with neither that state nor a future): there the work's
    future being done counts too, and so does its `wait()` returning (`work_waited`; `Work.wait`
    is observed by `harness.rank.tracing`). On a device neither counts: NCCL completes the future
    when the kernel is queued, and `wait()` only makes the current stream wait. No callback is
    attached to the future: it would run on gloo's worker thread, under the GIL;
  * a functional collective (DTensor's, `torch.distributed._functional_collectives`) returns a
    tensor whose work torch keeps in a registry Python cannot read; it is done when that tensor
    has been waited for (`funcol.wait_tensor`, or the `wait_tensor` op), which is when its data is
    ready for the caller.

Everything here runs in the rank and never raises into the caller: a work that cannot be queried
stays pending, which reads as "not completed" (the truth as far as the trace knows).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CompletionWatch"]

_POLL_S = 0.02
"""How often pending works are asked whether they completed: fine enough for the one-sided watch
(which settles over a second), coarse enough to cost nothing measurable (`bench/trace_overhead.py`)."""
_CLOSE_GRACE_S = 0.2


class CompletionWatch:
    """The pending collectives of one test: each is reported done, once, through `on_done(index)`.

    `on_done` is called with the watch's lock held, from the thread that saw the completion (the
    caller's, or the poller's); it must only write the done line.
    """

    def __init__(self, on_done: Callable[[int], None]) -> None:
        self._on_done = on_done
        self._lock = threading.Lock()
        self._works: dict[int, Any] = {}
        """index -> the work to poll."""
        self._polled: dict[int, Any] = {}
        """The pending works that can say they completed (the poller asks only these)."""
        self._by_work: dict[int, int] = {}
        """id(work) -> its index, for `work_waited`."""
        self._tensors: dict[int, list[int]] = {}
        """storage key of a functional collective's output -> the indices it completes."""
        self._open = True

    # ------------------------------------------------------------------------------ recording side

    def add_work(self, index: int, work: Any, on_cpu: bool) -> bool:
        """Track `work` for record `index` (`on_cpu`: its tensors are on the CPU, gloo's); True if it
        had completed already (then it is reported now)."""
        pending = _PendingWork(work, on_cpu)
        if pending.completed():
            self.done(index)
            return True
        with self._lock:
            if not self._open:
                return False
            self._works[index] = pending
            self._by_work[id(work)] = index
            if pending.pollable:
                self._polled[index] = pending
            else:
                return False  # only its wait() can say: nothing to poll
        self._start_polling()
        return False

    def add_tensors(self, index: int, tensors: list[torch.Tensor]) -> None:
        """Record `index` completes when any of `tensors` (one work's outputs) has been waited for."""
        keys = [key for key in map(_storage_key, tensors) if key is not None]
        if not keys:
            self.done(index)
            return
        with self._lock:
            if not self._open:
                return
            for key in keys:
                self._tensors.setdefault(key, []).append(index)

    def tensor_waited(self, tensor: Any) -> None:
        """`tensor` was waited for: the functional collectives that produced it have completed."""
        key = _storage_key(tensor)
        if key is None:
            return
        with self._lock:
            indices = self._tensors.pop(key, None)
            if indices and self._open:
                for index in indices:
                    self._on_done(index)

    def work_waited(self, work: Any) -> None:
        """`work.wait()` returned: on CPU, that work has completed."""
        with self._lock:
            index = self._by_work.get(id(work))
            pending = self._works.get(index) if index is not None else None
            if pending is None or pending.work is not work or not pending.on_cpu:
                return
            del self._works[index]
            del self._by_work[id(work)]
            self._polled.pop(index, None)
            if self._open:
                self._on_done(index)

    def done(self, index: int) -> None:
        with self._lock:
            pending = self._works.pop(index, None)
            if pending is not None:
                self._by_work.pop(id(pending.work), None)
                self._polled.pop(index, None)
            if self._open:
                self._on_done(index)

    def close(self) -> None:
        """The test is over: report what has completed by now, and forget the rest (it never
        completed while the test ran, and stays without a done line).

        A work the test did not wait for may be finishing on gloo's worker thread (or on the
        GPU) as the body returns: it gets `_CLOSE_GRACE_S` to say so."""
        deadline = time.monotonic() + _CLOSE_GRACE_S
        self._poll_once()
        while self._polled and time.monotonic() < deadline:
            time.sleep(_POLL_S / 2)
            self._poll_once()
        with self._lock:
            self._open = False
            self._works.clear()
            self._polled.clear()
            self._by_work.clear()
            self._tensors.clear()

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._works) + len(self._tensors)

    # -------------------------------------------------------------------------------- the poller

    def _start_polling(self) -> None:
        _poller.watch(self)

    @property
    def is_open(self) -> bool:
        return self._open

    def _poll_once(self) -> None:
        with self._lock:
            works = list(self._polled.items())
        finished = [index for index, work in works if work.completed()]
        if not finished:
            return
        with self._lock:
            for index in finished:
                pending = self._works.pop(index, None)
                self._polled.pop(index, None)
                if pending is None:
                    continue
                self._by_work.pop(id(pending.work), None)
                if self._open:
                    self._on_done(index)


class _Poller:
    """One daemon thread per process that asks the open watches' pending works every `_POLL_S`.

    It is never woken per collective: most works complete and are waited for long before it looks,
    and a thread woken for each one would take the GIL from the rank at every collective (measured:
    +200-300 us a collective at world size 2, `bench/trace_overhead.py`). It sleeps its interval
    whatever happens, so it takes the GIL at most 1 / `_POLL_S` times a second, and it ends when no
    watch is open."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watches: list[CompletionWatch] = []
        self._thread: threading.Thread | None = None

    def watch(self, watch: CompletionWatch) -> None:
        with self._lock:
            if watch not in self._watches:
                self._watches.append(watch)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="harness-completion", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(_POLL_S)
            with self._lock:
                self._watches = [watch for watch in self._watches if watch.is_open]
                watches = list(self._watches)
                if not watches:
                    self._thread = None
                    return
            for watch in watches:
                watch._poll_once()


_poller = _Poller()


class _PendingWork:
    """A work to ask whether it completed (see the module docstring for what is asked where)."""

    __slots__ = ("future", "on_cpu", "work")

    def __init__(self, work: Any, on_cpu: bool) -> None:
        self.work, self.on_cpu = work, on_cpu
        self.future: Any = None
        if on_cpu:
            with contextlib.suppress(Exception):  # a work without a future: its own state alone
                self.future = work.get_future()

    @property
    def pollable(self) -> bool:
        """Whether asking can ever say yes: a CPU work without a future (gloo's reduce_scatter_tensor)
        never sets its own state, and only its wait() returning tells."""
        return not self.on_cpu or self.future is not None

    def completed(self) -> bool:
        try:
            if self.work.is_completed():
                return True
        except Exception:  # noqa: BLE001 - a work that cannot say stays pending: "not known to have completed"
            pass
        try:
            return self.future is not None and bool(self.future.done())
        except Exception:  # noqa: BLE001 - as above
            return False


def _storage_key(tensor: Any) -> int | None:
    elem = getattr(tensor, "elem", None)  # an AsyncCollectiveTensor wraps the collective's output
    if isinstance(elem, torch.Tensor):
        tensor = elem
    if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
        return None
    with contextlib.suppress(Exception):
        return tensor.untyped_storage().data_ptr()
    return None
