"""Per-root runtime state and the module / autograd hooks that drive the units.

Schedule of one training step (what runs when, and what may be in flight):

* Forward, unit U's pre-hook: (first training forward: the order check's collective), then U's
  all-gather is issued; with `forward_prefetch` the all-gather of the unit that ran next in the
  first training forward is issued too, so both are in flight together; then U's gather is
  waited and U computes.  Post-hook: U reshards (FULL_SHARD / HYBRID_SHARD, except the forward
  root, which backward needs first) and registers the pre-backward hook on its outputs.
* Backward, U's pre-backward hook (first gradient reaching U's outputs): U's all-gather is issued
  if U was resharded; with `backward_prefetch` so is that of the unit that ran before U in *this*
  forward (the next one backward needs); U's gather is waited.  When U's flat gradient is
  complete (post-accumulate hook) its reduction is issued asynchronously and U reshards.
* Activation checkpointing runs a unit's forward again inside backward (its saved tensors are
  recomputed): the pre-hook then only makes sure U is gathered and installs its compute views,
  recording nothing for the order check or the prefetch, and the post-hook keeps U gathered for
  the recomputed graph's backward (U reshards when its gradient is reduced, as always).
* At most one prefetch per direction is in flight; a prefetched unit that is never used stays
  gathered until backward ends (or the root forward ends without a backward) and reshards then.
* At most `REDUCTIONS_IN_FLIGHT` reductions are in flight while backward computes: a new one
  is issued at once (its gradient exists already), then the oldest beyond the bound is
  completed, which bounds the unsharded gradients alive at once.  Autograd's final callback
  completes the rest and reshards every unit.

Every rank issues the same collectives in the same order as long as every rank runs the same
forward, which is what the exec-order check validates; only forward prefetching relies on the
forward order staying the first iteration's afterwards.

The dependency points one way: this module drives the units; a unit reaches the root only
through the `UnitContext` the root creates and `make_root` hands down (events, the root's
reduction and in-compute callbacks, state-dict settings), and `unit.py` never imports this module.
"""

from __future__ import annotations

import collections
import enum
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from engine.config import ShardingOptions
from engine.exec_order import ExecOrderValidator, ForwardOrder
from engine.mixed_precision import cast_floating
from engine.unit import GradReduction, ShardedUnit, UnitContext

WRAPPED_ATTR = "_sharded_wrapped_module"  # child name used by the wrapper class; hidden in FQNs

# One reduction in flight while backward computes, as torch FSDP2 keeps: the next one is issued
# before the previous is completed, so consecutive reductions still overlap each other, and at
# most two units' unsharded gradients are alive (measured: a second one in flight bought no
# step time on CPU and cost ~10 MiB peak RSS on the benchmark transformer).
REDUCTIONS_IN_FLIGHT = 1

