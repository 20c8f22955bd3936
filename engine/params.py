"""What a unit's modules show as their parameters, in each state and parameter mode.

A unit keeps its original parameters in one flat buffer (see `flat_param.py`). Which tensor
`module.weight` resolves to depends on the unit's state and on `use_orig_params`:

=================  ==========================================  ======================================
state              OriginalParams (use_orig_params=True)        FlatParams (use_orig_params=False)
=================  ==========================================  ======================================
IDLE (sharded)     an nn.Parameter per original parameter:      a plain view of the unsharded buffer
                   a view of this rank's piece of the shard     (in ``module.__dict__``; valid while
                   (in ``module._parameters``)                  the buffer is allocated); the unit's
                                                                module holds ``_flat_param`` = shard
COMPUTE            autograd views of the unsharded buffer       the same views, in ``module.__dict__``
                   (in ``module._parameters``)                  (``_flat_param`` stays registered)
FULL (unshard      full nn.Parameters under the original names in ``module._parameters``, in the
context)           original registration order; ``_flat_param`` is deregistered meanwhile
=================  ==========================================  ======================================

So outside the unshard context ``named_parameters()`` lists what the optimizer updates: the
per-parameter shards, or one ``_flat_param`` per unit.  Gradients are stored on those same
objects; the accessors below let the rest of the engine read and write them without caring
which mode a unit is in.
"""

from __future__ import annotations

import enum

import torch
import torch.nn as nn

from engine.flat_param import FlatLayout, maybe_wrap

FLAT_PARAM_NAME = "_flat_param"


class Shown(enum.Enum):
    IDLE = "idle"
    COMPUTE = "compute"
    FULL = "full"


Snapshot = tuple[Shown, list[torch.Tensor]]


class _Exposure:
    """What both modes share: the state machine of what modules show; `_apply` does the showing."""

    layout: FlatLayout
    _idle: list[torch.Tensor]  # what the IDLE state shows

    def _start(self, idle: list[torch.Tensor]) -> None:
        self._idle = idle
        self._show(Shown.IDLE, idle)

    def show_idle(self) -> None:
        self._show(Shown.IDLE, self._idle)

    def show_compute(self, views: list[torch.Tensor]) -> None:
        self._show(Shown.COMPUTE, views)

    def show_full(self, params: list[nn.Parameter]) -> None:
        self._show(Shown.FULL, params)

    def snapshot(self) -> Snapshot:
        return self._state, list(self._shown)

    def restore(self, snapshot: Snapshot) -> None:
        self._show(*snapshot)

    def _show(self, state: Shown, tensors: list[torch.Tensor]) -> None:
        self._apply(state, tensors)
        self._state, self._shown = state, list(tensors)

    def _apply(self, state: Shown, tensors: list[torch.Tensor]) -> None:
        raise NotImplementedError


class OriginalParams(_Exposure):
    """`use_orig_params=True`: the optimizer sees one nn.Parameter per original parameter."""

    def __init__(self, layout: FlatLayout, shard: torch.Tensor) -> None:
        self.layout = layout
        # Views of the master shard: the optimizer's in-place updates land in the shard itself.
        self.params = [
            nn.Parameter(layout.sharded_view(shard, info), requires_grad=info.requires_grad) for info in layout.params
        ]
        self._start(list(self.params))

    # -- what modules show ------------------------------------------------------------------
    def optimizer_params(self) -> list[nn.Parameter]:
        return list(self.params)

    def requires_grad(self) -> list[bool]:
        return [param.requires_grad for param in self.params]

    def _apply(self, state: Shown, tensors: list[torch.Tensor]) -> None:
        # Every state lives in `_parameters`; assigning into an existing key keeps the module's
        # registration order.
        for info, tensor in zip(self.layout.params, tensors):
            for ref in info.refs:
                ref.module._parameters[ref.name] = tensor

    # -- gradients ----------------------------------------------------------------------------
    def has_grad(self) -> bool:
        return any(param.grad is not None for param in self.params)

    def grad_chunk(self) -> torch.Tensor | None:
        """This rank's gradients laid out as its chunk of the flat buffer (zeros where absent)."""
        return self.layout.grads_as_chunk(self.params)

    def stored_grad_views(self) -> list[torch.Tensor | None]:
        """Original-shaped stored gradients; only meaningful when one rank holds everything."""
        return [
            param.grad.view(info.shape) if param.grad is not None else None
            for info, param in zip(self.layout.params, self.params)
        ]

    def param_has_grad(self) -> list[bool]:
        return [param.grad is not None for param in self.params]

    def accumulate_grad(self, reduced: torch.Tensor) -> None:
        """Add this rank's reduced chunk to the stored gradients (views of it where absent)."""
        self.layout.accumulate_grads(self.params, reduced)

    def write_grad_chunk(self, chunk: torch.Tensor) -> None:
        """Overwrite the stored gradients (those that exist) with this rank's `chunk`."""
        for info, param in zip(self.layout.params, self.params):
            if param.grad is not None:
                param.grad.copy_(self.layout.sharded_view(chunk, info))


