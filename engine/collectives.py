"""The collective core: every all-gather / reduce-scatter / all-reduce the engine issues.

One code path for CUDA (NCCL) and CPU (gloo); only what "in flight" means differs:

* CUDA: a collective is issued on a side stream (one for all-gathers, one for reductions, per
  device) and ends with an event recorded on that stream. `Pending.wait()` makes the *current*
  (compute) stream wait for that event: the CPU never blocks and nothing is `record_stream`ed.
* CPU: a collective is issued with ``async_op=True``; gloo runs it on its own threads, so its
  latency overlaps whatever the caller computes next. `Pending.wait()` blocks on the work.

Stream and memory order (CUDA), the invariants every caller keeps:

1. Every buffer a collective reads or writes is allocated on the compute stream (the stream
   current when the collective is issued) and stays referenced by its `Pending` until `wait()`.
2. At issue, the side stream waits for the compute stream. So the collective sees every earlier
   compute-stream write to its inputs (the optimizer step into a shard, gradient accumulation),
   and it cannot overwrite memory that the compute stream freed and reallocated to it while
   earlier kernels still read that memory.
3. Consumers read outputs only after `wait()`, and the last reference to a buffer is dropped only
   after `wait()`. The caching allocator then hands the memory out again only to compute-stream
   work that is ordered after the collective, which is why no `record_stream` is needed and
   freed memory is reusable at once.
4. CPU keeps the same discipline: gloo's threads own the tensors until `wait()` returns, so
   nothing is read, resized or freed before it (a resize of a buffer gloo is writing is a
   use-after-free, not just a race).

While a collective is issued, `current_label()` names the unit it belongs to so that external
tracers (the harness's collective trace) can attribute it.  Callers look the functions up as
module attributes at call time (`collectives.all_gather_flat(...)`), so instrumentation can wrap
them; a wrapper must return what the original returns and `wait()` it before reading outputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

_current_label: str | None = None
# (device, "all_gather" | "reduce") -> side stream; created on first use.
_side_streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

ALL_GATHER_STREAM = "all_gather"
REDUCE_STREAM = "reduce"


def current_label() -> str | None:
    """FQNs of the unit whose collective is being issued right now (", "-joined), else None."""
    return _current_label


@contextlib.contextmanager
def labelled(label: str) -> Iterator[None]:
    """Mark the collectives issued inside the block as belonging to `label`."""
    global _current_label
    previous, _current_label = _current_label, label
    try:
        yield
    finally:
        _current_label = previous


class Pending:
    """A collective that was issued and whose outputs may not be read yet.

    `wait()` (idempotent) orders the caller after the collective: on CUDA by making the current
    stream wait for the side stream's event, on CPU by blocking on gloo's work. Until then the
    object keeps the collective's buffers referenced (invariant 1 of the module docstring).
    """

    __slots__ = ("_buffers", "_device", "_event", "_work")

    def __init__(
        self,
        work: dist.Work | None,
        event: torch.cuda.Event | None,
        buffers: tuple[torch.Tensor, ...],
    ) -> None:
        self._work = work
        self._event = event
        self._device = buffers[0].device
        self._buffers: tuple[torch.Tensor, ...] | None = buffers

    def wait(self) -> None:
        if self._buffers is None:
            return
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
        if self._work is not None:
            self._work.wait()
        self._buffers = None  # invariant 3: the buffers may be freed from here on

    def abandon(self) -> None:
        """Stop tracking the collective without blocking the CPU (its result is not wanted).

        CUDA: the compute stream still waits for it, so its buffers may be freed (invariant 3).
        CPU: gloo's work object references its own tensors until it ends, so dropping ours is safe.
        """
        if self._event is not None:
            self.wait()
        self._buffers = None


def _side_stream(device: torch.device, kind: str) -> torch.cuda.Stream | None:
    if device.type != "cuda":
        return None
    key = (device, kind)
    stream = _side_streams.get(key)
    if stream is None:
        stream = _side_streams[key] = torch.cuda.Stream(device=device)
    return stream


def _issue(kind: str, buffers: tuple[torch.Tensor, ...], launch, async_op: bool) -> Pending | None:
    """Run `launch(async_op) -> Work | None` as the module docstring describes; wait unless async."""
    device = buffers[0].device
    stream = _side_stream(device, kind)
    if stream is None:
        pending = Pending(launch(True), None, buffers)
    else:
        stream.wait_stream(torch.cuda.current_stream(device))  # invariant 2
        with torch.cuda.stream(stream):
            # Synchronous from the side stream's point of view: NCCL makes the side stream wait
            # for its own stream, so the event below marks the collective's end.
            launch(False)
            event = torch.cuda.Event()
            event.record(stream)
        pending = Pending(None, event, buffers)
    if not async_op:
        pending.wait()
        return None
    return pending


def all_gather_flat(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    async_op: bool = False,
    source: torch.Tensor | None = None,
) -> Pending | None:
    """Gather every rank's equally sized `shard` into the preallocated `output`, in rank order.

    With `source`, `shard` (a staging buffer) is first filled from it (a cast or a host-to-device
    copy) where the gather runs, so that copy overlaps compute as the gather does.  With
    `async_op` the caller gets a `Pending` to `wait()` before reading `output`.
    """

    def launch(gloo_async: bool) -> dist.Work | None:
        if source is not None:
            shard.copy_(source, non_blocking=True)
        return _all_gather_single(output, shard, group=group, async_op=gloo_async)

    buffers = (output, shard) if source is None else (output, shard, source)
    return _issue(ALL_GATHER_STREAM, buffers, launch, async_op)


def reduce_scatter_flat(
    output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool = False
) -> Pending | None:
    """Sum `full` over the group and keep this rank's contiguous chunk in `output`."""

    def launch(gloo_async: bool) -> dist.Work | None:
        return _reduce_scatter_single(output, full, op=dist.ReduceOp.SUM, group=group, async_op=gloo_async)

    return _issue(REDUCE_STREAM, (output, full), launch, async_op)


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool = False) -> Pending | None:
    """Sum `tensor` in place over the group (replica groups of HYBRID_SHARD / NO_SHARD)."""

    def launch(gloo_async: bool) -> dist.Work | None:
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=gloo_async)

    return _issue(REDUCE_STREAM, (tensor,), launch, async_op)


def all_gather_small(values: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather a small 1-D tensor (used for metadata checks); returns (world, numel)."""
    world = dist.get_world_size(group)
    output = values.new_empty(world * values.numel())
    _issue(
        ALL_GATHER_STREAM,
        (output, values),
        lambda a: _all_gather_single(output, values, group=group, async_op=a),
        False,
    )
    return output.view(world, values.numel())
