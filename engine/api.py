"""The two public entry points over one core: `fully_shard` (in place) and `ShardedModule`."""
from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from . import state_dict as _state_dict
from .config import ShardingStrategy
from .mixed_precision import MixedPrecision
from .flat_param import collect_params
from .state import WRAPPED_ATTR, _managed_by, clean_fqn, make_root, register_hooks, unit_of
from .topology import Topology, build_topology, check_tensor_parallel_mesh
from .unit import ShardedUnit

_absorbed: dict[int, "weakref.ref[torch.Tensor]"] = {}  # id -> original now inside a unit


def _forget(key: int) -> Callable[["weakref.ref[torch.Tensor]"], None]:
    """Drop the entry when its tensor dies (unless the id was reused meanwhile)."""

    def callback(ref: "weakref.ref[torch.Tensor]") -> None:
        if _absorbed.get(key) is ref:
            del _absorbed[key]

    return callback


def _is_absorbed(param: torch.Tensor) -> bool:
    alive = _absorbed.get(id(param))
    return alive is not None and alive() is param


@dataclass(frozen=True)
class _Options:
    strategy: ShardingStrategy
    auto_wrap_classes: Optional[tuple[type, ...]]
    ignored_modules: tuple[nn.Module, ...]
    mixed_precision: Optional[MixedPrecision]
    offload_params: bool
    mesh: Optional[DeviceMesh]
    process_group: Optional[dist.ProcessGroup]
    shard_group_size: Optional[int]
    device: Optional[torch.device]
    check_exec_order: bool


def fully_shard(
    module: nn.Module,
    *,
    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
    auto_wrap_classes: Optional[Iterable[type]] = None,
    ignored_modules: Optional[Iterable[nn.Module]] = None,
    mixed_precision: Optional[MixedPrecision] = None,
    offload_params: bool = False,
    mesh: Optional[DeviceMesh] = None,
    process_group: Optional[dist.ProcessGroup] = None,
    shard_group_size: Optional[int] = None,
    device: Optional[torch.device] = None,
    check_exec_order: bool = True,
) -> nn.Module:
    """Shard `module` in place (and submodules of `auto_wrap_classes` as their own units).

    Apply it to submodules first and to their ancestor last; the last application becomes the
    root whose FQNs label collectives.  Returns `module` itself.
    """
    options = _options(locals())
    _apply(module, options, wrap_child=None)
    return module


def _options(arguments: dict[str, Any]) -> _Options:
    classes = arguments["auto_wrap_classes"]
    return _Options(
        strategy=arguments["strategy"],
        auto_wrap_classes=tuple(classes) if classes is not None else None,
        ignored_modules=tuple(arguments["ignored_modules"] or ()),
        mixed_precision=arguments["mixed_precision"],
        offload_params=arguments["offload_params"],
        mesh=arguments["mesh"],
        process_group=arguments["process_group"],
        shard_group_size=arguments["shard_group_size"],
        device=torch.device(arguments["device"]) if arguments["device"] is not None else None,
        check_exec_order=arguments["check_exec_order"],
    )


def _apply(
    module: nn.Module,
    options: _Options,
    wrap_child: Optional[Callable[[nn.Module, Topology, torch.device], nn.Module]],
    topology: Optional[Topology] = None,
    device: Optional[torch.device] = None,
) -> None:
    _check_layout(module)
    ignored = _expand_ignored(module, options.ignored_modules)
    if device is None:
        device = _resolve_device(module, ignored, options.device)
    if topology is None:
        topology = build_topology(
            options.strategy, device, options.mesh, options.process_group, options.shard_group_size
        )
    if options.auto_wrap_classes:
        wrapped = _auto_wrap(module, module, options, ignored, topology, device, wrap_child)
        classes = tuple(options.auto_wrap_classes)
        if wrapped == 0 and not any(isinstance(m, classes) for m in module.modules() if m is not module):
            # Matches that all sit inside ignored modules are fine: the policy did apply.
            names = ", ".join(c.__name__ for c in options.auto_wrap_classes)
            raise ValueError(
                f"auto_wrap_classes ({names}) matched no submodule of {type(module).__name__}; "
                "pass the classes of submodules that exist in the model, or omit auto_wrap_classes"
            )
    _make_unit(module, options, ignored, topology, device)
    make_root(module, options.check_exec_order)


def _check_layout(module: nn.Module) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected an nn.Module to shard, got {type(module).__name__}")
    if unit_of(module) is not None:
        raise ValueError(
            f"{type(module).__name__} is already sharded; apply the engine once per module"
        )
    owner = _managed_by.get(module)
    if owner is not None:
        raise ValueError(
            f"{type(module).__name__} is already managed by the sharded module "
            f"{type(owner.module).__name__}; apply the engine to submodules first, then to "
            "their ancestors"
        )


def _expand_ignored(module: nn.Module, ignored_modules: tuple[nn.Module, ...]) -> set[nn.Module]:
    inside = set(module.modules())
    ignored: set[nn.Module] = set()
    for ignored_module in ignored_modules:
        if ignored_module is module:
            raise ValueError("the module being sharded cannot itself be ignored; shard its parent")
        if ignored_module not in inside:
            raise ValueError(
                f"ignored module {type(ignored_module).__name__} is not a submodule of "
                f"{type(module).__name__}; pass only submodules of the module being sharded"
            )
        ignored.update(ignored_module.modules())
    return ignored


