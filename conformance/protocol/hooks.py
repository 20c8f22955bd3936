"""Optional hooks: what an adapter may override, each with a plain-torch default.

The training loop a scenario drives (``make_optimizer``, ``zero_grad``, ``backward``,
``clip_grad_norm``, ``step``),
the per-rank storage of a parameter (``local_shard`` and its setters, gradient twins and
optimizer state), the gradient-accumulation switch (``no_gradient_sync``), the
label of the collective being issued (``collective_label``) and the end of a test (``close``).
A backend that owns its training loop or keeps its shards outside ``param`` (DeepSpeed)
overrides them; every other backend inherits the defaults. Protocol versions list which version
added each (:mod:`conformance.protocol.versions`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from conformance.protocol.vocabulary import OptimizerFactory, ParameterGroups


class BackendHooks:
    """The optional hooks of an adapter with their defaults.

    A base of :class:`~conformance.protocol.adapter.BackendAdapter`. The storage hooks map names
    through ``original_fqn`` (declared beside ``WRAPPER_COMPONENTS`` in
    :class:`~conformance.protocol.facts.BackendFacts`).
    """

    # -- training loop (optional hooks; the defaults are plain torch) ----------------------
    # A scenario that trains calls only these, in this order (docs/writing-an-adapter.md,
    # "The training-loop contract"):
    #
    #     optim = backend.make_optimizer(sharded, factory)   # once, before the first forward
    #     for each iteration:
    #         backend.zero_grad(sharded, optim)
    #         loss = loss_of(sharded(*inputs))
    #         backend.backward(sharded, loss)
    #         backend.clip_grad_norm(sharded, optim, max_norm)   # where the program clips
    #         backend.step(sharded, optim)
    #
    # A backend that owns its training loop (DeepSpeed builds the optimizer into its engine and
    # runs engine.backward / engine.step) overrides them; nothing global is patched.

    def make_optimizer(self, model: nn.Module, factory: OptimizerFactory) -> torch.optim.Optimizer:
        """The optimizer that trains ``model``: called once, after :meth:`shard`, before the
        first forward. Default: ``factory(model.parameters())``.

        A backend that must own the optimizer builds it from ``factory`` here. The result is
        an opaque handle to scenarios: they pass it back to :meth:`zero_grad`, :meth:`step`
        and the optimizer state dict methods, and call nothing on it themselves.
        """
        return factory(model.parameters())

    def make_optimizer_with_groups(
        self, model: nn.Module, factory: OptimizerFactory, groups: ParameterGroups
    ) -> torch.optim.Optimizer:
        """:meth:`make_optimizer` with parameter groups chosen by name (optional capability
        ``PARAMETER_GROUPS``; protocol 8): the optimizer steps each trained parameter with its
        group's options (``groups.options``) over the factory's defaults, and its state dict
        keeps them. Called instead of :meth:`make_optimizer`, once, after :meth:`shard`.
        Default: ``factory(groups.split(...))`` over ``model.named_parameters()`` by their
        original FQNs (:meth:`original_fqn`), right where the optimizer steps the parameters
        the module exposes (torch FSDP2's DTensors, FSDP1's original parameters). A backend
        that builds its optimizer itself in :meth:`make_optimizer` (a ZeRO optimizer over
        partitions, an engine that owns it) overrides this too, handing it the group dicts."""
        named = [(self.original_fqn(name), param) for name, param in model.named_parameters()]
        return factory(groups.split(named))

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` (a scalar computed from ``model``'s output) and leave the
        reduced gradients where the backend keeps them. Default: ``loss.backward()``."""
        loss.backward()

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Apply one optimizer step with the current gradients. Default: ``optimizer.step()``."""
        optimizer.step()

    def clip_grad_norm(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float
    ) -> torch.Tensor | None:
        """Clip the gradients the next :meth:`step` applies so that their total norm, over the
        whole model and every rank, is at most ``max_norm`` (optional capability
        ``GRADIENT_CLIPPING``; protocol 7). Called on every rank between the step's last
        :meth:`backward` and :meth:`step` (it may be collective).

        Returns the total norm before clipping (a scalar tensor, the same on every rank: the norm
        of the averaged gradient one process holding every parameter would compute), or None
        for a backend that clips inside its own step (DeepSpeed's ``gradient_clipping``): its
        :meth:`step` then applies the clip, and only the training that follows is checked.

        Default: ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``, right where
        every rank holds its gradients whole (DDP, ZeRO-1) or as DTensors (FSDP2: the norm is
        reduced over their mesh); a backend that stores plain-tensor shards (FSDP1's flat
        parameters, ZeRO-2 partitions) must override it, or its norm is the local one."""
        norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def zero_grad(self, model: nn.Module, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        """Drop the gradients before the next backward. Default:
        ``optimizer.zero_grad(set_to_none=set_to_none)``. ``set_to_none=False`` keeps zero-filled
        gradients (an optimizer step then still moves Adam's moments); a hook without the keyword
        is called without it, and generated programs never ask it for zeros."""
        optimizer.zero_grad(set_to_none=set_to_none)

    # -- storage: what this rank holds of a parameter --------------------------------------
    # ``fqn`` names a parameter of the module shard() returned, as original_fqn() gives its
    # name in ``model.named_parameters()`` (flat parameters keep their own names). None of
    # these issue a collective, so a scenario may call them on some ranks only.

    def named_parameter(self, model: nn.Module, fqn: str) -> nn.Parameter:
        """The parameter object of ``model`` that :meth:`original_fqn` names ``fqn``."""
        names = []
        for name, param in model.named_parameters(remove_duplicate=False):
            original = self.original_fqn(name)
            if original == fqn:
                return param
            names.append(original)
        raise KeyError(f"{type(self).__name__}: no parameter {fqn!r}; the sharded model has {names}")

    def local_shard(self, model: nn.Module, fqn: str) -> torch.Tensor:
        """A detached copy of what this rank stores of parameter ``fqn``.

        In the backend's own layout: any shape, empty where this rank stores nothing of it,
        padding included where the backend pads. Default: the parameter itself, or its
        local shard when it is a DTensor. Under DeepSpeed ZeRO-3 ``param`` is an empty
        placeholder and the shard lives elsewhere, which is why scenarios ask here.
        """
        return _local_tensor(self.named_parameter(model, fqn)).detach().clone()

    def set_local_shard(self, model: nn.Module, fqn: str, value: torch.Tensor) -> None:
        """Overwrite this rank's stored part of ``fqn`` with ``value`` (shaped like
        :meth:`local_shard`'s result), everywhere the backend keeps it (a master copy an
        optimizer holds included), so later gathers and steps see it."""
        _copy_into(_local_tensor(self.named_parameter(model, fqn)), value, fqn)

    def local_grad_shard(self, model: nn.Module, fqn: str) -> torch.Tensor | None:
        """A detached copy of this rank's stored gradient of ``fqn`` (layout as
        :meth:`local_shard`), or None when this rank stores no gradient for it.
        Default: ``param.grad`` or its DTensor local shard."""
        grad = self.named_parameter(model, fqn).grad
        return None if grad is None else _local_tensor(grad).detach().clone()

    def set_local_grad_shard(self, model: nn.Module, fqn: str, value: torch.Tensor) -> None:
        """Overwrite this rank's stored gradient of ``fqn`` (which must exist) with ``value``."""
        grad = self.named_parameter(model, fqn).grad
        if grad is None:
            raise ValueError(f"{fqn}: this rank stores no gradient to overwrite (run a backward first)")
        _copy_into(_local_tensor(grad), value, f"{fqn} gradient")

    def local_optim_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, fqn: str
    ) -> dict[str, torch.Tensor]:
        """Detached copies of the optimizer-state tensors this rank stores for parameter ``fqn``
        (e.g. Adam's ``exp_avg`` and ``exp_avg_sq``), by state name; empty where this rank
        stores none for it (the parameter's state lives on another rank, or the optimizer has
        not stepped). Scalars kept per parameter (Adam's ``step``) are left out: they say
        nothing of how the state is split. ``optimizer`` is what :meth:`make_optimizer`
        returned. Default: ``optimizer.state[param]``, DTensors as their local shard.

        Override where the state is kept elsewhere than under the parameter object (DeepSpeed's
        flat fp32 partitions, an optimizer wrapping a per-rank inner optimizer)."""
        state = optimizer.state.get(self.named_parameter(model, fqn), {})
        return {
            name: _local_tensor(value).detach().clone()
            for name, value in state.items()
            if isinstance(value, torch.Tensor) and value.dim() > 0
        }

    # -- gradient accumulation (optional capability NO_SYNC) ---------------------------------
    def no_gradient_sync(self, model: nn.Module) -> AbstractContextManager[None]:
        """Context in which micro-batches accumulate this rank's local gradients without
        reducing them across ranks: a scenario runs each accumulated micro-batch's forward and
        :meth:`backward` inside it (torch DDP and FSDP1 decide in forward whether the next
        backward reduces). The first micro-batch run after the context reduces the sum of
        everything accumulated, so a step then sees the same gradients as without the switch
        (torch FSDP1 ``no_sync``, FSDP2 ``set_requires_gradient_sync(False)``, DDP
        ``no_sync``). Only called where ``Capability.NO_SYNC`` is declared."""
        raise AssertionError(f"{type(self).__name__} declares NO_SYNC but lacks no_gradient_sync")

    # -- collective labels and lifetime ------------------------------------------------------
    def collective_label(self) -> str | None:
        """What the collective being issued right now carries (e.g. ``"unit1.inp.weight,
        unit1.inp.bias"``), or None to leave it to the harness (the running module's FQN).

        The rank fixture registers this with the harness's collective trace for the duration
        of each test, so the divergence diff names what two same-shaped collectives moved.
        Called inside every traced collective: cheap, no collectives, no exceptions.
        """
        return None

    def close(self) -> None:  # an optional hook: doing nothing is the right default
        """Called once after each test body (passed or not), before the harness destroys
        the process groups the test created. Drop what the backend caches across models
        (e.g. process groups a library keeps in module globals). Default: nothing."""


def _local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``tensor``: a DTensor's local shard, else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _copy_into(target: torch.Tensor, value: torch.Tensor, what: str) -> None:
    if value.shape != target.shape:
        raise ValueError(
            f"{what}: this rank stores shape {tuple(target.shape)}, got a value of shape "
            f"{tuple(value.shape)} (write what local_shard / local_grad_shard returned, modified)"
        )
    with torch.no_grad():
        target.copy_(value)
