"""zero2_lib: a small ZeRO stage 2 data-parallel library in plain torch.distributed.

What each rank stores at stage 2 (the library's purpose):

* parameters: whole, on every rank (rank 0's values are broadcast when the model is wrapped, and
  every step all-gathers the updated values back into them);
* gradients: only the slice it owns. All parameters of the model are laid out, in
  ``named_parameters()`` order, in one flat space of ``numel`` elements, padded at its end to a
  multiple of the world size; rank ``r`` owns elements ``[r * c, (r + 1) * c)`` with
  ``c = ceil(numel / world size)``. After backward the whole local gradients are reduce-scattered
  (summed, then divided by the world size) into the owned slice and ``param.grad`` is freed;
* optimizer state: only for the owned slice. The optimizer steps float32 master copies of the
  owned slice of each parameter (``Zero2.pieces``: views of one flat master buffer), and the step
  ends with an all-gather of every rank's master slice into the whole parameters.

Stage 0 is the replicated baseline the same code gives when every rank owns the whole flat space:
gradients all-reduced (averaged) and kept whole, every rank stepping master copies of all of it.

There are no units: the whole model is one partition. Gradients accumulate across backwards (as
``loss.backward()`` does) until ``zero_grad``; inside ``no_sync()`` backwards leave the local
gradients in ``param.grad`` unreduced, and the next reducing backward reduces their sum.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

_ENGINES: weakref.WeakKeyDictionary[nn.Module, Zero2] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Slot:
    """Where one parameter lies in the flat space, and the part of it this rank owns."""

    fqn: str
    param: nn.Parameter
    offset: int  # first element in the flat space
    owned_start: int  # owned part, in the parameter's own flattened indices: [owned_start, owned_stop)
    owned_stop: int

    @property
    def owned_numel(self) -> int:
        return self.owned_stop - self.owned_start

    def master_range(self, partition_start: int) -> tuple[int, int]:
        """The owned part's indices in this rank's flat master / gradient partition."""
        start = self.offset + self.owned_start - partition_start
        return start, start + self.owned_numel


class Zero2:
    """The ZeRO-2 state of one model: its layout, master partition, gradient partition."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None, stage: int = 2) -> None:
        if stage not in (0, 2):
            raise ValueError(f"zero2_lib: stage {stage} does not exist here; choose 2 (ZeRO-2) or 0 (replicated)")
        if module in _ENGINES:
            raise ValueError(f"zero2_lib: {type(module).__name__} is already wrapped; wrap a model once")
        self.module = module
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.stage = stage
        # Stage 0: every rank owns the whole flat space (one partition of it, replicated).
        self.partitions = self.world_size if stage == 2 else 1
        named = _unique_named_parameters(module)
        with torch.no_grad():
            for _, param in named:
                dist.broadcast(param.data, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        self.numel = sum(param.numel() for _, param in named)
        self.partition_numel = max(1, math.ceil(self.numel / self.partitions))
        self.partition_start = self.rank * self.partition_numel if stage == 2 else 0
        partition_stop = self.partition_start + self.partition_numel
        self.slots: list[Slot] = []
        offset = 0
        for fqn, param in named:
            start = min(max(self.partition_start - offset, 0), param.numel())
            stop = max(min(partition_stop - offset, param.numel()), start)
            self.slots.append(Slot(fqn, param, offset, start, stop))
            offset += param.numel()
        self.master = torch.zeros(self.partition_numel, dtype=torch.float32, device=self._device())
        self._refresh_master()
        # One optimizer parameter per owned part (a view of the master partition), so optimizer
        # state is kept per parameter, for the owned elements only.
        self.pieces: dict[str, nn.Parameter] = {}
        for slot in self.slots:
            if slot.owned_numel:
                start, stop = slot.master_range(self.partition_start)
                self.pieces[slot.fqn] = nn.Parameter(self.master[start:stop])
        self.grad_partition: torch.Tensor | None = None
        self._reducing = True
        _ENGINES[module] = self

    # -- layout --------------------------------------------------------------------------
    def _device(self) -> torch.device:
        return self.slots[0].param.device if self.slots else torch.device("cpu")

    def slot(self, fqn: str) -> Slot:
        for slot in self.slots:
            if slot.fqn == fqn:
                return slot
        raise KeyError(f"zero2_lib: no parameter {fqn!r}; the model has {[s.fqn for s in self.slots]}")

    def slot_of(self, param: nn.Parameter) -> Slot:
        for slot in self.slots:
            if slot.param is param:
                return slot
        raise KeyError("zero2_lib: that parameter does not belong to the wrapped model")

    def _flat_padded(self, tensors: Iterable[torch.Tensor | None]) -> torch.Tensor:
        """The flat space of the whole model (padded to world size x partition) from one tensor
        (or None: zeros) per parameter."""
        flat = torch.zeros(self.partition_numel * self.partitions, dtype=torch.float32, device=self._device())
        for slot, tensor in zip(self.slots, tensors, strict=True):
            if tensor is not None:
                flat[slot.offset : slot.offset + slot.param.numel()].copy_(tensor.reshape(-1))
        return flat

    def _refresh_master(self) -> None:
        """Copy the owned parts of the whole parameters into the master partition."""
        with torch.no_grad():
            for slot in self.slots:
                if slot.owned_numel:
                    start, stop = slot.master_range(self.partition_start)
                    self.master[start:stop].copy_(slot.param.reshape(-1)[slot.owned_start : slot.owned_stop])

    # -- training --------------------------------------------------------------------------
    def build_optimizer(self, factory: OptimizerFactory) -> torch.optim.Optimizer:
        """The optimizer over this rank's owned master parts (a rank that owns nothing, in a
        model smaller than the world, steps one empty placeholder)."""
        pieces = list(self.pieces.values())
        if not pieces:
            pieces = [nn.Parameter(self.master[:0])]
        return factory(pieces)

    def reduce_gradients(self) -> None:
        """Reduce-scatter the whole local gradients into the owned partition (averaged over the
        ranks, added to what earlier backwards left there) and free ``param.grad``. Inside
        ``no_sync()`` nothing happens: the local gradients keep accumulating."""
        if not self._reducing:
            return
        grads = [slot.param.grad for slot in self.slots]
        if all(grad is None for grad in grads):
            return
        flat = self._flat_padded(grads)
        if self.stage == 2:
            reduced = torch.empty(self.partition_numel, dtype=torch.float32, device=flat.device)
            dist.reduce_scatter_tensor(reduced, flat, op=dist.ReduceOp.SUM, group=self.group)
        else:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            reduced = flat
        reduced.div_(self.world_size)
        if self.grad_partition is None:
            self.grad_partition = reduced
        else:
            self.grad_partition.add_(reduced)
        for slot in self.slots:
            slot.param.grad = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate whole local gradients in ``param.grad`` without reducing."""
        previous, self._reducing = self._reducing, False
        try:
            yield
        finally:
            self._reducing = previous

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step the owned master parts with the owned gradients, then all-gather every rank's
        master partition into the whole parameters. The gradients stay until ``zero_grad``."""
        for fqn, piece in self.pieces.items():
            if self.grad_partition is None:
                piece.grad = None
            else:
                start, stop = self.slot(fqn).master_range(self.partition_start)
                piece.grad = self.grad_partition[start:stop]
        optimizer.step()
        self.gather_parameters()

    def _gathered(self, partition: torch.Tensor) -> torch.Tensor:
        """The whole flat space from every rank's ``partition`` (stage 0: its own, whole)."""
        if self.stage == 0:
            return partition
        gathered = torch.empty(self.partition_numel * self.world_size, dtype=partition.dtype, device=partition.device)
        dist.all_gather_into_tensor(gathered, partition, group=self.group)
        return gathered

    def gather_parameters(self) -> None:
        gathered = self._gathered(self.master)
        with torch.no_grad():
            for slot in self.slots:
                slot.param.copy_(gathered[slot.offset : slot.offset + slot.param.numel()].view_as(slot.param))

    def zero_grad(self) -> None:
        self.grad_partition = None
        for piece in self.pieces.values():
            piece.grad = None
        for slot in self.slots:
            slot.param.grad = None

    # -- per-rank storage ------------------------------------------------------------------
    def owned_gradient(self, fqn: str) -> torch.Tensor | None:
        """This rank's stored (reduced) gradient of ``fqn``'s owned part, flat; None before a
        reducing backward or after zero_grad."""
        if self.grad_partition is None:
            return None
        start, stop = self.slot(fqn).master_range(self.partition_start)
        return self.grad_partition[start:stop]

    def write_parameter(self, fqn: str, value: torch.Tensor) -> None:
        """Overwrite ``fqn`` on this rank, its master part included (so a step keeps it)."""
        slot = self.slot(fqn)
        with torch.no_grad():
            slot.param.copy_(value)
        self._refresh_master()

    @contextlib.contextmanager
    def full_params(self, writeback: bool = True) -> Iterator[None]:
        """The parameters are always whole; inside, changes persist with ``writeback`` (the
        master parts take them on exit) and are undone without."""
        saved = None if writeback else [slot.param.detach().clone() for slot in self.slots]
        try:
            yield
        finally:
            with torch.no_grad():
                if saved is not None:
                    for slot, value in zip(self.slots, saved, strict=True):
                        slot.param.copy_(value)
                self._refresh_master()

    # -- state dicts -----------------------------------------------------------------------
    def load_model_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.module.load_state_dict(dict(state_dict))
        self._refresh_master()

    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Every parameter's whole optimizer state, by FQN, identical on every rank: elementwise
        states all-gathered from the owners' partitions, scalars from the owners."""
        local: dict[str, dict[str, Any]] = {}
        for fqn, piece in self.pieces.items():
            state = optimizer.state.get(piece, {})
            local[fqn] = {
                "scalars": {k: v for k, v in state.items() if not _elementwise(v)},
                "elementwise": sorted(k for k, v in state.items() if _elementwise(v)),
            }
        everyone: list[dict[str, dict[str, Any]]] = [{} for _ in range(self.world_size)]
        dist.all_gather_object(everyone, local, group=self.group)
        names = sorted({name for rank_info in everyone for info in rank_info.values() for name in info["elementwise"]})
        whole: dict[str, torch.Tensor] = {}
        for name in names:
            partition = torch.zeros_like(self.master)
            for fqn, piece in self.pieces.items():
                value = optimizer.state.get(piece, {}).get(name)
                if value is not None:
                    start, stop = self.slot(fqn).master_range(self.partition_start)
                    partition[start:stop].copy_(value.reshape(-1))
            whole[name] = self._gathered(partition)
        state_by_fqn: dict[str, dict[str, Any]] = {}
        for slot in self.slots:
            infos = [rank_info[slot.fqn] for rank_info in everyone if slot.fqn in rank_info]
            if not infos or not any(info["scalars"] or info["elementwise"] for info in infos):
                continue
            entry: dict[str, Any] = {}
            for name in sorted({name for info in infos for name in info["elementwise"]}):
                span = whole[name][slot.offset : slot.offset + slot.param.numel()]
                entry[name] = span.view_as(slot.param).clone()
            for key, value in infos[0]["scalars"].items():
                entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
            state_by_fqn[slot.fqn] = dict(sorted(entry.items()))
        groups = []
        for group in optimizer.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append({**hyper, "params": [slot.fqn for slot in self.slots]})
        return {"state": state_by_fqn, "param_groups": groups}

    def load_full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`full_optimizer_state_dict` produced: each rank keeps the owned
        slices of the elementwise states and the scalars of the parameters it owns a part of."""
        groups = state_dict["param_groups"]
        if len(groups) != len(optimizer.param_groups):
            raise ValueError(
                f"zero2_lib: the state dict has {len(groups)} parameter groups, the optimizer "
                f"{len(optimizer.param_groups)}; load into an optimizer built the same way"
            )
        for group, saved in zip(optimizer.param_groups, groups, strict=True):
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
        for fqn, piece in self.pieces.items():
            saved_state = state_dict["state"].get(fqn)
            if saved_state is None:
                optimizer.state.pop(piece, None)
                continue
            slot = self.slot(fqn)
            restored: dict[str, Any] = {}
            for key, value in saved_state.items():
                if _elementwise(value):
                    owned = value.reshape(-1)[slot.owned_start : slot.owned_stop]
                    restored[key] = owned.detach().clone().to(device=piece.device)
                else:
                    restored[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
            optimizer.state[piece] = restored


def _elementwise(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _unique_named_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``named_parameters()`` of the model, tied parameters once (under their first name)."""
    return list(module.named_parameters())


def wrap(module: nn.Module, group: dist.ProcessGroup | None = None, stage: int = 2) -> nn.Module:
    """Apply ZeRO ``stage`` (2, or 0: replicated) to ``module`` in place (broadcasting rank 0's
    parameters) and return it."""
    Zero2(module, group, stage)
    return module


def engine_of(module: nn.Module) -> Zero2:
    """The ZeRO-2 state of a module :func:`wrap` returned."""
    engine = _ENGINES.get(module)
    if engine is None:
        raise ValueError(f"zero2_lib: {type(module).__name__} was not wrapped; call zero2_lib.wrap(model) first")
    return engine
