"""A sharded unit: one module's flat parameter, its unshard/reshard and gradient reduction.

Memory model (why the aliases): `_full` is the preallocated padded buffer the all-gather writes
into; resharding frees its storage (`resize_(0)`) and unsharding re-allocates the same storage,
so views saved by autograd during forward see the re-gathered values in backward.  `flat_leaf`
shares that storage but is a separate tensor object with its own version counter (made with
`.data`), so collectives writing into `_full` never trip autograd's in-place checks.  Gradients
of the original-shaped views accumulate into `flat_leaf.grad` (padded, zero on padding), which
is reduce-scattered as is.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.nn as nn

from . import collectives
from .config import ShardingStrategy
from .flat_param import FlatLayout, ParamInfo, maybe_wrap
from .topology import Topology

if TYPE_CHECKING:
    from .state import RootState


class ShardedUnit:
    """Owns the sharded master copy of one module's parameters and moves them around."""

    def __init__(
        self,
        module: nn.Module,
        params: list[ParamInfo],
        topology: Topology,
        strategy: ShardingStrategy,
        param_dtype: Optional[torch.dtype],
        offload_params: bool,
        device: torch.device,
    ) -> None:
        self.module = module
        self.topology = topology
        self.strategy = strategy
        self.device = device
        self.offload_params = offload_params
        self.layout = FlatLayout(params, topology.shard_size, topology.shard_rank)
        self.root: Optional["RootState"] = None
        self.module_fqn = ""  # set by the root: unit module path relative to the root
        self.param_fqns: list[str] = [p.fqn for p in params]  # root-relative, set by the root
        self.is_unsharded = False
        # True while unshard_params shows this unit's full parameters (possibly a separate
        # full-precision copy under mixed precision, with the compute buffer resharded).
        self.shown_by_unshard = False
        self.backward_prepared = False
        self.master_dtype = _common_dtype(params)
        self.compute_dtype = param_dtype or self.master_dtype
        shard_device = torch.device("cpu") if offload_params else device
        self.shard = torch.zeros(self.layout.chunk, dtype=self.master_dtype, device=shard_device)
        if offload_params and device.type == "cuda":
            self.shard = self.shard.pin_memory()
        self._fill_shard(params)
        self.sharded_params = [self._make_sharded_param(info) for info in params]
        self._install(self.sharded_params)
        # Shard size one without casting or offloading: compute directly on the master copy.
        self.aliases_shard = (
            topology.shard_size == 1 and self.compute_dtype == self.master_dtype and not offload_params
        )
        if self.aliases_shard:
            self._full = self.shard
        else:
            self._full = torch.empty(self.layout.padded_numel, dtype=self.compute_dtype, device=device)
            self._full.untyped_storage().resize_(0)
        self._shard_on_device: Optional[torch.Tensor] = None  # staging for offload / casting
        self.flat_leaf = self._full.data
        padding = self.layout.padded_numel - self.layout.numel if not self.aliases_shard else 0
        self._split_sizes = [info.numel for info in params] + ([padding] if padding else [])
        self._grad_hook_registered = False

    # ------------------------------------------------------------------ set-up helpers
    def _fill_shard(self, params: list[ParamInfo]) -> None:
        start = self.layout.chunk_start
        with torch.no_grad():
            for info in params:
                a, b = self.layout.local_range(info)
                if a == b:
                    continue
                original = info.refs[0].module._parameters[info.refs[0].name]
                local = original.to_local() if hasattr(original, "to_local") else original
                lo = a + start - info.offset
                self.shard[a:b].copy_(local.detach().reshape(-1)[lo : lo + b - a])

    def sharded_view(self, flat_shard: torch.Tensor, info: ParamInfo) -> torch.Tensor:
        """This rank's part of `info` inside a chunk-sized tensor (original shape if unsharded)."""
        if self.layout.shard_size == 1:
            return self.layout.full_view(flat_shard, info)
        a, b = self.layout.local_range(info)
        return flat_shard[a:b]

    def _make_sharded_param(self, info: ParamInfo) -> nn.Parameter:
        return nn.Parameter(self.sharded_view(self.shard, info), requires_grad=info.requires_grad)

    def _install(self, tensors: list[torch.Tensor]) -> None:
        """Point every module slot of every original parameter at `tensors` (one per param)."""
        for info, tensor in zip(self.layout.params, tensors):
            for ref in info.refs:
                ref.module._parameters[ref.name] = tensor

    @property
    def label(self) -> str:
        return ", ".join(self.param_fqns)

    @property
    def has_params(self) -> bool:
        return bool(self.layout.params)

    @property
    def reshard_after_forward(self) -> bool:
        return self.strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)

    @property
    def unsharded_storage_numel(self) -> int:
        """Elements currently allocated for the unsharded buffer (0 while resharded)."""
        return self._full.untyped_storage().size() // self._full.element_size()

    # ------------------------------------------------------------------ unshard / reshard
    def _log(self, event: str) -> None:
        if self.root is not None:
            self.root.events.append((event, self.module_fqn))

    def unshard(self) -> None:
        """Make the padded full flat buffer hold every rank's current values."""
        if self.is_unsharded or not self.has_params:
            return
        self.is_unsharded = True
        self._log("unshard")
        if self.aliases_shard:
            return
        storage = self._full.untyped_storage()
        if storage.size() == 0:
            storage.resize_(self._full.numel() * self._full.element_size())
        source = self.shard
        if self.topology.shard_group is None:
            self._full.copy_(source)
            return
        if source.device != self.device or source.dtype != self.compute_dtype:
            if self._shard_on_device is None:
                self._shard_on_device = torch.empty(
                    self.layout.chunk, dtype=self.compute_dtype, device=self.device
                )
            self._shard_on_device.copy_(source, non_blocking=True)
            source = self._shard_on_device
        with collectives.labelled(self.label):
            collectives.all_gather_flat(self._full, source, self.topology.shard_group)

    def reshard(self) -> None:
        """Show the sharded parameters again and free the unsharded buffer."""
        if not self.is_unsharded:
            return
        self.is_unsharded = False
        self._log("reshard")
        self._install(self.sharded_params)
        if not self.aliases_shard:
            self._full.untyped_storage().resize_(0)

    def install_compute_views(self) -> None:
        """Give modules original-shaped views of the unsharded buffer that autograd tracks.

        One `split` (not one slice per parameter) so backward assembles the flat gradient with a
        single concatenation instead of one zero-filled full-size tensor per parameter.
        """
        trainable = [p.requires_grad for p in self.sharded_params]
        leaf = self.flat_leaf
        leaf.requires_grad_(any(trainable))
        if leaf.requires_grad and not self._grad_hook_registered:
            leaf.register_post_accumulate_grad_hook(self._on_grad_ready)
            self._grad_hook_registered = True
        pieces = torch.split(leaf, self._split_sizes)
        self._install(
            [
                maybe_wrap(info, (piece if needs_grad else piece.detach()).view(info.shape))
                for piece, info, needs_grad in zip(pieces, self.layout.params, trainable)
            ]
        )

    def full_views(self) -> list[torch.Tensor]:
        """Original-shaped views of the unsharded buffer (for the unshard context)."""
        return [self.layout.full_view(self._full, info) for info in self.layout.params]

    # ------------------------------------------------------------------ gradients
    def _on_grad_ready(self, _leaf: torch.Tensor) -> None:
        finish = self.start_grad_reduction()
        if finish is not None:
            self.root.defer_until_backward_ends(finish)
        self.reshard()

    def reduce_grad(self) -> None:
        """Reduce the flat gradient into the sharded parameters' grads, synchronously."""
        finish = self.start_grad_reduction()
        if finish is not None:
            finish()

    def start_grad_reduction(self) -> Optional[Callable[[], None]]:
        """Issue the reduce-scatter of `flat_leaf.grad`; returns what completes it (or None).

        The completion (wait, all-reduce across replicas, average, hand out grads) runs when
        backward ends, so the reduce-scatter overlaps the rest of backward.
        """
        grad = self.flat_leaf.grad
        self.flat_leaf.grad = None
        if grad is None:
            return None
        if grad.dtype != self.master_dtype:
            grad = grad.to(self.master_dtype)
        work = None
        reduced = grad
        if self.topology.shard_group is not None:
            reduced = torch.empty(self.layout.chunk, dtype=grad.dtype, device=grad.device)
            with collectives.labelled(self.label):
                work = collectives.reduce_scatter_flat(reduced, grad, self.topology.shard_group, async_op=True)

        def finish(source: torch.Tensor = grad) -> None:  # `source` outlives the async op
            if work is not None:
                work.wait()
            self._finish_grad_reduction(reduced)

        return finish

    def _finish_grad_reduction(self, reduced: torch.Tensor) -> None:
        topology = self.topology
        if topology.replicate_group is not None:
            with collectives.labelled(self.label):
                collectives.all_reduce_sum(reduced, topology.replicate_group)
        if topology.dp_world_size > 1:
            reduced.div_(topology.dp_world_size)
        if reduced.device != self.shard.device:
            reduced = reduced.to(self.shard.device)
        for info, param in zip(self.layout.params, self.sharded_params):
            if not param.requires_grad:
                continue
            piece = self.sharded_view(reduced, info)
            if param.grad is None:
                param.grad = piece
            else:
                param.grad.add_(piece)


def _common_dtype(params: list[ParamInfo]) -> torch.dtype:
    dtypes = {info.refs[0].module._parameters[info.refs[0].name].dtype for info in params}
    if len(dtypes) > 1:
        names = ", ".join(sorted(str(d) for d in dtypes))
        raise ValueError(
            f"a sharded unit needs one parameter dtype, got {names}; cast the module to one "
            "dtype (e.g. module.float()) and use mixed_precision for lower-precision compute"
        )
    return dtypes.pop() if dtypes else torch.float32
