"""What ``DeepSpeedAdapter.shard`` returns (``DeepSpeedModel``: the user's model and, once built, its
engine) and where DeepSpeed keeps each rank's state: the engine, its base optimizer, a parameter's
reduced gradient fragment and fp32 master, the layout of ZeRO's flat optimizer state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from conformance.protocol import OptimizerFactory, ShardingSpec, submodule

# The child name under which our wrapper holds the model: the adapter's one wrapper component.
WRAPPED = "_deepspeed_wrapped_module"


class DeepSpeedModel(nn.Module):
    """What :meth:`DeepSpeedAdapter.shard` returns: the user's model as its one child
    (names read ``_deepspeed_wrapped_module.<original FQN>``) and, once built, the
    DeepSpeedEngine that runs it.

    The engine is kept outside the module tree: it holds the same model, and registering it
    would list every parameter twice.
    """

    def __init__(self, module: nn.Module, spec: ShardingSpec, config: dict[str, Any], units: list[str]) -> None:
        super().__init__()
        self._deepspeed_wrapped_module = module
        self.spec = spec
        self.config = config
        self.units = units  # unit FQNs, innermost first, root ("") last
        self.engine: Any = None
        self.param_group_fqns: list[list[str]] = []  # the optimizer's groups, by parameter FQN
        self.build_engine: Callable[[DeepSpeedModel, OptimizerFactory | None], Any] | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "engine":  # not a submodule (see the class docstring)
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    @property
    def module(self) -> nn.Module:
        """The user's model (the engine holds the same object as ``engine.module``)."""
        return self._deepspeed_wrapped_module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.engine is None:
            assert self.build_engine is not None
            self.build_engine(self, None)
        dtype = self.spec.param_dtype
        if dtype is not None:
            # DeepSpeed's fp16/bf16 modes cast the model, not its inputs: a DeepSpeed training
            # loop feeds inputs in the compute dtype itself (torch FSDP casts them for you).
            args, kwargs = cast_floating((args, kwargs), dtype)
        return self.engine(*args, **kwargs)

    def stage(self) -> int:
        return self.config["zero_optimization"]["stage"]

    def own_params(self, unit: str) -> list[nn.Parameter]:
        """Parameters of the unit at ``unit`` that no unit nested in it manages."""
        nested = [u for u in self.units if u != unit and (unit == "" or u.startswith(f"{unit}."))]
        inside_nested = {id(p) for fqn in nested for p in submodule(self.module, fqn).parameters()}
        return [p for p in submodule(self.module, unit).parameters() if id(p) not in inside_nested]


def engine_for_checkpoint(model: nn.Module) -> Any:
    """The DeepSpeed engine behind ``model`` (built by make_optimizer)."""
    engine = root_of(model).engine
    if engine is None:
        raise RuntimeError("deepspeed adapter: a checkpoint needs the engine; call make_optimizer first")
    return engine


def root_of(model: nn.Module) -> DeepSpeedModel:
    if not isinstance(model, DeepSpeedModel):
        raise TypeError(f"deepspeed adapter: expected the module shard() returned, got {type(model).__name__}")
    return model


def engine_of(model: nn.Module) -> Any:
    root = root_of(model)
    if root.engine is None:
        raise RuntimeError("deepspeed adapter: no engine yet: call make_optimizer (or run a forward) first")
    return root.engine


def base_optimizer(root: DeepSpeedModel) -> torch.optim.Optimizer:
    """The torch optimizer the scenario's factory built (ZeRO wraps it as ``.optimizer``)."""
    optimizer = getattr(root.engine, "optimizer", None)
    if optimizer is None:
        raise RuntimeError("deepspeed adapter: no optimizer: call make_optimizer first")
    return getattr(optimizer, "optimizer", optimizer) if root.stage() > 0 else optimizer


