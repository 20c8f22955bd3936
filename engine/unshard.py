"""`unshard_params`: show full parameters (optionally gradients) outside forward/backward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from engine import collectives
from engine.flat_param import maybe_wrap
from engine.params import ParamExposure
from engine.partition import OptimPartition
from engine.state import managing_unit, unit_of
from engine.unit import ShardedUnit


@dataclass(frozen=True)
class UnshardOptions:
    """What `unshard_params` was asked for (see its docstring)."""

    writeback: bool = True
    rank0_only: bool = False
    offload_to_cpu: bool = False
    with_grads: bool = False


class UnitUnshard:
    """Shows one unit's full-precision parameters as original-shaped nn.Parameters.

    Mixed precision gathers a temporary full-precision copy (the compute buffer holds low
    precision), so a unit kept gathered by the strategy is resharded first and re-gathered by
    backward.  Writeback copies only this rank's real elements back: padding never persists.
    On exit the unit shows what it showed before (compute views, or its idle parameters).
    """

    def __init__(self, unit: ShardedUnit, options: UnshardOptions) -> None:
        self.unit = unit
        self.options = options
        self.visible = not options.rank0_only or dist.get_rank() == 0
        self.shown: torch.Tensor | None = None
        self.shown_grads: torch.Tensor | None = None
        self.params: list[nn.Parameter] = []

    def enter(self) -> None:
        unit, options = self.unit, self.options
        self.previous = unit.exposure.snapshot()
        if unit.compute_dtype != unit.master_dtype:
            unit.reshard()
            self.was_unsharded = False
            full = self._gather_full_precision()
        else:
            self.was_unsharded = unit.is_unsharded
            unit.unshard()
            full = unit._full
        # A one-rank shard group holds full gradients already (unless ZeRO-2 partitioned them):
        # show those very tensors, so in-place changes persist exactly as changes to the
        # (aliased) parameters do.
        alias_grads = options.with_grads and unit.topology.shard_group is None and not unit.partitions_grads
        grads = self._gather_grads() if options.with_grads and not alias_grads else None
        if not self.visible:
            self._restore()
            return
        unit.shown_by_unshard = True
        if options.offload_to_cpu and full.device.type != "cpu":
            full = full.cpu()
            grads = grads.cpu() if grads is not None else None
        self.shown, self.shown_grads = full, grads
        exposure = unit.exposure
        stored = exposure.stored_grad_views() if alias_grads else [None] * len(unit.layout.params)
        has_grad = _grad_store(unit).param_has_grad()
        for info, requires_grad, stored_grad, local_has_grad in zip(
            unit.layout.params, exposure.requires_grad(), stored, has_grad
        ):
            param = nn.Parameter(maybe_wrap(info, unit.layout.full_view(full, info)), requires_grad=requires_grad)
            if stored_grad is not None:
                param.grad = stored_grad
            elif grads is not None and local_has_grad:
                param.grad = maybe_wrap(info, unit.layout.full_view(grads, info))
            self.params.append(param)
        exposure.show_full(self.params)

    def exit(self) -> None:
        if not self.visible:
            return
        if self.options.writeback:
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
                store = _grad_store(unit)  # its chunks lie in the flat buffer as its layout says
                begin = store.layout.chunk_start
                store.write_grad_chunk(self.shown_grads[begin : begin + store.layout.chunk])

    def _restore(self) -> None:
        unit = self.unit
        unit.shown_by_unshard = False
        if self.was_unsharded:
            unit.exposure.restore(self.previous)
        elif unit.is_unsharded:
            unit.reshard()
        else:
            unit.exposure.show_idle()

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

    def _gather_grads(self) -> torch.Tensor | None:
        """Full flat gradient, or None when no rank has a gradient for this unit."""
        unit = self.unit
        store = _grad_store(unit)
        layout = store.layout
        group = unit.optim_partition.group if unit.partitions_grads else unit.topology.shard_group
        has_grad = store.has_grad()
        if group is not None:
            flag = torch.tensor([int(has_grad)], device=unit.device)
            with collectives.labelled(unit.label):
                collectives.all_reduce_sum(flag, group)
            has_grad = bool(flag.item())
        if not has_grad:
            return None
        local = store.grad_chunk()
        if local is None:  # other ranks have gradients, this one none: contribute zeros
            local = torch.zeros(layout.chunk, dtype=unit.master_dtype, device=unit.device)
        local = local.to(unit.device, unit.master_dtype)
        if group is None:
            return local
        full = torch.empty(layout.padded_numel, dtype=unit.master_dtype, device=unit.device)
        with collectives.labelled(unit.label):
            collectives.all_gather_flat(full, local, group)
        return full


def _grad_store(unit: ShardedUnit) -> ParamExposure | OptimPartition:
    """Where `unit` stores this rank's gradients: the exposed parameters, or (ZeRO-2) its
    optimizer partition."""
    if unit.partitions_grads:
        assert unit.optim_partition is not None
        return unit.optim_partition
    return unit.exposure


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


def check_unshard_request(units: list[ShardedUnit], options: UnshardOptions) -> None:
    """Raise the documented errors before any collective is issued."""
    if options.rank0_only and options.writeback:
        raise NotImplementedError(
            "rank0_only=True with writeback=True is not supported: other ranks would not see the "
            "writes; pass writeback=False, or rank0_only=False to gather on every rank"
        )
    for unit in units:
        if unit.context is not None and unit.context.in_compute():
            raise RuntimeError(
                "Cannot manually unshard parameters during forward/backward: call unshard_params "
                "before the forward or after backward has finished"
            )
    if options.offload_to_cpu and any(unit.topology.shard_size == 1 for unit in units):
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
    Inside, the original parameters are registered nn.Parameters under their original names
    (in both parameter modes; a unit's `_flat_param` is hidden meanwhile).
    """
    options = UnshardOptions(writeback, rank0_only, offload_to_cpu, with_grads)
    units = units_in_scope(module, recurse)
    check_unshard_request(units, options)
    entered: list[UnitUnshard] = []
    try:
        for unit in units:
            shown = UnitUnshard(unit, options)
            shown.enter()
            entered.append(shown)
        yield
    finally:
        for shown in reversed(entered):
            shown.exit()