# The engine's state lives on the modules themselves (instance attributes, set through __dict__
# so nn.Module's bookkeeping never sees them): a module-level WeakKeyDictionary would keep every
# sharded model alive forever, because its values (units, roots) reference their modules, and
# with them their meshes and process groups (whose gloo threads then outlive the test).
_UNIT_ATTR = "_engine_unit"  # the unit whose hooks sit on this module
_ROOT_ATTR = "_engine_root"  # the root state, on the module the engine was last applied to
_DRIVEN_BY_ATTR = "_engine_driven_by"  # the root state driving the unit whose hooks sit on this module
_MANAGED_ATTR = "_engine_managed_by"  # the unit that manages this module's own parameters


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class Direction(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


def clean_fqn(name: str) -> str:
    """Drop the wrapper's own attribute from a dotted name."""
    return name.replace(f"{WRAPPED_ATTR}.", "").replace(f".{WRAPPED_ATTR}", "").replace(WRAPPED_ATTR, "")


def unit_of(module: nn.Module) -> ShardedUnit | None:
    """The unit whose hooks sit on `module`, if any."""
    return module.__dict__.get(_UNIT_ATTR)


def managing_unit(module: nn.Module) -> ShardedUnit | None:
    """The unit that manages `module`'s own parameters, if any."""
    return module.__dict__.get(_MANAGED_ATTR)


def mark_managed(module: nn.Module, unit: ShardedUnit) -> None:
    """Record that `unit` manages `module`'s own parameters."""
    module.__dict__[_MANAGED_ATTR] = unit


def root_of(module: nn.Module) -> RootState | None:
    """The root state created when the engine was applied to `module` (outermost only)."""
    return module.__dict__.get(_ROOT_ATTR)


def resolve_root(module: nn.Module) -> RootState:
    """The root state `module` belongs to: its own, or that of the unit owning / managing it."""
    root = root_of(module)
    if root is None:
        unit = unit_of(module) or managing_unit(module)
        root = _driving_root(unit) if unit is not None else None
    if root is None:
        raise ValueError(
            f"{type(module).__name__} is not sharded by the engine; pass the module that "
            "fully_shard / ShardedModule was applied to (or one of its submodules)"
        )
    return root


def _driving_root(unit: ShardedUnit) -> RootState | None:
    """The root state whose hooks drive `unit` (None before `make_root`)."""
    return unit.module.__dict__.get(_DRIVEN_BY_ATTR)


class RootState:
    """State shared by all units under the module the engine was last applied to."""

    def __init__(self, units: list[ShardedUnit], options: ShardingOptions) -> None:
        self.units = units
        self.phase = Phase.IDLE
        self.forward_root: ShardedUnit | None = None
        # What the units may reach of this root (see `UnitContext`): `make_root` hands it down.
        self.context = UnitContext(reduction_started=self.reduction_started, in_compute=self.in_compute)
        self._unit_index = {id(unit): index for index, unit in enumerate(units)}
        self.order = ForwardOrder()
        self.exec_order: ExecOrderValidator | None = None
        if options.check_exec_order and units:
            self.exec_order = ExecOrderValidator(units[0].topology.check_group, [unit.label for unit in units])
        self.forward_prefetch = options.forward_prefetch
        self.backward_prefetch = options.backward_prefetch
        self._prefetched: dict[Direction, ShardedUnit | None] = dict.fromkeys(Direction)
        # Units whose outputs need gradients, in post-forward order (this forward): reversed,
        # the order backward unshards them in.
        self._grad_order: list[ShardedUnit] = []
        self._reductions: collections.deque[GradReduction] = collections.deque()

    # ------------------------------------------------------------------ forward
    def pre_forward(self, unit: ShardedUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._recover_from_failed_backward()
        # A forward inside backward is activation checkpointing recomputing `unit` (its saved
        # tensors are unpacked): it computes with the gathered parameters as in forward, but it
        # is no new forward, so nothing is recorded for the order check or the prefetch, and
        # `post_forward` keeps the unit gathered for the recomputed graph's backward (its
        # gradient reduction reshards it, as always).
        recomputing = self.phase is Phase.BACKWARD
        if self.phase is Phase.IDLE:
            self.phase = Phase.FORWARD
            self.forward_root = unit
            training = unit.module.training
            self.order.begin_forward(training)
            if self.exec_order is not None:
                self.exec_order.begin_forward(training)
            self._grad_order = []
        try:
            if unit.has_params and recomputing:
                unit.unshard(async_op=True)
            elif unit.has_params:
                index = self._unit_index[id(unit)]
                position = self.order.record(index)
                if self.exec_order is not None:
                    self.exec_order.before_unshard(self.order, index, position, unit.device)
                unit.unshard(async_op=True)
                if self.forward_prefetch:
                    self._prefetch(Direction.FORWARD, unit, self._forward_candidate(position))
            if unit.has_params:
                unit.wait_for_unshard()
        except BaseException:
            self._abort()
            raise
        unit.install_compute_views()
        if unit.compute_dtype != unit.master_dtype:
            args, kwargs = cast_floating((args, kwargs), unit.compute_dtype)
        return args, kwargs

    def post_forward(self, unit: ShardedUnit, output: Any) -> None:
        if self.phase is Phase.BACKWARD:
            return  # a recomputed forward (see `pre_forward`): no reshard, no new hooks
        if unit is not self.forward_root and unit.reshard_after_forward:
            unit.reshard()
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        for tensor in tensors:
            tensor.register_hook(self._pre_backward_hook(unit))
        if tensors and unit.has_params:
            self._grad_order.append(unit)
        if unit is self.forward_root:
            self.phase = Phase.IDLE
            self.forward_root = None
            if not tensors:  # no backward will follow: nothing may stay gathered
                self._reshard_all()

    def _forward_candidate(self, position: int) -> ShardedUnit | None:
        index = self.order.next_after(position)
        return self.units[index] if index is not None else None

    def _abort(self) -> None:
        self.phase = Phase.IDLE
        self.forward_root = None
        self._reshard_all()

    # ------------------------------------------------------------------ prefetch
    def _prefetch(self, direction: Direction, current: ShardedUnit, unit: ShardedUnit | None) -> None:
        """Issue `unit`'s all-gather now, while `current` is about to compute, unless it is
        gathered already or another prefetch in this direction is still in flight (at most one
        each: more gathered units cost memory without hiding more latency).  The previous
        prefetch of `current` itself is being consumed right now, so it does not count."""
        if unit is None or unit.is_unsharded or not unit.has_params:
            return
        previous = self._prefetched[direction]
        if previous is not None and previous is not current and previous.has_pending_gather:
            return
        unit.unshard(async_op=True)
        self._prefetched[direction] = unit

    def _backward_candidate(self, unit: ShardedUnit) -> ShardedUnit | None:
        """The unit that ran before `unit`'s (last) forward and will need a gather in backward."""
        order = self._grad_order
        positions = [i for i, other in enumerate(order) if other is unit]
        if not positions:
            return None
        for candidate in reversed(order[: positions[-1]]):
            if candidate is unit or candidate.backward_prepared or candidate.is_unsharded:
                continue  # already handled, or kept gathered (forward root, SHARD_GRAD_OP)
            return candidate
        return None

    # ------------------------------------------------------------------ backward
    def _pre_backward_hook(self, unit: ShardedUnit):
        def hook(grad: torch.Tensor) -> None:
            self._enter_backward()
            if not unit.backward_prepared:
                unit.backward_prepared = True
                unit.unshard(async_op=True)
                if self.backward_prefetch:
                    self._prefetch(Direction.BACKWARD, unit, self._backward_candidate(unit))
                unit.wait_for_unshard()

        return hook

    def _enter_backward(self) -> None:
        if self.phase is not Phase.BACKWARD:
            self.phase = Phase.BACKWARD
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def reduction_started(self, reduction: GradReduction | None) -> None:
        """Track an issued gradient reduction; complete the oldest beyond the in-flight bound."""
        if reduction is None:
            return
        while len(self._reductions) >= REDUCTIONS_IN_FLIGHT:
            self._reductions.popleft().complete()
        self._reductions.append(reduction)
        self._enter_backward()

    def _end_backward(self) -> None:
        """Runs once when autograd finishes: complete gradient reductions, free what is gathered."""
        try:
            while self._reductions:
                self._reductions.popleft().complete()
        finally:
            self._reshard_all()
            for unit in self.units:
                unit.backward_prepared = False
            self._grad_order = []
            self.phase = Phase.IDLE

    def _reshard_all(self) -> None:
        """Reshard every unit, even when waiting for one's gather fails (raise that afterwards)."""
        failure: BaseException | None = None
        for unit in self.units:
            try:
                unit.reshard()
            except BaseException as error:  # noqa: BLE001 - re-raised below
                failure = failure or error
        if failure is not None:
            raise failure

    def _recover_from_failed_backward(self) -> None:
        """A backward that raised never runs its final callback: drop its state once it is over."""
        if self.phase is Phase.BACKWARD and torch._C._current_graph_task_id() == -1:
            # Its reductions may not have been issued on every rank: never complete them.  Gloo
            # keeps their buffers alive until its own work ends; on CUDA, order the compute
            # stream after them before their buffers can be reused.
            for reduction in self._reductions:
                reduction.abandon()
            self._reductions.clear()
            self._end_backward()

    def in_compute(self) -> bool:
        """Whether a forward or backward of this root is running (one that raised is over)."""
        self._recover_from_failed_backward()
        return self.phase is not Phase.IDLE


def register_hooks(unit: ShardedUnit) -> None:
    """Attach the forward hooks that unshard / reshard `unit` around its module's forward."""

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return module.__dict__[_DRIVEN_BY_ATTR].pre_forward(unit, args, kwargs)

    def post_hook(module: nn.Module, args: tuple, output: Any) -> None:
        module.__dict__[_DRIVEN_BY_ATTR].post_forward(unit, output)

    unit.module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    unit.module.register_forward_hook(post_hook, always_call=True)  # also when forward raises
    unit.module.__dict__[_UNIT_ATTR] = unit


def make_root(module: nn.Module, options: ShardingOptions) -> RootState:
    """(Re)build the root state for every unit under `module`, fixing their root-relative FQNs."""
    names: dict[nn.Module, str] = {}
    for name, submodule in module.named_modules(remove_duplicate=False):
        names.setdefault(submodule, name)
    units: list[ShardedUnit] = []
    for submodule, name in names.items():
        unit = unit_of(submodule)
        if unit is None or unit in units:
            continue
        unit.module_fqn = clean_fqn(name)
        unit.param_fqns = []
        for info in unit.layout.params:
            ref = info.refs[0]
            owner = names[ref.module]
            unit.param_fqns.append(clean_fqn(f"{owner}.{ref.name}" if owner else ref.name))
        units.append(unit)
    for submodule in names:
        submodule.__dict__.pop(_ROOT_ATTR, None)
    root = RootState(units, options)
    for unit in units:
        unit.context = root.context
        unit.module.__dict__[_DRIVEN_BY_ATTR] = root
    module.__dict__[_ROOT_ATTR] = root
    return root
