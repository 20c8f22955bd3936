"""The collective core: every all-gather / reduce-scatter / all-reduce the engine issues.

All collectives run on a side stream on CUDA (synchronised with the compute stream) and inline
on CPU; the code path is the same.  While a collective for a unit is being issued,
`current_label()` names the unit so that external tracers can attribute it.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist

_current_label: Optional[str] = None
_comm_streams: dict[torch.device, "torch.cuda.Stream"] = {}

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def current_label() -> Optional[str]:
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


def _comm_stream(device: torch.device) -> Optional["torch.cuda.Stream"]:
    if device.type != "cuda":
        return None
    stream = _comm_streams.get(device)
    if stream is None:
        stream = _comm_streams[device] = torch.cuda.Stream(device=device)
    return stream


@contextlib.contextmanager
def _on_comm_stream(*tensors: torch.Tensor) -> Iterator[None]:
    """Run the block on the side stream; the compute stream waits for it afterwards.

    `record_stream` tells the caching allocator that the tensors are used on the side stream,
    so memory freed later on the compute stream is not reused while communication is pending.
    """
    stream = _comm_stream(tensors[0].device)
    if stream is None:
        yield
        return
    compute = torch.cuda.current_stream(tensors[0].device)
    stream.wait_stream(compute)
    with torch.cuda.stream(stream):
        yield
    for tensor in tensors:
        tensor.record_stream(stream)
    compute.wait_stream(stream)


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Gather every rank's equally sized `shard` into the preallocated `output`, in rank order."""
    with _on_comm_stream(output, shard):
        _all_gather_single(output, shard, group=group)


def reduce_scatter_flat(
    output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
) -> Optional[dist.Work]:
    """Sum `full` over the group and keep this rank's contiguous chunk in `output`.

    With `async_op` the caller must `wait()` the returned work before reading `output`; on CPU
    that lets gloo reduce while backward keeps computing.
    """
    with _on_comm_stream(output, full):
        return _reduce_scatter_single(output, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Sum `tensor` in place over the group (replica groups of HYBRID_SHARD / NO_SHARD)."""
    with _on_comm_stream(tensor):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)


def all_gather_small(values: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """All-gather a small 1-D tensor (used for metadata checks); returns (world, numel)."""
    world = dist.get_world_size(group)
    output = values.new_empty(world * values.numel())
    with _on_comm_stream(output, values):
        _all_gather_single(output, values, group=group)
    return output.view(world, values.numel())
