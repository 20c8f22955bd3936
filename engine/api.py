"""The two public entry points over one core: `fully_shard` (in place) and `ShardedModule`."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.nn as nn

from engine import state_dict as _state_dict
from engine.config import ShardingOptions, resolve_options
from engine.flat_param import collect_params
from engine.state import WRAPPED_ATTR, clean_fqn, make_root, managing_unit, mark_managed, register_hooks, unit_of
from engine.topology import Topology, build_topology, check_tensor_parallel_mesh
from engine.unit import ShardedUnit

_absorbed: dict[int, weakref.ref[torch.Tensor]] = {}  # id -> original now inside a unit


def _forget(key: int) -> Callable[[weakref.ref[torch.Tensor]], None]:
    """Drop the entry when its tensor dies (unless the id was reused meanwhile)."""

    def callback(ref: weakref.ref[torch.Tensor]) -> None:
        if _absorbed.get(key) is ref:
            del _absorbed[key]

    return callback


def _is_absorbed(param: torch.Tensor) -> bool:
    alive = _absorbed.get(id(param))
    return alive is not None and alive() is param


def fully_shard(module: nn.Module, options: ShardingOptions | None = None, /, **option_overrides: Any) -> nn.Module:
    """Shard `module` in place (and submodules of `auto_wrap_classes` as their own units).

    Options: a :class:`ShardingOptions`, keywords naming its fields, or both (keywords win).
    Apply it to submodules first and to their ancestor last; the last application becomes the
    root whose FQNs label collectives.  Returns `module` itself.
    """
    _apply(module, resolve_options(options, option_overrides), wrap_child=None)
    return module


def _apply(
    module: nn.Module,
    options: ShardingOptions,
    wrap_child: Callable[[nn.Module, Topology, torch.device], nn.Module] | None,
    topology: Topology | None = None,
    device: torch.device | None = None,
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
            names = ", ".join(c.__name__ for c in classes)
            raise ValueError(
                f"auto_wrap_classes ({names}) matched no submodule of {type(module).__name__}; "
                "pass the classes of submodules that exist in the model, or omit auto_wrap_classes"
            )
    _make_unit(module, options, ignored, topology, device)
    make_root(module, options)


def _check_layout(module: nn.Module) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected an nn.Module to shard, got {type(module).__name__}")
    if unit_of(module) is not None:
        raise ValueError(f"{type(module).__name__} is already sharded; apply the engine once per module")
    owner = managing_unit(module)
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


def _resolve_device(module: nn.Module, ignored: set[nn.Module], requested: torch.device | None) -> torch.device:
    devices = {
        p.device for _, m in _local_modules_recursive(module, ignored) for p in m._parameters.values() if p is not None
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
        if submodule in ignored or managing_unit(submodule) is not None:
            continue
        yield name, submodule


def _auto_wrap(
    root: nn.Module,
    parent: nn.Module,
    options: ShardingOptions,
    ignored: set[nn.Module],
    topology: Topology,
    device: torch.device,
    wrap_child: Callable[[nn.Module, Topology, torch.device], nn.Module] | None,
) -> int:
    """Make every matching descendant (innermost first) its own unit; returns how many."""
    wrapped = 0
    for name, child in list(parent.named_children()):
        if child in ignored or unit_of(child) is not None or managing_unit(child) is not None:
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
    options: ShardingOptions,
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
            if options.strategy.partitions_optimizer_state:
                raise NotImplementedError(
                    f"{clean_fqn(info.fqn)} is tensor-parallel: {options.strategy.name} does not partition "
                    "tensor-parallel parameters; shard the data-parallel dimension with FULL_SHARD or NO_SHARD"
                )
            check_tensor_parallel_mesh(info.tp_spec.mesh, clean_fqn(info.fqn))
    for info in infos:
        original = info.refs[0].module._parameters[info.refs[0].name]
        _absorbed[id(original)] = weakref.ref(original, _forget(id(original)))
    # Flat mode registers `_flat_param` on the module the user holds as the unit: the unit's
    # module for the composable form, the wrapped module for the wrapper (as torch FSDP1 does).
    flat_param_owner = None if options.use_orig_params else unit_module._modules.get(WRAPPED_ATTR, unit_module)
    unit = ShardedUnit(
        unit_module,
        infos,
        topology,
        options.strategy,
        options.param_dtype,
        options.offload_params,
        device,
        flat_param_owner=flat_param_owner,
        reduce_dtype=options.reduce_dtype,
    )
    for _, module in modules:
        mark_managed(module, unit)
    register_hooks(unit)
    _state_dict.register_state_dict_hooks(unit)
    return unit


def _move_local(module: nn.Module, device: torch.device) -> None:
    """Move one module's own parameters and buffers (not its children's) to `device`."""
    with torch.no_grad():
        for param in module._parameters.values():
            if param is not None and param.device != device:
                param.data = param.data.to(device)
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


class ShardedModule(nn.Module):
    """Wrapper form of the engine: `ShardedModule(module, [ShardingOptions], **option keywords)`.

    With `auto_wrap_classes`, matching submodules are replaced by nested `ShardedModule`s.
    Names (`named_parameters`, state dict keys) are those of the wrapped module: the wrapper's
    own attribute never appears in them.
    """

    def __init__(self, module: nn.Module, options: ShardingOptions | None = None, /, **option_overrides: Any) -> None:
        super().__init__()
        resolved = resolve_options(options, option_overrides)
        _check_layout(module)
        setattr(self, WRAPPED_ATTR, module)
        _state_dict.register_wrapper_key_hooks(self)
        self._build(resolved, None, None)

    def _build(self, options: ShardingOptions, topology: Topology | None, device: torch.device | None) -> None:
        def wrap_child(child: nn.Module, child_topology: Topology, child_device: torch.device) -> nn.Module:
            nested = ShardedModule.__new__(ShardedModule)
            nn.Module.__init__(nested)
            setattr(nested, WRAPPED_ATTR, child)
            _state_dict.register_wrapper_key_hooks(nested)
            nested._build(replace(options, auto_wrap_classes=()), child_topology, child_device)
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
