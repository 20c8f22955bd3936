"""ZeRO-1 / ZeRO-2: this rank's partition of one unit's optimizer state (and ZeRO-2 gradient).

A SHARD_OPTIM_STATE or SHARD_GRAD_AND_OPTIM_STATE unit keeps its parameters replicated: its flat
master (`ShardedUnit.shard`, every element, on every rank) is what modules compute with.  Only
the optimizer is partitioned: it steps `chunk`, this rank's piece of the flat buffer laid out as
FULL_SHARD lays out its shards (padded to a multiple of the partition group, one equal contiguous
chunk per rank), so per-parameter optimizer state exists once across the group and the optimizer
state dict code serves every strategy.

Where the averaged gradient lives differs:

* SHARD_OPTIM_STATE (ZeRO-1): whole on every rank, stored against the replicated parameters (the
  unit all-reduces it, as NO_SHARD); `load_grads` hands the optimizer this rank's piece at step.
* SHARD_GRAD_AND_OPTIM_STATE (ZeRO-2): the unit reduce-scatters it over the partition group, and
  this rank stores only its chunk, as the gradients of `params` (`accumulate_grad`): the
  replicated parameters carry no gradient.  Nothing is copied at step.

Ownership and order, per step (`engine.ShardedOptimizer` drives it):

1. `load_grads` (ZeRO-1) / `refresh` (ZeRO-2) — copy the master's current values into `chunk`
   (anything that wrote the replicated parameters since the last step — `load_state_dict`,
   unshard writeback, a direct write — is picked up; `chunk` is never an independent master);
   ZeRO-1 also hands the optimizer this rank's piece of the averaged gradient;
2. the optimizer updates `chunk` in place through `params` (views of it);
3. `start_gather` / `finish_gather` — all-gather every rank's `chunk` into a padded buffer and
   copy it into the master, so every rank holds the same updated parameters again.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from engine import collectives
from engine.flat_param import FlatLayout, ParamInfo


class PendingGather:
    """An all-gather of updated chunks into a unit's master, issued and not yet copied in."""

    __slots__ = ("_gathered", "_master", "_numel", "_pending")

    def __init__(
        self, master: torch.Tensor, gathered: torch.Tensor, pending: collectives.Pending | None, numel: int
    ) -> None:
        self._master = master
        self._gathered = gathered  # written by the collective: referenced until it is waited
        self._pending = pending
        self._numel = numel

    def finish(self) -> None:
        if self._pending is not None:
            self._pending.wait()
        with torch.no_grad():
            self._master.copy_(self._gathered[: self._numel])

    def abandon(self) -> None:
        if self._pending is not None:
            self._pending.abandon()


