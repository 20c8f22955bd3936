"""SHARD_OPTIM_STATE (ZeRO-1): this rank's partition of one unit's optimizer state.

A SHARD_OPTIM_STATE unit keeps its parameters replicated: its flat master (`ShardedUnit.shard`,
every element, on every rank) is what modules compute with and what the reduced gradients are
stored against, exactly as NO_SHARD.  Only the optimizer is partitioned: it steps `chunk`, this
rank's piece of the flat buffer laid out as FULL_SHARD lays out its shards (padded to a multiple
of the partition group, one equal contiguous chunk per rank), so per-parameter optimizer state
exists once across the group and the optimizer state dict code serves both strategies.

Ownership and order, per step (`engine.ShardedOptimizer` drives it):

1. `load_grads` — copy the master's current values into `chunk` (anything that wrote the
   replicated parameters since the last step — `load_state_dict`, unshard writeback, a direct
   write — is picked up; `chunk` is never an independent master) and hand the optimizer this
   rank's piece of the averaged gradient;
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
    """What this rank's optimizer steps of one SHARD_OPTIM_STATE unit.

    `params`: one ``nn.Parameter`` per original parameter (a 1-D view of its piece of `chunk`,
    possibly empty), or with a flat unit one parameter that is `chunk` itself — what FULL_SHARD
    would expose in the same parameter mode.  Their gradients are set by `load_grads`.
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

    def load_grads(self, full_grads: list[torch.Tensor | None]) -> None:
        """Refresh `chunk` from the master; give `params` this rank's piece of `full_grads`
        (the unit's stored, averaged gradients, original-shaped; None where absent)."""
        layout = self.layout
        start, valid = layout.chunk_start, layout.valid_in_chunk
        with torch.no_grad():
            self.chunk[:valid].copy_(self._master[start : start + valid])
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
