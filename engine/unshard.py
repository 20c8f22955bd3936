"""`unshard_params`: show full parameters (optionally gradients) outside forward/backward."""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from . import collectives
from .flat_param import maybe_wrap
from .state import managing_unit, unit_of
from .unit import ShardedUnit


class UnitUnshard:
    """Shows one unit's full-precision parameters as original-shaped nn.Parameters.

    Mixed precision gathers a temporary full-precision copy (the compute buffer holds low
    precision), so a unit kept gathered by the strategy is resharded first and re-gathered by
    backward.  Writeback copies only this rank's real elements back: padding never persists.
    """

    def __init__(
        self, unit: ShardedUnit, writeback: bool, rank0_only: bool, offload_to_cpu: bool, with_grads: bool
    ) -> None:
        self.unit = unit
        self.writeback = writeback
        self.offload_to_cpu = offload_to_cpu
        self.with_grads = with_grads
        self.visible = not rank0_only or dist.get_rank() == 0
        self.shown: Optional[torch.Tensor] = None
        self.shown_grads: Optional[torch.Tensor] = None
        self.params: list[nn.Parameter] = []

    def enter(self) -> None:
        unit = self.unit
        self.previous = [info.refs[0].module._parameters[info.refs[0].name] for info in unit.layout.params]
        if unit.compute_dtype != unit.master_dtype:
            unit.reshard()
            self.was_unsharded = False
            full = self._gather_full_precision()
        else:
            self.was_unsharded = unit.is_unsharded
            unit.unshard()
            full = unit._full
        # A one-rank shard group holds full gradients already: show those very tensors, so
        # in-place changes persist exactly as changes to the (aliased) parameters do.
        alias_grads = self.with_grads and unit.topology.shard_group is None
        grads = self._gather_grads() if self.with_grads and not alias_grads else None
        if not self.visible:
            self._restore()
            return
        unit.shown_by_unshard = True
        if self.offload_to_cpu and full.device.type != "cpu":
            full = full.cpu()
            grads = grads.cpu() if grads is not None else None
        self.shown, self.shown_grads = full, grads
        for info, sharded in zip(unit.layout.params, unit.sharded_params):
            shown = maybe_wrap(info, unit.layout.full_view(full, info))
            param = nn.Parameter(shown, requires_grad=sharded.requires_grad)
            if alias_grads and sharded.grad is not None:
                param.grad = sharded.grad.view(info.shape)
            elif grads is not None and sharded.grad is not None:
                param.grad = maybe_wrap(info, unit.layout.full_view(grads, info))
            self.params.append(param)
        unit._install(self.params)

    def exit(self) -> None:
        if not self.visible:
            return
        if self.writeback:
            self._write_back()
        self._restore()

    def _write_back(self) -> None:
        unit, layout = self.unit, self.unit.layout
        start, valid = layout.chunk_start, layout.valid_in_chunk
        shown = self.shown
        with torch.no_grad():
            if shown.data_ptr() != unit.shard.data_ptr():
                unit.shard[:valid].copy_(shown[start : start + valid])
                if unit.is_unsharded and shown.data_ptr() != unit._full.data_ptr():
                    unit._full.copy_(shown)
            if self.shown_grads is not None:
                for info, sharded in zip(layout.params, unit.sharded_params):
                    if sharded.grad is not None:
                        full_grad = self.shown_grads[info.offset : info.offset + info.numel]
                        lo, hi = layout.local_range(info)
                        if layout.shard_size == 1:
                            sharded.grad.copy_(full_grad.view_as(sharded.grad))
                        elif hi > lo:
                            sharded.grad.copy_(full_grad[lo + start - info.offset : hi + start - info.offset])

    def _restore(self) -> None:
        unit = self.unit
        unit.shown_by_unshard = False
        if self.was_unsharded:
            unit._install(self.previous)
        elif unit.is_unsharded:
            unit.reshard()
        else:
            unit._install(unit.sharded_params)

    def _gather_full_precision(self) -> torch.Tensor:
        unit = self.unit
        group = unit.topology.shard_group
        source = unit.shard.to(unit.device, copy=unit.offload_params)
        if group is None:
            return source
        full = torch.empty(unit.layout.padded_numel, dtype=unit.master_dtype, device=unit.device)
        with collectives.labelled(unit.label):
            collectives.all_gather_flat(full, source, group)
        return full

    def _gather_grads(self) -> Optional[torch.Tensor]:
        """Full flat gradient, or None when no rank has a gradient for this unit."""
        unit = self.unit
        group = unit.topology.shard_group
        has_grad = any(p.grad is not None for p in unit.sharded_params)
        if group is not None:
            flag = torch.tensor([int(has_grad)], device=unit.device)
            with collectives.labelled(unit.label):
                collectives.all_reduce_sum(flag, group)
            has_grad = bool(flag.item())
        if not has_grad:
            return None
        local = torch.zeros(unit.layout.chunk, dtype=unit.master_dtype, device=unit.device)
        for info, sharded in zip(unit.layout.params, unit.sharded_params):
            if sharded.grad is not None:
                unit.sharded_view(local, info).copy_(sharded.grad)
        if group is None:
            return local
        full = torch.empty(unit.layout.padded_numel, dtype=unit.master_dtype, device=unit.device)
        with collectives.labelled(unit.label):
            collectives.all_gather_flat(full, local, group)
        return full


def units_in_scope(module: nn.Module, recurse: bool) -> list[ShardedUnit]:
    """Units to unshard for `module`, in a rank-independent order."""
    if not recurse:
        unit = unit_of(module) or managing_unit(module)
        return [unit] if unit is not None and unit.has_params else []
    units: list[ShardedUnit] = []
    for submodule in module.modules():
        for unit in (managing_unit(submodule), unit_of(submodule)):
            if unit is not None and unit.has_params and unit not in units:
                units.append(unit)
    return units


def check_unshard_request(
    units: list[ShardedUnit], writeback: bool, rank0_only: bool, offload_to_cpu: bool
) -> None:
    """Raise the documented errors before any collective is issued."""
    if rank0_only and writeback:
        raise NotImplementedError(
            "rank0_only=True with writeback=True is not supported: other ranks would not see the "
            "writes; pass writeback=False, or rank0_only=False to gather on every rank"
        )
    for unit in units:
        if unit.root is not None and unit.root.in_compute:
            raise RuntimeError(
                "Cannot manually unshard parameters during forward/backward: call unshard_params "
                "before the forward or after backward has finished"
            )
    if offload_to_cpu and any(unit.topology.shard_size == 1 for unit in units):
        raise NotImplementedError(
            "offload_to_cpu=True with NO_SHARD (or a one-rank shard group) is not supported: "
            "parameters are already full on every rank; pass offload_to_cpu=False and copy "
            "them with .cpu() if needed"
        )


@contextlib.contextmanager
def unshard_params(
    module: nn.Module,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """Show the full parameters of the units under `module` for the duration of the block.

    Collective: every rank of the shard groups involved must enter it.  With `writeback`,
    in-place changes to the shown parameters (and, with `with_grads`, gradients) persist.
    """
    units = units_in_scope(module, recurse)
    check_unshard_request(units, writeback, rank0_only, offload_to_cpu)
    entered: list[UnitUnshard] = []
    try:
        for unit in units:
            shown = UnitUnshard(unit, writeback, rank0_only, offload_to_cpu, with_grads)
            shown.enter()
            entered.append(shown)
        yield
    finally:
        for shown in reversed(entered):
            shown.exit()