class FlatParams(_Exposure):
    """`use_orig_params=False`: the optimizer sees one flat nn.Parameter per unit.

    The flat parameter *is* the master shard (same storage): the optimizer updates the shard
    in place.  It is registered as ``_flat_param`` on `owner` (the unit's module, or the module a
    wrapper wraps).  Original parameters leave ``module._parameters`` and become plain attributes.
    """

    def __init__(self, layout: FlatLayout, shard: torch.Tensor, owner: nn.Module, full: torch.Tensor) -> None:
        flags = {info.requires_grad for info in layout.params}
        if len(flags) > 1:
            frozen = [info.fqn for info in layout.params if not info.requires_grad]
            raise ValueError(
                f"use_orig_params=False needs the parameters of one unit to agree on requires_grad, "
                f"but {frozen} are frozen and the others are not; freeze whole units (make the "
                "frozen submodules their own units) or pass use_orig_params=True"
            )
        self.layout = layout
        self.owner = owner
        self.flat_param = nn.Parameter(shard, requires_grad=flags.pop() if flags else False)
        # Each module's registration order, to rebuild `_parameters` exactly in the FULL state
        # (named_parameters() there must list names in the unsharded model's order).
        self._key_order: dict[int, tuple[nn.Module, list[str]]] = {}
        for info in layout.params:
            for ref in info.refs:
                self._key_order.setdefault(id(ref.module), (ref.module, list(ref.module._parameters)))
        # Detached original-shaped views of the unsharded buffer: they share its storage object,
        # so they show the current values whenever the buffer is allocated (always, when the
        # buffer aliases the shard).  Built once; showing them costs nothing.
        # Views can only be made while the storage is allocated (torch checks their bounds
        # then, not later), so a freed buffer is allocated for the moment it takes.
        detached = full.detach()
        storage = detached.untyped_storage()
        freed = storage.size() == 0
        if freed:
            storage.resize_(detached.numel() * detached.element_size())
        idle_views = [maybe_wrap(info, layout.full_view(detached, info)) for info in layout.params]
        if freed:
            storage.resize_(0)
        self._start(idle_views)

    # -- what modules show ------------------------------------------------------------------
    def optimizer_params(self) -> list[nn.Parameter]:
        return [self.flat_param]

    def requires_grad(self) -> list[bool]:
        return [self.flat_param.requires_grad] * len(self.layout.params)

    def _apply(self, state: Shown, tensors: list[torch.Tensor]) -> None:
        if state is Shown.FULL:
            self._register_originals(tensors)
        else:
            self._set_attributes(tensors)

    def _set_attributes(self, tensors: list[torch.Tensor]) -> None:
        for info, tensor in zip(self.layout.params, tensors):
            for ref in info.refs:
                ref.module._parameters.pop(ref.name, None)
                # `__dict__` is looked up before nn.Module.__getattr__, so attribute reads stay
                # as cheap as for any plain attribute.
                ref.module.__dict__[ref.name] = tensor
        self.owner.__dict__.pop(FLAT_PARAM_NAME, None)
        self.owner._parameters[FLAT_PARAM_NAME] = self.flat_param

    def _register_originals(self, params: list[torch.Tensor]) -> None:
        self.owner._parameters.pop(FLAT_PARAM_NAME, None)
        by_module: dict[int, dict[str, torch.Tensor]] = {}
        for info, param in zip(self.layout.params, params):
            for ref in info.refs:
                ref.module.__dict__.pop(ref.name, None)
                by_module.setdefault(id(ref.module), {})[ref.name] = param
        for module_id, (module, keys) in self._key_order.items():
            values, current = by_module[module_id], module._parameters
            rebuilt = {key: values[key] if key in values else current.get(key) for key in keys}
            rebuilt.update((key, value) for key, value in current.items() if key not in rebuilt)
            current.clear()
            current.update(rebuilt)

    # -- gradients ----------------------------------------------------------------------------
    def has_grad(self) -> bool:
        return self.flat_param.grad is not None

    def grad_chunk(self) -> torch.Tensor | None:
        return self.flat_param.grad

    def stored_grad_views(self) -> list[torch.Tensor | None]:
        grad = self.flat_param.grad
        return [self.layout.full_view(grad, info) if grad is not None else None for info in self.layout.params]

    def param_has_grad(self) -> list[bool]:
        return [self.flat_param.grad is not None] * len(self.layout.params)

    def accumulate_grad(self, reduced: torch.Tensor) -> None:
        if not self.flat_param.requires_grad:
            return
        if self.flat_param.grad is None:
            self.flat_param.grad = reduced
        else:
            self.flat_param.grad.add_(reduced)

    def write_grad_chunk(self, chunk: torch.Tensor) -> None:
        if self.flat_param.grad is not None:
            self.flat_param.grad.copy_(chunk)


ParamExposure = OriginalParams | FlatParams
