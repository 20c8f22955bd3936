"""Per-root runtime state and the module / autograd hooks that drive the units."""
from __future__ import annotations

import collections
import enum
import weakref
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from .exec_order import ExecOrderValidator
from .mixed_precision import cast_floating
from .unit import ShardedUnit

WRAPPED_ATTR = "_sharded_wrapped_module"  # child name used by the wrapper class; hidden in FQNs

_unit_of_module: "weakref.WeakKeyDictionary[nn.Module, ShardedUnit]" = weakref.WeakKeyDictionary()
_root_of_module: "weakref.WeakKeyDictionary[nn.Module, RootState]" = weakref.WeakKeyDictionary()
# every module whose own parameters a unit manages (unit modules included)
_managed_by: "weakref.WeakKeyDictionary[nn.Module, ShardedUnit]" = weakref.WeakKeyDictionary()


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


def clean_fqn(name: str) -> str:
    """Drop the wrapper's own attribute from a dotted name."""
    return name.replace(f"{WRAPPED_ATTR}.", "").replace(f".{WRAPPED_ATTR}", "").replace(WRAPPED_ATTR, "")


def unit_of(module: nn.Module) -> Optional[ShardedUnit]:
    """The unit whose hooks sit on `module`, if any."""
    return _unit_of_module.get(module)


def managing_unit(module: nn.Module) -> Optional[ShardedUnit]:
    """The unit that manages `module`'s own parameters, if any."""
    return _managed_by.get(module)


def root_of(module: nn.Module) -> Optional["RootState"]:
    """The root state created when the engine was applied to `module` (outermost only)."""
    return _root_of_module.get(module)


class RootState:
    """State shared by all units under the module the engine was last applied to."""

    def __init__(self, module: nn.Module, units: list[ShardedUnit], check_exec_order: bool) -> None:
        self.module = module
        self.units = units
        self.phase = Phase.IDLE
        self.forward_root: Optional[ShardedUnit] = None
        self.events: collections.deque[tuple[str, str]] = collections.deque(maxlen=100_000)
        self.state_dict_kind = None  # engine.config.StateDictKind, set by state_dict.py
        self.state_dict_rank0_only = False
        self.state_dict_offload_to_cpu = False
        self._unit_index = {id(unit): index for index, unit in enumerate(units)}
        self.exec_order: Optional[ExecOrderValidator] = None
        self._deferred: list[Callable[[], None]] = []
        if check_exec_order and units:
            self.exec_order = ExecOrderValidator(
                units[0].topology.check_group, [unit.label for unit in units]
            )

    # ------------------------------------------------------------------ forward
    def pre_forward(self, unit: ShardedUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._recover_from_failed_backward()
        if self.phase is Phase.IDLE:
            self.phase = Phase.FORWARD
            self.forward_root = unit
            if self.exec_order is not None:
                self.exec_order.begin_forward(unit.module.training)
        try:
            if unit.has_params and self.exec_order is not None:
                self.exec_order.before_unshard(self._unit_index[id(unit)], unit.device)
            unit.unshard()
        except BaseException:
            self._abort()
            raise
        unit.install_compute_views()
        if unit.compute_dtype != unit.master_dtype:
            args, kwargs = cast_floating((args, kwargs), unit.compute_dtype)
        return args, kwargs

    def post_forward(self, unit: ShardedUnit, output: Any) -> None:
        if unit is not self.forward_root and unit.reshard_after_forward:
            unit.reshard()
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        for tensor in tensors:
            tensor.register_hook(self._pre_backward_hook(unit))
        if unit is self.forward_root:
            self.phase = Phase.IDLE
            self.forward_root = None
            if not tensors:  # no backward will follow: nothing may stay gathered
                for other in self.units:
                    other.reshard()

    def _abort(self) -> None:
        self.phase = Phase.IDLE
        self.forward_root = None
        for unit in self.units:
            unit.reshard()

    # ------------------------------------------------------------------ backward
    def _pre_backward_hook(self, unit: ShardedUnit):
        def hook(grad: torch.Tensor) -> None:
            self._enter_backward()
            if not unit.backward_prepared:
                unit.backward_prepared = True
                unit.unshard()

        return hook

    def _enter_backward(self) -> None:
        if self.phase is not Phase.BACKWARD:
            self.phase = Phase.BACKWARD
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def defer_until_backward_ends(self, work: Callable[[], None]) -> None:
        """Run `work` when autograd finishes this backward (in the order deferred)."""
        self._deferred.append(work)
        self._enter_backward()

    def _end_backward(self) -> None:
        """Runs once when autograd finishes: complete gradient reductions, free what is gathered."""
        deferred, self._deferred = self._deferred, []
        for work in deferred:
            work()
        for unit in self.units:
            unit.reshard()
            unit.backward_prepared = False
        self.phase = Phase.IDLE

    def _recover_from_failed_backward(self) -> None:
        """A backward that raised never runs its final callback: drop its state once it is over."""
        if self.phase is Phase.BACKWARD and torch._C._current_graph_task_id() == -1:
            self._deferred = []  # its reductions may not have been issued on every rank
            self._end_backward()

    @property
    def in_compute(self) -> bool:
        self._recover_from_failed_backward()
        return self.phase is not Phase.IDLE


def register_hooks(unit: ShardedUnit) -> None:
    """Attach the forward hooks that unshard / reshard `unit` around its module's forward."""

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return unit.root.pre_forward(unit, args, kwargs)

    def post_hook(module: nn.Module, args: tuple, output: Any) -> None:
        unit.root.post_forward(unit, output)

    unit.module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    unit.module.register_forward_hook(post_hook, always_call=True)  # also when forward raises
    _unit_of_module[unit.module] = unit


def make_root(module: nn.Module, check_exec_order: bool) -> RootState:
    """(Re)build the root state for every unit under `module`, fixing their root-relative FQNs."""
    names: dict[nn.Module, str] = {}
    for name, submodule in module.named_modules(remove_duplicate=False):
        names.setdefault(submodule, name)
    units: list[ShardedUnit] = []
    for submodule, name in names.items():
        unit = _unit_of_module.get(submodule)
        if unit is None or unit in units:
            continue
        unit.module_fqn = clean_fqn(name)
        unit.param_fqns = []
        for info in unit.layout.params:
            ref = info.refs[0]
            owner = names[ref.module]
            unit.param_fqns.append(clean_fqn(f"{owner}.{ref.name}" if owner else ref.name))
        units.append(unit)
    for submodule in list(_root_of_module.keys()):
        if submodule in names:
            del _root_of_module[submodule]
    root = RootState(module, units, check_exec_order)
    for unit in units:
        unit.root = root
    _root_of_module[module] = root
    return root
