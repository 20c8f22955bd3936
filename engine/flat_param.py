"""Flat-parameter layout: where each original parameter lives in the padded flat buffer.

The flat buffer concatenates the unit's original parameters (flattened, in registration order)
and is padded at the end to a multiple of the shard group size, so each rank owns one equal,
contiguous chunk.  Everything here is pure index arithmetic: no communication.

2-D (tensor parallel): a parameter that is already a DTensor contributes its *local* tensor to
the flat buffer (`ParamInfo.shape` is the local shape); `ParamInfo.tp_spec` keeps what is needed
to rebuild the DTensor around an unsharded view.  The collective core never sees DTensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn


@dataclass
class ParamRef:
    """One (module, attribute) slot that holds an original parameter."""

    module: nn.Module
    name: str
    fqn: str  # relative to the module the engine was applied to (fixed up for the outer root)


@dataclass
class ParamInfo:
    """An original parameter inside a flat buffer."""

    refs: list[ParamRef]  # the first is the canonical one; more when the parameter is shared
    shape: torch.Size
    offset: int
    numel: int
    requires_grad: bool
    tp_spec: TensorParallelSpec | None = None  # set for DTensor (tensor-parallel) parameters

    @property
    def fqn(self) -> str:
        return self.refs[0].fqn


@dataclass(frozen=True)
class TensorParallelSpec:
    """How to turn a local (per-TP-rank) tensor back into the original DTensor parameter."""

    mesh: Any  # DeviceMesh
    placements: tuple
    shape: torch.Size  # global
    stride: tuple[int, ...]  # global

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        """Differentiable: gradients of the DTensor flow back into `local`."""
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )


def maybe_wrap(info: ParamInfo, local: torch.Tensor) -> torch.Tensor:
    """`local` as the parameter's original type (DTensor for tensor-parallel parameters)."""
    return info.tp_spec.wrap(local) if info.tp_spec is not None else local


@dataclass
class FlatLayout:
    """Layout of one unit's flat buffer for a given shard group size and rank."""

    params: list[ParamInfo]
    shard_size: int  # ranks the buffer is sharded over
    shard_rank: int
    numel: int = field(init=False)  # real elements
    padded_numel: int = field(init=False)
    chunk: int = field(init=False)  # elements per rank

    def __post_init__(self) -> None:
        self.numel = sum(p.numel for p in self.params)
        self.chunk = -(-self.numel // self.shard_size)
        self.padded_numel = self.chunk * self.shard_size

    @property
    def chunk_start(self) -> int:
        return self.shard_rank * self.chunk

    @property
    def valid_in_chunk(self) -> int:
        """How many of this rank's chunk elements are real (the rest is padding)."""
        return max(0, min(self.chunk, self.numel - self.chunk_start))

    def local_range(self, info: ParamInfo) -> tuple[int, int]:
        """[start, end) of `info` inside this rank's chunk (empty range when it lies elsewhere)."""
        start = max(info.offset, self.chunk_start)
        end = min(info.offset + info.numel, self.chunk_start + self.chunk)
        if end <= start:
            return 0, 0
        return start - self.chunk_start, end - self.chunk_start

    def full_view(self, flat: torch.Tensor, info: ParamInfo) -> torch.Tensor:
        """`info`'s original-shaped view into an unsharded flat buffer."""
        return flat[info.offset : info.offset + info.numel].view(info.shape)

    def sharded_view(self, chunk: torch.Tensor, info: ParamInfo) -> torch.Tensor:
        """This rank's part of `info` inside a chunk-sized tensor: 1-D (possibly empty), or the
        original shape when one rank holds everything (the chunk is then the whole buffer)."""
        if self.shard_size == 1:
            return self.full_view(chunk, info)
        a, b = self.local_range(info)
        return chunk[a:b]

    def grads_as_chunk(self, params: list[torch.Tensor]) -> torch.Tensor | None:
        """The gradients of ``params`` (this layout's stored pieces, in its order) laid out as one
        chunk, zeros where a piece has none; None when none has a gradient."""
        grads = [param.grad for param in params]
        first = next((grad for grad in grads if grad is not None), None)
        if first is None:
            return None
        chunk = torch.zeros(self.chunk, dtype=first.dtype, device=first.device)
        for info, grad in zip(self.params, grads):
            if grad is not None:
                self.sharded_view(chunk, info).copy_(grad)
        return chunk

    def accumulate_grads(
        self, params: list[torch.Tensor], reduced: torch.Tensor, trainable: list[bool] | None = None
    ) -> None:
        """Add a reduced chunk to the gradients of ``params`` (this layout's stored pieces, in its
        order), the trainable ones only (``trainable``, else each piece's ``requires_grad``); a
        piece without a gradient gets a view of the chunk."""
        for index, (info, param) in enumerate(zip(self.params, params)):
            if not (param.requires_grad if trainable is None else trainable[index]):
                continue
            piece = self.sharded_view(reduced, info)
            if param.grad is None:
                param.grad = piece
            else:
                param.grad.add_(piece)

    @property
    def fqns(self) -> tuple[str, ...]:
        return tuple(p.fqn for p in self.params)


def collect_params(
    modules: list[tuple[str, nn.Module]],
) -> list[ParamInfo]:
    """Turn (prefix, module) pairs into ParamInfos, merging shared parameters into one entry."""
    by_identity: dict[int, ParamInfo] = {}
    infos: list[ParamInfo] = []
    offset = 0
    for prefix, module in modules:
        for name, param in module._parameters.items():
            if param is None:
                continue
            ref = ParamRef(module, name, f"{prefix}{name}")
            existing = by_identity.get(id(param))
            if existing is not None:
                existing.refs.append(ref)
                continue
            local = param.to_local() if hasattr(param, "to_local") else param
            tp_spec = None
            if hasattr(param, "to_local"):
                tp_spec = TensorParallelSpec(param.device_mesh, tuple(param.placements), param.shape, param.stride())
            info = ParamInfo([ref], local.shape, offset, local.numel(), param.requires_grad, tp_spec)
            by_identity[id(param)] = info
            infos.append(info)
            offset += info.numel
    return infos
