"""A sharded unit: one module's flat parameter, its unshard/reshard and gradient reduction.

Buffers and who owns them (see `collectives.py` for the stream invariants they rely on):

* ``shard`` — this rank's chunk of the flat buffer in full precision (the master copy; on CPU
  with offload).  The optimizer updates it in place through the exposed parameters (views of
  it, or the flat parameter itself: see `params.py`).  Persistent.
* ``_full`` — the padded unsharded buffer the all-gather writes into, in the compute dtype.
  Resharding frees its storage (``resize_(0)``) and unsharding re-allocates *the same storage
  object* on the compute stream, so views autograd saved during forward see the re-gathered
  values in backward.  Never freed or resized while an all-gather into it is in flight
  (``_gather`` is waited first).  Aliases ``shard`` when one rank holds everything and nothing
  is cast or offloaded (no gather, no copy).
* ``flat_leaf`` — shares ``_full``'s storage but is a separate tensor with its own version
  counter (made with ``.data``), so collectives writing into ``_full`` never trip autograd's
  in-place checks.  Compute views are ``split`` from it; their gradients accumulate into
  ``flat_leaf.grad`` (padded, zero on padding), which is reduce-scattered as is.
* ``_staging`` — the compute-dtype / on-device copy of ``shard`` that the all-gather reads under
  mixed precision or offload.  Persistent; rewritten only by this unit's next gather, which
  runs after the previous one (same stream on CUDA; after `wait()` on CPU).
* A reduction's input (the unsharded gradient, cast to ``reduce_dtype``) and output (this rank's
  reduced chunk) belong to its `GradReduction` until `complete()`; the output, upcast to the
  master dtype and averaged, is then added to the stored gradients: the exposed parameters'
  (this rank's shard; the whole gradient where parameters are replicated), or for
  SHARD_GRAD_AND_OPTIM_STATE the optimizer partition's (`partition.py`).
* ``flat_leaf.grad`` — while gradient sync is off (`UnitContext.sync_gradients`, `engine.no_sync`)
  a backward leaves the unsharded, unreduced gradient there and autograd adds the next
  backward's into it; the first backward with sync on reduces the accumulated sum.

A unit never imports or reads the root state (`state.py`): everything it needs from outside
itself arrives in the `UnitContext` its root hands down (see that class).
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable

import torch
import torch.nn as nn

from engine import collectives
from engine.config import ShardingStrategy, StateDictSettings
from engine.flat_param import FlatLayout, ParamInfo, maybe_wrap
from engine.params import FlatParams, OriginalParams, ParamExposure
from engine.partition import OptimPartition
from engine.topology import Topology


class GradReduction:
    """One unit's gradient reduction, issued and not yet handed out.

    `complete()` waits for the collective, finishes the reduction (all-reduce across replica
    groups for HYBRID_SHARD, in the reduce dtype), upcasts the sum to the master dtype, averages
    it there and adds the result to the stored gradients.
    """

    __slots__ = ("_across_replicas", "_pending", "_reduced", "_source", "unit")

    def __init__(
        self,
        unit: ShardedUnit,
        reduced: torch.Tensor,
        pending: collectives.Pending | None,
        source: torch.Tensor,
        across_replicas: bool,
    ) -> None:
        self.unit = unit
        self._reduced = reduced
        self._pending = pending
        self._source: torch.Tensor | None = source  # the collective's input: kept until done
        self._across_replicas = across_replicas

    def abandon(self) -> None:
        """Forget the reduction without completing it (its backward failed)."""
        if self._pending is not None:
            self._pending.abandon()
        self._source = None

    def complete(self) -> None:
        if self._pending is not None:
            self._pending.wait()
        self._source = None  # the unsharded gradient may be freed now
        unit, reduced = self.unit, self._reduced
        topology = unit.topology
        if self._across_replicas:
            with collectives.labelled(unit.label):
                collectives.all_reduce_sum(reduced, topology.replicate_group)
        if reduced.dtype != unit.master_dtype:  # the sum was reduced in low precision
            reduced = reduced.to(unit.master_dtype)
        if topology.dp_world_size > 1:
            reduced.div_(topology.dp_world_size)
        if reduced.device != unit.shard.device:
            reduced = reduced.to(unit.shard.device)
        unit.store_reduced_grad(reduced)


class UnitContext:
    """What the units of one root share and may reach outside themselves (FSDP2's comm context).

    Invariants:

    * **Who creates it**: the root state (`state.RootState`), one per root, handed to every unit
      under that root by `state.make_root`; nothing else creates or assigns one.
    * **When it is valid**: from `make_root` until the engine is applied to an enclosing module,
      whose `make_root` hands the units that root's new context (events and state-dict settings
      start afresh, as they did when the unit still pointed at its root).  A unit whose context
      is None was never rooted: it records no events and must not run a backward.
    * **What it holds**: the unshard / reshard event log (`introspect.events` reads it), the
      state-dict settings (replaced and read by `state_dict.py` only), whether backward reduces
      gradients (`sync_gradients`, switched by `grad_sync.py` only), and two callbacks into the
      root's schedule: `reduction_started` (a unit's gradient reduction was issued: the root
      bounds how many are in flight and completes them at the end of backward) and `in_compute`
      (is a forward or backward of this root running; recovers from a backward that raised).
    * **What it must not hold**: units, modules or tensors, or the root's schedule state (phase,
      prefetches, forward order): those stay in `state.py`, reached only through the callbacks,
      so the unit cannot depend on how the root schedules.  The callbacks are the root's bound
      methods: the root (and its units) live as long as any unit's context, which is what the
      unit's former reference to its root cost too, and a plain Python cycle the collector frees.
    """

    __slots__ = ("events", "in_compute", "reduction_started", "state_dict", "sync_gradients")

    def __init__(
        self,
        reduction_started: Callable[[GradReduction | None], None],
        in_compute: Callable[[], bool],
    ) -> None:
        # ("unshard" | "reshard", unit module FQN), oldest first; bounded so a long training run
        # that never reads it keeps a constant footprint.
        self.events: collections.deque[tuple[str, str]] = collections.deque(maxlen=100_000)
        self.state_dict = StateDictSettings()
        # False: backward keeps each unit's unreduced gradient (gradient accumulation, no_sync).
        self.sync_gradients = True
        self.reduction_started = reduction_started
        self.in_compute = in_compute


class ShardedUnit:
    """Owns the sharded master copy of one module's parameters and moves them around."""

    def __init__(
        self,
        module: nn.Module,
        params: list[ParamInfo],
        topology: Topology,
        strategy: ShardingStrategy,
        param_dtype: torch.dtype | None,
        offload_params: bool,
        device: torch.device,
        flat_param_owner: nn.Module | None = None,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        """`flat_param_owner`: expose one flat parameter registered on that module
        (use_orig_params=False); None exposes the original parameters.  `reduce_dtype`: the
        dtype gradients are reduced in (None: the compute dtype)."""
        self.module = module
        self.topology = topology
        self.strategy = strategy
        self.device = device
        self.offload_params = offload_params
        self.layout = FlatLayout(params, topology.shard_size, topology.shard_rank)
        self.context: UnitContext | None = None  # handed down by the root (`state.make_root`)
        self.module_fqn = ""  # set by the root: unit module path relative to the root
        self.param_fqns: list[str] = [p.fqn for p in params]  # root-relative, set by the root
        self.is_unsharded = False  # `_full` holds (or, while `_gather` is pending, will hold) full values
        # True while unshard_params shows this unit's full parameters (possibly a separate
        # full-precision copy under mixed precision, with the compute buffer resharded).
        self.shown_by_unshard = False
        self.backward_prepared = False  # this backward already unsharded the unit
        self.master_dtype = _common_dtype(params)
        self.compute_dtype = param_dtype or self.master_dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        shard_device = torch.device("cpu") if offload_params else device
        self.shard = torch.zeros(self.layout.chunk, dtype=self.master_dtype, device=shard_device)
        if offload_params and device.type == "cuda":
            self.shard = self.shard.pin_memory()  # host-to-device copies can then be asynchronous
        self._fill_shard(params)
        # Shard size one without casting or offloading: compute directly on the master copy.
        self.aliases_shard = topology.shard_size == 1 and self.compute_dtype == self.master_dtype and not offload_params
        if self.aliases_shard:
            self._full = self.shard
        else:
            self._full = torch.empty(self.layout.padded_numel, dtype=self.compute_dtype, device=device)
            self._full.untyped_storage().resize_(0)
        self._staging: torch.Tensor | None = None
        self._gather: collectives.Pending | None = None  # all-gather into `_full` not yet waited
        self.flat_leaf = self._full.data
        padding = self.layout.padded_numel - self.layout.numel if not self.aliases_shard else 0
        self._split_sizes = [info.numel for info in params] + ([padding] if padding else [])
        self._grad_hook_registered = False
        # A unit whose module holds no parameter of its own (all of them in nested units) has no
        # flat parameter, as in torch FSDP1: an empty `_flat_param` would show in its module's
        # state dict under flat parameters.
        self.exposure: ParamExposure = (
            OriginalParams(self.layout, self.shard)
            if flat_param_owner is None or not params
            else FlatParams(self.layout, self.shard, flat_param_owner, self._full)
        )
        # SHARD_OPTIM_STATE / SHARD_GRAD_AND_OPTIM_STATE: what this rank's optimizer steps
        # (`partition.py`), for ZeRO-2 also where its gradient partition is stored; else None.
        self.optim_partition: OptimPartition | None = None
        if strategy.partitions_optimizer_state and self.has_params:
            self.optim_partition = OptimPartition(
                params,
                self.shard,
                topology.optim_group,
                topology.optim_size,
                topology.optim_rank,
                flat=flat_param_owner is not None,
                device=device,
            )

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

    @property
    def optimizer_params(self) -> list[nn.Parameter]:
        """What this unit contributes to `module.parameters()` outside the unshard context."""
        return self.exposure.optimizer_params()

    @property
    def flat_param(self) -> nn.Parameter | None:
        """The unit's flat parameter (use_orig_params=False), else None."""
        return self.exposure.flat_param if isinstance(self.exposure, FlatParams) else None

    @property
    def label(self) -> str:
        return ", ".join(self.param_fqns)

    @property
    def has_params(self) -> bool:
        return bool(self.layout.params)

    @property
    def partitions_grads(self) -> bool:
        """ZeRO-2: this rank stores only its optimizer partition's piece of the gradient."""
        return self.strategy is ShardingStrategy.SHARD_GRAD_AND_OPTIM_STATE and self.optim_partition is not None

    @property
    def reshard_after_forward(self) -> bool:
        return self.strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)

    @property
    def unsharded_storage_numel(self) -> int:
        """Elements currently allocated for the unsharded buffer (0 while resharded)."""
        return self._full.untyped_storage().size() // self._full.element_size()

    @property
    def has_pending_gather(self) -> bool:
        return self._gather is not None

    # ------------------------------------------------------------------ unshard / reshard
    def _log(self, event: str) -> None:
        if self.context is not None:
            self.context.events.append((event, self.module_fqn))

    def unshard(self, *, async_op: bool = False) -> None:
        """Make the padded full flat buffer hold every rank's current values.

        With `async_op` only issue the all-gather (a prefetch, or the unit's own gather issued
        before a prefetch so both are in flight together); `wait_for_unshard()` before any use.
        """
        if not self.has_params:
            return
        if self.is_unsharded:
            if not async_op:
                self.wait_for_unshard()
            return
        self.is_unsharded = True
        self._log("unshard")
        if self.aliases_shard:
            return
        storage = self._full.untyped_storage()
        if storage.size() == 0:  # allocated on the compute stream (collectives invariant 1)
            storage.resize_(self._full.numel() * self._full.element_size())
        group = self.topology.shard_group
        if group is None:  # one rank holds everything: a cast / host-to-device copy, no collective
            self._full.copy_(self.shard)
            return
        source: torch.Tensor | None = None
        gathered_from = self.shard
        if self.shard.device != self.device or self.shard.dtype != self.compute_dtype:
            if self._staging is None:
                self._staging = torch.empty(self.layout.chunk, dtype=self.compute_dtype, device=self.device)
            source, gathered_from = self.shard, self._staging
        with collectives.labelled(self.label):
            self._gather = collectives.all_gather_flat(self._full, gathered_from, group, async_op=True, source=source)
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        """Order the caller after this unit's all-gather: `_full` may be read from here on."""
        gather, self._gather = self._gather, None
        if gather is not None:
            gather.wait()

    def reshard(self) -> None:
        """Show the sharded parameters again and free the unsharded buffer."""
        if not self.is_unsharded:
            return
        try:
            # A gather still in flight (an unused prefetch) writes into `_full`: wait for it
            # before the storage goes back to the allocator (collectives invariants 3 and 4).
            self.wait_for_unshard()
        finally:
            self.is_unsharded = False
            self._log("reshard")
            self.exposure.show_idle()
            if not self.aliases_shard:
                self._full.untyped_storage().resize_(0)

    def install_compute_views(self) -> None:
        """Give modules original-shaped views of the unsharded buffer that autograd tracks.

        One `split` (not one slice per parameter) so backward assembles the flat gradient with a
        single concatenation instead of one zero-filled full-size tensor per parameter.
        """
        if self._gather is not None:
            raise RuntimeError(
                f"internal error: unit [{self.label}] would compute before its all-gather was "
                "waited; please report this engine bug"
            )
        trainable = self.exposure.requires_grad()
        leaf = self.flat_leaf
        leaf.requires_grad_(any(trainable))
        if leaf.requires_grad and not self._grad_hook_registered:
            leaf.register_post_accumulate_grad_hook(_weak_hook(self, ShardedUnit._on_grad_ready))
            self._grad_hook_registered = True
        pieces = torch.split(leaf, self._split_sizes)
        self.exposure.show_compute(
            [
                maybe_wrap(info, (piece if needs_grad else piece.detach()).view(info.shape))
                for piece, info, needs_grad in zip(pieces, self.layout.params, trainable)
            ]
        )

    # ------------------------------------------------------------------ gradients
    def _on_grad_ready(self, _leaf: torch.Tensor) -> None:
        self.context.reduction_started(self.start_grad_reduction())
        self.reshard()

    def reduce_grad(self) -> None:
        """Reduce `flat_leaf.grad` into the stored gradients, synchronously."""
        reduction = self.start_grad_reduction()
        if reduction is not None:
            reduction.complete()

    def store_reduced_grad(self, reduced: torch.Tensor) -> None:
        """Add this rank's averaged, master-dtype reduction result to the stored gradients."""
        if self.partitions_grads:
            assert self.optim_partition is not None
            self.optim_partition.accumulate_grad(reduced, self.exposure.requires_grad())
        else:
            self.exposure.accumulate_grad(reduced)

    def start_grad_reduction(self) -> GradReduction | None:
        """Issue the reduction of `flat_leaf.grad` asynchronously; None when there is no gradient
        or gradient sync is off (the gradient then stays on `flat_leaf`, where the next backward
        accumulates into it).

        The gradient is cast to `reduce_dtype` first.  The first collective (reduce-scatter over
        the shard group — for ZeRO-2 over the optimizer partition group, padded to its layout —
        or for a one-rank shard group the all-reduce over the replicas) runs while backward
        continues.
        """
        grad = self.flat_leaf.grad
        if grad is None:
            return None
        if self.context is not None and not self.context.sync_gradients:
            return None
        self.flat_leaf.grad = None
        if grad.dtype != self.reduce_dtype:
            grad = grad.to(self.reduce_dtype)
        topology = self.topology
        pending = None
        reduced = grad
        partition = self.optim_partition if self.partitions_grads else None
        with collectives.labelled(self.label):
            if partition is not None:
                reduced, pending = self._reduce_scatter_partition(grad, partition)
            elif topology.shard_group is not None:
                reduced = torch.empty(self.layout.chunk, dtype=grad.dtype, device=grad.device)
                pending = collectives.reduce_scatter_flat(reduced, grad, topology.shard_group, async_op=True)
            elif topology.replicate_group is not None:
                pending = collectives.all_reduce_sum(grad, topology.replicate_group, async_op=True)
        across_replicas = topology.shard_group is not None and topology.replicate_group is not None
        return GradReduction(self, reduced, pending, grad, across_replicas)

    def _reduce_scatter_partition(
        self, grad: torch.Tensor, partition: OptimPartition
    ) -> tuple[torch.Tensor, collectives.Pending | None]:
        """ZeRO-2: sum the whole flat gradient over the partition group, keeping this rank's
        chunk (padded to the partition layout, zeros on padding)."""
        layout = partition.layout
        if partition.group is None:  # one rank: its chunk is the whole (unpadded) gradient
            return grad[: layout.chunk], None
        padded = grad
        if grad.numel() != layout.padded_numel:
            padded = grad.new_zeros(layout.padded_numel)
            padded[: layout.numel].copy_(grad[: layout.numel])
        reduced = grad.new_empty(layout.chunk)
        return reduced, collectives.reduce_scatter_flat(reduced, padded, partition.group, async_op=True)


def _weak_hook(
    unit: ShardedUnit, method: Callable[[ShardedUnit, torch.Tensor], None]
) -> Callable[[torch.Tensor], None]:
    """A tensor hook that calls `method` on `unit` without keeping the unit alive.

    The unit holds the tensor; a hook holding the unit would close a cycle through a tensor, which
    the garbage collector cannot break while autograd's C++ side also refers to the tensor. The
    model, its buffers and its process groups would then outlive it for good.
    """
    unit_ref = weakref.ref(unit)

    def hook(tensor: torch.Tensor) -> None:
        alive = unit_ref()
        if alive is not None:
            method(alive, tensor)

    return hook


def _common_dtype(params: list[ParamInfo]) -> torch.dtype:
    dtypes = {info.refs[0].module._parameters[info.refs[0].name].dtype for info in params}
    if len(dtypes) > 1:
        names = ", ".join(sorted(str(d) for d in dtypes))
        raise ValueError(
            f"a sharded unit needs one parameter dtype, got {names}; cast the module to one "
            "dtype (e.g. module.float()) and use mixed_precision for lower-precision compute"
        )
    return dtypes.pop() if dtypes else torch.float32