def _local_modules(unit_module: nn.Module, ignored: set[nn.Module]) -> list[tuple[str, nn.Module]]:
    """(prefix, module) pairs whose parameters `unit_module`'s unit manages."""
    found: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(prefix: str, module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        found.append((prefix, module))
        for name, child in module.named_children():
            if child in ignored or unit_of(child) is not None:
                continue
            visit(f"{prefix}{name}.", child)

    visit("", unit_module)
    return found


def _resolve_device(
    module: nn.Module, ignored: set[nn.Module], requested: Optional[torch.device]
) -> torch.device:
    devices = {
        p.device
        for _, m in _local_modules_recursive(module, ignored)
        for p in m._parameters.values()
        if p is not None
    }
    if requested is not None:
        return requested
    if len(devices) > 1:
        listed = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(
            f"parameters to shard are on mixed devices ({listed}); move the module to one device "
            "(module.to(device)) or pass device=... to shard onto"
        )
    return devices.pop() if devices else torch.device("cpu")


def _local_modules_recursive(module: nn.Module, ignored: set[nn.Module]) -> Iterator[tuple[str, nn.Module]]:
    """All not-yet-sharded modules under `module` (what auto-wrap and the root will manage)."""
    for name, submodule in module.named_modules():
        if submodule in ignored or submodule in _managed_by:
            continue
        yield name, submodule


def _auto_wrap(
    root: nn.Module,
    parent: nn.Module,
    options: _Options,
    ignored: set[nn.Module],
    topology: Topology,
    device: torch.device,
    wrap_child: Optional[Callable[[nn.Module, Topology, torch.device], nn.Module]],
) -> int:
    """Make every matching descendant (innermost first) its own unit; returns how many."""
    wrapped = 0
    for name, child in list(parent.named_children()):
        if child in ignored or unit_of(child) is not None or child in _managed_by:
            continue
        wrapped += _auto_wrap(root, child, options, ignored, topology, device, wrap_child)
        if isinstance(child, options.auto_wrap_classes):
            if wrap_child is not None:
                parent._modules[name] = wrap_child(child, topology, device)
            else:
                _make_unit(child, options, ignored, topology, device)
            wrapped += 1
    return wrapped


def _make_unit(
    unit_module: nn.Module,
    options: _Options,
    ignored: set[nn.Module],
    topology: Topology,
    device: torch.device,
) -> ShardedUnit:
    modules = _local_modules(unit_module, ignored)
    for prefix, module in modules:
        _move_local(module, device)
        for name, param in module._parameters.items():
            if param is not None and _is_absorbed(param):
                raise ValueError(
                    f"parameter {clean_fqn(prefix + name)} of {type(unit_module).__name__} is shared "
                    "with an already-sharded submodule; shard a common ancestor of all modules "
                    "using it instead (or ignore one of them)"
                )
    infos = collect_params(modules)
    for info in infos:
        if info.tp_spec is not None:
            check_tensor_parallel_mesh(info.tp_spec.mesh, clean_fqn(info.fqn))
    for info in infos:
        original = info.refs[0].module._parameters[info.refs[0].name]
        _absorbed[id(original)] = weakref.ref(original, _forget(id(original)))
    unit = ShardedUnit(
        unit_module,
        infos,
        topology,
        options.strategy,
        options.mixed_precision.param_dtype if options.mixed_precision else None,
        options.offload_params,
        device,
    )
    for _, module in modules:
        _managed_by[module] = unit
    register_hooks(unit)
    _state_dict.register_state_dict_hooks(unit)
    return unit


def _move_local(module: nn.Module, device: torch.device) -> None:
    """Move one module's own parameters and buffers (not its children's) to `device`."""
    with torch.no_grad():
        for name, param in module._parameters.items():
            if param is not None and param.device != device:
                param.data = param.data.to(device)
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


class ShardedModule(nn.Module):
    """Wrapper form of the engine: `ShardedModule(module, **same options as fully_shard)`.

    With `auto_wrap_classes`, matching submodules are replaced by nested `ShardedModule`s.
    Names (`named_parameters`, state dict keys) are those of the wrapped module: the wrapper's
    own attribute never appears in them.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
        auto_wrap_classes: Optional[Iterable[type]] = None,
        ignored_modules: Optional[Iterable[nn.Module]] = None,
        mixed_precision: Optional[MixedPrecision] = None,
        offload_params: bool = False,
        mesh: Optional[DeviceMesh] = None,
        process_group: Optional[dist.ProcessGroup] = None,
        shard_group_size: Optional[int] = None,
        device: Optional[torch.device] = None,
        check_exec_order: bool = True,
    ) -> None:
        super().__init__()
        arguments = dict(locals())
        _check_layout(module)
        setattr(self, WRAPPED_ATTR, module)
        _state_dict.register_wrapper_key_hooks(self)
        options = _options(arguments)
        self._build(options, None, None)

    def _build(self, options: _Options, topology: Optional[Topology], device: Optional[torch.device]) -> None:
        def wrap_child(child: nn.Module, child_topology: Topology, child_device: torch.device) -> nn.Module:
            nested = ShardedModule.__new__(ShardedModule)
            nn.Module.__init__(nested)
            setattr(nested, WRAPPED_ATTR, child)
            _state_dict.register_wrapper_key_hooks(nested)
            nested._build(replace(options, auto_wrap_classes=None), child_topology, child_device)
            return nested

        _apply(self, options, wrap_child, topology, device)
        _state_dict.register_wrapper_key_post_hook(self)

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return getattr(self, WRAPPED_ATTR)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == WRAPPED_ATTR:
                raise
            return getattr(self.module, name)

    def __getitem__(self, index: Any) -> Any:
        return self.module[index]  # type: ignore[index]

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for name, param in super().named_parameters(prefix, recurse, remove_duplicate):
            yield clean_fqn(name), param

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for name, buffer in super().named_buffers(prefix, recurse, remove_duplicate):
            yield clean_fqn(name), buffer
