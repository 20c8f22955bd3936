"""tiny_fsdp: a deliberately small FSDP-like library that nobody here wrote an adapter for.

It stands in for "a backend the suite's authors have never seen" (issue 21): its own API, its own
flat-parameter name (``flat_shard``), its own ``ValueError`` refusals. The adapter in
``adapter.py`` was written from docs/writing-an-adapter.md alone; every scenario failure it gets
must be this library's own behaviour (recorded in ``expectations.toml``).

Sharding: ``flat=True`` flattens every parameter of the module into one buffer, padded to a
multiple of the world size, and each rank keeps its chunk as the module's only parameter
``flat_shard``; ``flat=False`` does the same per parameter, which keeps its name and holds its
chunk. A forward pre-hook all-gathers and points the modules at plain views of the full values;
after backward the full gradient is all-reduced, averaged, and this rank's chunk becomes the
shard's ``.grad``. ``replicate=True`` keeps whole buffers on every rank (gradients still
averaged).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

FLAT_NAME = "flat_shard"


class Piece:
    """One sharded buffer: the parameters ``names`` (FQNs) flattened, padded, chunked."""

    def __init__(self, module: nn.Module, names: list[str], key: str, world: int, rank: int) -> None:
        params = dict(module.named_parameters())
        self.module, self.names, self.key, self.world, self.rank = module, names, key, world, rank
        self.shapes = [params[name].shape for name in names]
        self.numels = [params[name].numel() for name in names]
        total = sum(self.numels)
        self.chunk = -(-total // world)
        with torch.no_grad():
            flat = torch.cat([params[name].detach().reshape(-1) for name in names])
            flat = torch.nn.functional.pad(flat, (0, self.chunk * world - total))
        self.shard = nn.Parameter(flat[rank * self.chunk : (rank + 1) * self.chunk].clone())

    def owner(self, name: str) -> tuple[nn.Module, str]:
        path, _, attr = name.rpartition(".")
        return self.module.get_submodule(path), attr

    def gather(self) -> torch.Tensor:
        if self.world == 1:
            return self.shard.detach().clone()
        parts = [torch.empty_like(self.shard) for _ in range(self.world)]
        dist.all_gather(parts, self.shard.detach())
        return torch.cat(parts)

    def views(self, full: torch.Tensor) -> list[torch.Tensor]:
        offsets = [0]
        for numel in self.numels:
            offsets.append(offsets[-1] + numel)
        return [full[a:b].view(shape) for a, b, shape in zip(offsets, offsets[1:], self.shapes)]

    def piece_of(self, full: torch.Tensor) -> torch.Tensor:
        return full[self.rank * self.chunk : (self.rank + 1) * self.chunk]

    def register(self) -> None:
        """Outside forward and the gathered context: the module shows the shard under ``key``."""
        owner, attr = self.owner(self.key)
        owner.__dict__.pop(attr, None)
        owner._parameters[attr] = self.shard

    def unregister(self) -> None:
        owner, attr = self.owner(self.key)
        owner._parameters.pop(attr, None)

    def point_at(self, full: torch.Tensor) -> None:
        """The covered names become plain views of ``full`` (the shard is unregistered)."""
        self.unregister()
        for name, view in zip(self.names, self.views(full)):
            owner, attr = self.owner(name)
            owner._parameters.pop(attr, None)
            object.__setattr__(owner, attr, view)


class TinyState:
    def __init__(self, module: nn.Module, replicate: bool, flat: bool) -> None:
        self.module = module
        world = 1 if replicate else dist.get_world_size()
        rank = 0 if replicate else dist.get_rank()
        names = [name for name, _ in module.named_parameters()]
        groups = [(names, FLAT_NAME)] if flat else [([name], name) for name in names]
        self.pieces = [Piece(module, covered, key, world, rank) for covered, key in groups]
        for name in names:
            path, _, attr = name.rpartition(".")
            del module.get_submodule(path)._parameters[attr]
        for piece in self.pieces:
            piece.point_at(piece.gather())
            piece.register()
        self.in_compute = False
        module.register_forward_pre_hook(self._pre_forward)
        module.register_forward_hook(self._post_forward)
        self._fulls: list[torch.Tensor] = []

    def _pre_forward(self, module: nn.Module, args: object) -> None:
        self._fulls = []
        for piece in self.pieces:
            full = piece.gather()
            if torch.is_grad_enabled():
                full.requires_grad_(True)  # autograd flows into the gathered buffer, then to the shard
                self._fulls.append(full)
            piece.point_at(full)
        self.in_compute = torch.is_grad_enabled()

    def _post_forward(self, module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        self.in_compute = False
        for piece in self.pieces:
            piece.register()
        if not self._fulls or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return output

        def backward_started(grad: torch.Tensor) -> None:
            self.in_compute = True

        output.register_hook(backward_started)
        for piece, full in zip(self.pieces, self._fulls):
            full.register_hook(self._reducer(piece))
        self._fulls = []
        return output

    def _reducer(self, piece: Piece) -> object:
        def reduce(grad: torch.Tensor) -> None:
            grad = grad.clone()
            if dist.get_world_size() > 1:
                dist.all_reduce(grad)
                grad /= dist.get_world_size()
            part = piece.piece_of(grad).clone()
            piece.shard.grad = part if piece.shard.grad is None else piece.shard.grad + part
            self.in_compute = False

        return reduce

    @contextlib.contextmanager
    def gathered(self, writeback: bool) -> Iterator[None]:
        if self.in_compute:
            raise ValueError("tiny_fsdp: cannot gather parameters while forward or backward runs")
        shown: list[tuple[Piece, list[nn.Parameter]]] = []
        for piece in self.pieces:
            piece.unregister()
            params = [nn.Parameter(view) for view in piece.views(piece.gather())]
            for name, param in zip(piece.names, params):
                owner, attr = piece.owner(name)
                owner.__dict__.pop(attr, None)
                owner._parameters[attr] = param
            shown.append((piece, params))
        try:
            yield
        finally:
            for piece, params in shown:
                for name in piece.names:
                    owner, attr = piece.owner(name)
                    owner._parameters.pop(attr, None)
                if writeback:
                    with torch.no_grad():
                        flat = torch.cat([p.detach().reshape(-1) for p in params])
                        padded = torch.nn.functional.pad(flat, (0, piece.chunk * piece.world - flat.numel()))
                        piece.shard.copy_(piece.piece_of(padded))
                piece.point_at(piece.gather())
                piece.register()


def shard_module(module: nn.Module, *, replicate: bool = False, flat: bool = True) -> nn.Module:
    """Shard ``module`` in place (see the module docstring) and return it."""
    if hasattr(module, "_tiny_fsdp"):
        raise ValueError("tiny_fsdp: module is already sharded")
    module._tiny_fsdp = TinyState(module, replicate, flat)  # type: ignore[assignment]
    return module


def state_of(module: nn.Module) -> TinyState:
    state = getattr(module, "_tiny_fsdp", None)
    if state is None:
        raise ValueError("tiny_fsdp: module is not sharded")
    return state


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    state = state_of(module)
    with state.gathered(writeback=False):
        return {name: value.detach().clone() for name, value in module.state_dict().items()}


def load_full_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    state = state_of(module)
    with state.gathered(writeback=True):
        module.load_state_dict(state_dict)