def reduced_grad_fragment(root: DeepSpeedModel, param: nn.Parameter) -> torch.Tensor | None:
    """ZeRO-1/2: this rank's part of ``param``'s reduced gradient, an empty tensor where its
    partition holds none of ``param``, None where the optimizer holds no reduced gradients of
    ``param``'s group (before the first backward, after step).

    DeepSpeed keeps the reduced gradients of a boundary backward per flat group and partition
    (``averaged_gradients``) until step; a parameter's ``_hp_mapping`` names its fragment there
    (``safe_get_full_grad`` reads the same). ``safe_get_local_grad`` is defined for ZeRO-3 only."""
    optimizer = getattr(root.engine, "optimizer", None)
    groups = getattr(optimizer, "bit16_groups", None)
    if groups is None:
        return None  # no engine yet
    group_index = next((i for i, group in enumerate(groups) if any(p is param for p in group)), None)
    if group_index is not None and getattr(optimizer, "cpu_offload", False):
        # ZeRO-Offload: a boundary backward copies the reduced gradients of this rank's partition
        # into the grad of its fp32 partition on the host, not into averaged_gradients (found by a
        # generated program: offload_params under ZeRO-2 reported no gradient anywhere).
        flat = optimizer.single_partition_of_fp32_groups[group_index]
        mapping = getattr(param, "_hp_mapping", None)
        if flat.grad is None:
            return None
        if mapping is None:
            return torch.empty(0, dtype=flat.grad.dtype, device=flat.grad.device)
        address = mapping.hp_fragment_address
        return flat.grad.narrow(0, address.start, address.numel)
    reduced = getattr(optimizer, "averaged_gradients", {})
    if group_index is None or reduced.get(group_index) is None:
        return None
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return torch.empty(0, dtype=reduced[group_index][0].dtype, device=param.device)
    return mapping.get_lp_grad_fragment(param._index_in_param_group)


def stage0_master(root: DeepSpeedModel, param: nn.Parameter) -> torch.Tensor:
    """What the stage-0 torch optimizer keys ``param``'s state by: the parameter itself, or under
    bf16/fp16 the fp32 master copy DeepSpeed's FP16 optimizer wrapper steps in its place."""
    optimizer = root.engine.optimizer
    for low, master in zip(getattr(optimizer, "fp16_groups", ()), getattr(optimizer, "fp32_groups", ())):
        for low_param, master_param in zip(low, master):
            if low_param is param:
                return master_param
    return param


def zero_state_layout(base: torch.optim.Optimizer) -> tuple[list[str], dict[str, Any]]:
    """Under ZeRO the base optimizer steps flat fp32 partitions: its elementwise states
    (Adam's exp_avg, ...) belong to the parameters laid out in them, its scalar states (step)
    to the whole group; every flat group is stepped together, so they agree."""
    elementwise: list[str] = []
    scalars: dict[str, Any] = {}
    for flat_state in base.state.values():
        for key, value in flat_state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                if key not in elementwise:
                    elementwise.append(key)
            else:
                scalars.setdefault(key, value)
    return elementwise, scalars


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor in it (tuples, lists, dicts) cast to ``dtype``."""
    if torch.is_tensor(value):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(cast_floating(item, dtype) for item in value)
    if isinstance(value, dict):
        return {key: cast_floating(item, dtype) for key, item in value.items()}
    return value


def copied(value: Any) -> Any:
    return value.detach().clone() if torch.is_tensor(value) else value


def all_ranks_or_none(action: Callable[[], None], device: torch.device) -> None:
    """Run ``action`` on every rank; if it raised anywhere, raise on every rank.

    DeepSpeed's loaders can fail on some ranks only (a size check on the last rank); the
    others would otherwise walk into the next collective and wait for the timeout.
    """
    error: BaseException | None = None
    try:
        action()
    except Exception as caught:  # noqa: BLE001 - re-raised below, on this rank and the others
        error = caught
    failed = torch.tensor([error is not None], dtype=torch.int32, device=device)
    dist.all_reduce(failed)
    if error is not None:
        raise error
    if failed.item():
        raise RuntimeError(f"{int(failed.item())} other rank(s) failed here; see their report")