class OptimPartition:
    """What this rank's optimizer steps of one SHARD_OPTIM_STATE / SHARD_GRAD_AND_OPTIM_STATE unit.

    `params`: one ``nn.Parameter`` per original parameter (a 1-D view of its piece of `chunk`,
    possibly empty), or with a flat unit one parameter that is `chunk` itself — what FULL_SHARD
    would expose in the same parameter mode.  Their gradients are set by `load_grads` (ZeRO-1)
    or are the stored gradient partition itself (ZeRO-2, `accumulate_grad`).
    """

    def __init__(
        self,
        params: list[ParamInfo],
        master: torch.Tensor,
        group: dist.ProcessGroup | None,
        size: int,
        rank: int,
        flat: bool,
        device: torch.device,
    ) -> None:
        self.layout = FlatLayout(params, size, rank)
        self.group = group  # None: one rank holds the whole partition (world size 1)
        self.device = device  # where the all-gather runs (the master may be offloaded to CPU)
        self._master = master
        self.chunk = torch.zeros(self.layout.chunk, dtype=master.dtype, device=master.device)
        if master.is_pinned():
            self.chunk = self.chunk.pin_memory()
        self.flat = flat
        if flat:
            self.params = [nn.Parameter(self.chunk)]
        else:
            self.params = [nn.Parameter(self.layout.sharded_view(self.chunk, info)) for info in self.layout.params]

    @property
    def flat_param(self) -> nn.Parameter | None:
        return self.params[0] if self.flat else None

    def refresh(self) -> None:
        """Copy the master's current values of this rank's piece into `chunk`."""
        layout = self.layout
        start, valid = layout.chunk_start, layout.valid_in_chunk
        with torch.no_grad():
            self.chunk[:valid].copy_(self._master[start : start + valid])

    def load_grads(self, full_grads: list[torch.Tensor | None]) -> None:
        """ZeRO-1: refresh `chunk` from the master; give `params` this rank's piece of
        `full_grads` (the unit's stored, averaged gradients, original-shaped; None where absent)."""
        self.refresh()
        layout = self.layout
        start = layout.chunk_start
        if all(grad is None for grad in full_grads):
            for param in self.params:
                param.grad = None
            return
        chunk_grad = torch.zeros_like(self.chunk)
        for info, grad in zip(layout.params, full_grads):
            lo, hi = layout.local_range(info)
            if grad is None or lo == hi:
                continue
            begin = lo + start - info.offset
            chunk_grad[lo:hi].copy_(grad.reshape(-1)[begin : begin + hi - lo])
        if self.flat:
            self.params[0].grad = chunk_grad
            return
        for info, param, grad in zip(layout.params, self.params, full_grads):
            param.grad = None if grad is None else layout.sharded_view(chunk_grad, info)

    # -- ZeRO-2: the stored gradient partition (the gradients of `params`) ------------------
    def accumulate_grad(self, reduced: torch.Tensor, trainable: list[bool]) -> None:
        """Add `reduced` (this rank's chunk of the averaged flat gradient, chunk-sized, zero on
        padding) to the stored gradients; pieces of frozen parameters (`trainable` False) are
        left out.  A parameter this rank owns none of gets an empty gradient."""
        if self.flat:
            if not any(trainable):
                return
            param = self.params[0]
            if param.grad is None:
                param.grad = reduced
            else:
                param.grad.add_(reduced)
            return
        self.layout.accumulate_grads(self.params, reduced, trainable)

    def has_grad(self) -> bool:
        return any(param.grad is not None for param in self.params)

    def param_has_grad(self) -> list[bool]:
        """Per original parameter: whether this rank stores a gradient (piece) for it."""
        if self.flat:
            return [self.params[0].grad is not None] * len(self.layout.params)
        return [param.grad is not None for param in self.params]

    def grad_chunk(self) -> torch.Tensor | None:
        """The stored gradient partition as one chunk (zeros where absent), or None."""
        if not self.has_grad():
            return None
        if self.flat:
            return self.params[0].grad
        return self.layout.grads_as_chunk(self.params)

    def write_grad_chunk(self, chunk: torch.Tensor) -> None:
        """Overwrite the stored gradient pieces (those that exist) with this rank's `chunk`."""
        with torch.no_grad():
            if self.flat:
                if self.params[0].grad is not None:
                    self.params[0].grad.copy_(chunk)
                return
            for info, param in zip(self.layout.params, self.params):
                if param.grad is not None:
                    param.grad.copy_(self.layout.sharded_view(chunk, info))

    def start_gather(self, label: str) -> PendingGather:
        """Issue the all-gather of every rank's updated chunk (collective over the partition group)."""
        layout = self.layout
        if self.group is None:
            return PendingGather(self._master, self.chunk, None, layout.numel)
        gathered = torch.empty(layout.padded_numel, dtype=self.chunk.dtype, device=self.device)
        source, sent = None, self.chunk
        if self.chunk.device != self.device:  # offloaded: NCCL gathers device memory
            source, sent = self.chunk, torch.empty_like(self.chunk, device=self.device)
        with collectives.labelled(label):
            pending = collectives.all_gather_flat(gathered, sent, self.group, async_op=True, source=source)
        return PendingGather(self._master, gathered, pending, layout.numel)
