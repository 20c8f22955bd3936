"""A per-parameter DTensor data-parallel backend that gathers into temporaries, no units.

The design of torchtitan's SimpleFSDP, written here from its description: every parameter is
replaced in place by a DTensor parameter on a device mesh (``Shard(0)`` on a 1-D mesh for full
sharding, ``(Replicate(), Shard(0))`` on a (replicate, shard) mesh for hybrid sharding,
``Replicate()`` for replication), and the module's class gets a property of the parameter's name
that all-gathers it for compute: ``module.weight`` inside forward is a plain, whole autograd
temporary (``redistribute`` to replicated, ``to_local`` with partial gradients), so backward
reduce-scatters (or all-reduces) the gradient into the DTensor parameter. What is stored stays
the shard the whole time; there are no units, no hooks and no flat buffers.

``replicate_everything=True`` makes the replicating twin: the same code with every parameter
``Replicate()`` whatever was asked, a backend that trains exactly right and stores everything
on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

_MANAGED = "_per_parameter_dtensor_names"  # class attribute of a managed module's class


class _AverageGradient(torch.autograd.Function):
    """Identity forward; backward divides by the data-parallel size, so the partial gradients
    the reduction sums become their average (gloo has no AVG reduce-scatter)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, ranks: int) -> torch.Tensor:  # type: ignore[override]
        ctx.ranks = ranks
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad / ctx.ranks, None


def compute_view(stored: torch.Tensor) -> torch.Tensor:
    """What forward computes with: the stored DTensor gathered whole into a plain temporary
    whose gradient is averaged over the mesh; a plain tensor (inside ``gathered``) as it is."""
    if not isinstance(stored, DTensor):
        return stored
    replicated = [Replicate()] * stored.device_mesh.ndim
    partial = [Partial()] * stored.device_mesh.ndim
    whole = stored.redistribute(stored.device_mesh, replicated).to_local(grad_placements=partial)
    return _AverageGradient.apply(whole, stored.device_mesh.size())


def _managed_class(cls: type[nn.Module], names: tuple[str, ...]) -> type[nn.Module]:
    """A subclass of ``cls`` whose ``names`` are properties reading ``compute_view`` of the
    stored parameter (``named_parameters`` and state dicts still list the stored DTensors)."""

    def reader(name: str) -> property:
        return property(lambda self: compute_view(self._parameters[name]))

    namespace = {name: reader(name) for name in names}
    namespace[_MANAGED] = names
    return type(f"PerParameter{cls.__name__}", (cls,), namespace)


def _own_local_part(whole: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> torch.Tensor:
    """This rank's part of ``whole`` under ``placements`` (torch.chunk along each sharded dim,
    empty where a rank is past the last chunk): what ``distribute_tensor`` stores here."""
    part = whole
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            chunks = torch.chunk(part, mesh.size(mesh_dim), dim=placement.dim)
            index = mesh.get_local_rank(mesh_dim)
            part = chunks[index] if index < len(chunks) else part.narrow(placement.dim, 0, 0)
    return part


def data_parallel(
    model: nn.Module, mesh: DeviceMesh, placements: tuple[Placement, ...], *, replicate_everything: bool = False
) -> nn.Module:
    """Shard ``model`` in place: every parameter a DTensor on ``mesh`` with ``placements``."""
    if replicate_everything:
        placements = tuple(Replicate() for _ in placements)
    for module in list(model.modules()):
        names = tuple(name for name, param in module._parameters.items() if param is not None)
        if not names or hasattr(type(module), _MANAGED):
            continue
        for name in names:
            param = module._parameters[name]
            stored = distribute_tensor(param.detach(), mesh, list(placements))
            module._parameters[name] = nn.Parameter(stored, requires_grad=param.requires_grad)
        module.__class__ = _managed_class(type(module), names)
    return model


@contextlib.contextmanager
def gathered(model: nn.Module, *, writeback: bool) -> Iterator[None]:
    """Every parameter whole as a plain parameter for the body (an all-gather each); with
    ``writeback`` each rank copies its own part of what the body left back into its shard."""
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    for module in model.modules():
        for name in getattr(type(module), _MANAGED, ()):
            stored = module._parameters[name]
            whole = stored.detach().full_tensor()
            module._parameters[name] = nn.Parameter(whole, requires_grad=stored.requires_grad)
            swapped.append((module, name, stored))
    try:
        yield
    finally:
        with torch.no_grad():
            for module, name, stored in swapped:
                if writeback:
                    part = _own_local_part(module._parameters[name], stored.device_mesh, stored.placements)
                    stored.to_local().copy_(part)
                module._parameters[name] = stored
