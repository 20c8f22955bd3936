"""The protocol's vocabulary: the words scenarios and adapters share.

Strategies, API forms, state-dict kinds, the :class:`Capability` a scenario may need and the
:class:`SpecCondition` a combination may name beside them, the :class:`ShardingSpec` that says
what to shard, the :class:`Misuse` a scenario commits on purpose, and the plain values passed
across the protocol (:class:`BackendEnv`, :class:`ShardEvent`, :data:`OptimizerFactory`). Nothing
here depends on a backend or on what a backend declares.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh


class ShardingStrategy(enum.Enum):
    """Our strategy names; adapters map them onto their backend's own knobs."""

    FULL_SHARD = "FULL_SHARD"  # params, grads, optimizer state sharded; reshard after forward
    SHARD_GRAD_OP = "SHARD_GRAD_OP"  # like FULL_SHARD but keep params unsharded forward->backward
    NO_SHARD = "NO_SHARD"  # replicate everything, all-reduce grads (DDP-like)
    HYBRID_SHARD = "HYBRID_SHARD"  # FULL_SHARD inside a shard group, replicate across groups
    # Params and grads replicated (grads all-reduced), only optimizer state sharded (ZeRO-1).
    SHARD_OPTIM_STATE = "SHARD_OPTIM_STATE"
    # Params replicated; grads reduced to the rank that owns them and optimizer state sharded
    # (ZeRO-2). Not FSDP's SHARD_GRAD_OP, which also shards parameters at rest.
    SHARD_GRAD_AND_OPTIM_STATE = "SHARD_GRAD_AND_OPTIM_STATE"


class ApiForm(enum.Enum):
    """How sharding is applied: a wrapper module around the model, or in place on the model."""

    WRAPPER = "wrapper"
    COMPOSABLE = "composable"


class StateDictKind(enum.Enum):
    FULL = "full"  # every rank gets plain, unsharded tensors keyed by the original FQNs
    # Every rank gets its shard of each tensor, keyed by the original FQNs, in the backend's
    # sharded tensor type: DTensor (FSDP2; FSDP1 given a mesh) or ShardedTensor (FSDP1).
    SHARDED = "sharded"


class Capability(enum.Enum):
    """Features a scenario may need. The value is the text shown in the skip reason."""

    WRAPPER = "wrapper form"
    COMPOSABLE = "composable form"
    AUTO_WRAP = "auto-wrap by module class"
    FULL_SHARD = "strategy FULL_SHARD"
    SHARD_GRAD_OP = "strategy SHARD_GRAD_OP"
    NO_SHARD = "strategy NO_SHARD"
    HYBRID_SHARD = "strategy HYBRID_SHARD"
    MIXED_PRECISION = "mixed precision param dtype"
    CPU_OFFLOAD = "parameter CPU offload"
    IGNORED_MODULES = "ignored modules"
    FLAT_PARAMETERS = "use_orig_params=False (flat parameters)"
    UNSHARD = "unshard context"
    UNSHARD_WRITEBACK = "unshard writeback=True"
    UNSHARD_RANK0_ONLY = "unshard rank0_only=True"
    UNSHARD_OFFLOAD_TO_CPU = "unshard offload_to_cpu=True"
    UNSHARD_NON_RECURSIVE = "unshard recurse=False"
    UNSHARD_WITH_GRADS = "unshard with_grads=True"
    FULL_STATE_DICT = "full state dict"
    SHARDED_STATE_DICT = "sharded state dict"
    OPTIM_STATE_DICT = "optimizer state dict"
    EXEC_ORDER_CHECK = "execution order validation"
    TENSOR_PARALLEL = "2-D: sharding a model whose parameters are tensor-parallel DTensors"
    INTROSPECT_UNSHARDED = "introspection: is a unit's storage unsharded"
    INTROSPECT_UNIT_FQNS = "introspection: FQNs managed by each unit"
    INTROSPECT_EVENTS = "introspection: unshard/reshard event order"
    # Exact storage (protocol 4): how many elements a unit's unsharded storage holds right now
    # (BackendAdapter.unsharded_storage_numel), checked against the declared SHARD_LAYOUT.
    INTROSPECT_STORAGE = "introspection: elements of a unit's allocated unsharded storage"
    # Structural features of a ShardingSpec (see ShardingSpec and docs/writing-an-adapter.md).
    UNITS = "sharding units below the root (auto-wrap classes or manual units)"
    UNMANAGED_ROOT = "shard_root=False (a plain, unmanaged root over sharded units)"
    MIXED_STRATEGIES = "per-unit strategy overrides (several strategies in one model)"
    SHARD_OPTIM_STATE = "strategy SHARD_OPTIM_STATE"
    SHARD_GRAD_AND_OPTIM_STATE = "strategy SHARD_GRAD_AND_OPTIM_STATE"
    # Mixed-precision gradient reduction in float32 (ShardingSpec.reduce_dtype=torch.float32)
    # while computing in param_dtype (protocol 5). Without it, a mixed-precision backend reduces
    # in param_dtype, the libraries' default.
    REDUCE_DTYPE = "mixed precision reduce_dtype=float32 (gradients reduced in full precision)"
    # The backend's switch that lets backward accumulate local gradients without reducing them
    # (torch FSDP1 no_sync, FSDP2 set_requires_gradient_sync(False), DeepSpeed's accumulation
    # boundary): BackendAdapter.no_gradient_sync (protocol 5).
    NO_SYNC = "gradient accumulation without gradient sync (no_gradient_sync)"
    # The backend's own sharded checkpoint (save / load of model and optimizer through its
    # format, opaque to the suite): checked by round trip, for backends whose sharded state is
    # neither DTensor nor ShardedTensor (see BackendAdapter.save_checkpoint).
    NATIVE_CHECKPOINT = "native sharded checkpoint (save_checkpoint / load_checkpoint)"
    # Clipping the gradients the next step applies to one total norm over every rank's pieces
    # (BackendAdapter.clip_grad_norm, protocol 7): FSDP1's FullyShardedDataParallel.clip_grad_norm_,
    # torch.nn.utils.clip_grad_norm_ over FSDP2's DTensors, DeepSpeed's gradient_clipping.
    GRADIENT_CLIPPING = "gradient clipping by the total norm over ranks (clip_grad_norm)"
    # Optimizer parameter groups chosen by parameter name (per-group lr and weight decay, no
    # decay for biases), kept through the optimizer state dict: BackendAdapter.make_optimizer_with_groups
    # (protocol 8).
    PARAMETER_GROUPS = "optimizer parameter groups by parameter name (make_optimizer_with_groups)"

    @classmethod
    def for_strategy(cls, strategy: ShardingStrategy) -> Capability:
        return cls[strategy.name]

    @classmethod
    def for_form(cls, form: ApiForm) -> Capability:
        return cls[form.name]

    @classmethod
    def for_state_dict(cls, kind: StateDictKind) -> Capability:
        return cls.FULL_STATE_DICT if kind is StateDictKind.FULL else cls.SHARDED_STATE_DICT


class SpecCondition(enum.Enum):
    """Values of spec fields that need no capability (every backend has them) but that a backend
    may not support together with one: ``UNSUPPORTED_COMBINATIONS`` may name them beside
    capabilities, e.g. ``{Capability.OPTIM_STATE_DICT, SpecCondition.ORIGINAL_PARAMETERS}`` for
    "optimizer state dicts only with flat parameters". The value is the text of the skip reason."""

    ORIGINAL_PARAMETERS = "use_orig_params=True (original parameters)"
    SHARDED_ROOT = "shard_root=True (the root is a unit)"
    FULL_PRECISION = "param_dtype=None (no mixed precision)"
    PARAMETERS_ON_DEVICE = "offload_params=False (parameters on the device)"


# What a combination names: capabilities, and spec-field values that are no capability.
Requirement = Capability | SpecCondition


@dataclass(frozen=True)
class ShardingSpec:
    """What to shard and how, independent of any backend.

    Units: with ``auto_wrap_classes`` every submodule of those classes becomes its own unit;
    with ``manual_units`` the listed submodules (FQNs from the model root) become units. Then
    the root is sharded too, unless ``shard_root`` is False (a plain root with sharded
    children). Units are sharded innermost first, as nesting requires.

    ``mesh``: the DeviceMesh to shard over; None means the default process group. HYBRID_SHARD
    needs a 2-D mesh whose dims are (replicate, shard): without one a backend may fall back to
    a topology guess that silently stops syncing gradients across replica groups.

    ``strategy_overrides`` maps the root ("") or a manual unit's FQN to a strategy for that
    unit only (auto-wrapped units all share ``strategy``).
    """

    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    auto_wrap_classes: tuple[type[nn.Module], ...] = ()
    manual_units: tuple[str, ...] = ()
    shard_root: bool = True
    mesh: DeviceMesh | None = None
    param_dtype: torch.dtype | None = None
    # The dtype gradients are reduced in under mixed precision: None reduces in param_dtype (the
    # libraries' default); torch.float32 reduces in full precision (Capability.REDUCE_DTYPE).
    reduce_dtype: torch.dtype | None = None
    offload_params: bool = False
    ignored_modules: tuple[str, ...] = ()
    use_orig_params: bool = True
    check_exec_order: bool = False
    strategy_overrides: Mapping[str, ShardingStrategy] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.auto_wrap_classes and self.manual_units:
            raise ValueError("ShardingSpec: give auto_wrap_classes or manual_units, not both")
        for fqn in self.manual_units:
            if not fqn:
                raise ValueError(
                    "ShardingSpec.manual_units lists submodule FQNs; the root is controlled by "
                    "shard_root, not by an empty FQN"
                )
        stray = set(self.strategy_overrides) - {"", *self.manual_units}
        if stray:
            raise ValueError(
                f"ShardingSpec.strategy_overrides names {sorted(stray)}, which are not units: "
                "override the root ('') or FQNs listed in manual_units"
            )
        if self.reduce_dtype is not None and self.param_dtype is None:
            raise ValueError(
                "ShardingSpec.reduce_dtype is the gradient reduction dtype of mixed precision: "
                "give param_dtype too, or leave reduce_dtype None"
            )
        for strategy in self.strategies():
            if strategy is ShardingStrategy.HYBRID_SHARD and (self.mesh is None or self.mesh.ndim != 2):
                raise ValueError(
                    "HYBRID_SHARD needs an explicit 2-D mesh (replicate, shard): pass "
                    "ShardingSpec(mesh=fixtures.hybrid_mesh(world_size, device))"
                )

    def strategy_for(self, unit_fqn: str) -> ShardingStrategy:
        return self.strategy_overrides.get(unit_fqn, self.strategy)

    def strategies(self) -> set[ShardingStrategy]:
        return {self.strategy, *self.strategy_overrides.values()}

    def needed_capabilities(self, form: ApiForm) -> set[Capability]:
        """Every capability this spec uses, so an adapter can refuse before touching the model."""
        return {Capability.for_form(form)} | self.feature_capabilities()

    def conditions(self) -> set[SpecCondition]:
        """The spec-field values this spec has that are no capability (see :class:`SpecCondition`)."""
        held = {
            SpecCondition.ORIGINAL_PARAMETERS: self.use_orig_params,
            SpecCondition.SHARDED_ROOT: self.shard_root,
            SpecCondition.FULL_PRECISION: self.param_dtype is None,
            SpecCondition.PARAMETERS_ON_DEVICE: not self.offload_params,
        }
        return {condition for condition, holds in held.items() if holds}

    def feature_capabilities(self) -> set[Capability]:
        """What this spec uses besides the API form: what a scenario requires before it builds
        anything, whichever forms the backend has."""
        needed = {Capability.for_strategy(s) for s in self.strategies()}
        if self.auto_wrap_classes:
            needed.add(Capability.AUTO_WRAP)
        if self.param_dtype is not None:
            needed.add(Capability.MIXED_PRECISION)
        if self.reduce_dtype is not None and self.reduce_dtype != self.param_dtype:
            needed.add(Capability.REDUCE_DTYPE)
        if self.offload_params:
            needed.add(Capability.CPU_OFFLOAD)
        if self.ignored_modules:
            needed.add(Capability.IGNORED_MODULES)
        if not self.use_orig_params:
            needed.add(Capability.FLAT_PARAMETERS)
        if self.check_exec_order:
            needed.add(Capability.EXEC_ORDER_CHECK)
        # Structure: submodules as units of their own, a root nobody manages, per-unit strategies.
        if self.auto_wrap_classes or self.manual_units:
            needed.add(Capability.UNITS)
        if not self.shard_root:
            needed.add(Capability.UNMANAGED_ROOT)
        if len(self.strategies()) > 1:
            needed.add(Capability.MIXED_STRATEGIES)
        return needed


class Misuse(enum.Enum):
    """What scenarios do wrong on purpose; each backend declares how it refuses (``REFUSALS``)."""

    UNSHARD_DURING_FORWARD = "unshard() entered during forward"
    UNSHARD_DURING_BACKWARD = "unshard() entered during backward"
    UNSHARD_RANK0_ONLY_WITH_WRITEBACK = "unshard(rank0_only=True, writeback=True)"
    UNSHARD_OFFLOAD_TO_CPU_NO_SHARD = "unshard(offload_to_cpu=True) of a NO_SHARD unit"
    TENSOR_PARALLEL_OUTER_MESH_DIM = "tensor parallelism over the outer dimension of a 2-D mesh"


@dataclass(frozen=True)
class UnshardRequest:
    """What :meth:`BackendAdapter.unshard` was asked for, handed to an adapter's ``_unshard`` as
    one value (protocol version 6; an adapter written for an earlier version takes the options as
    keyword arguments, and still does).

    fqn: the submodule whose parameters are shown full ("" = the root).
    writeback: changes made inside persist after exit.
    rank0_only: only rank 0 materialises full parameters.
    offload_to_cpu: the full parameters live on CPU.
    recurse: False unshards only the unit at ``fqn``, not units nested in it.
    with_grads: gradients are unsharded too.
    """

    fqn: str = ""
    writeback: bool = True
    rank0_only: bool = False
    offload_to_cpu: bool = False
    recurse: bool = True
    with_grads: bool = False

    def options(self) -> dict[str, bool]:
        """The options by keyword (``unshard_capabilities``; an adapter written for version 5 or
        earlier takes them so)."""
        return {
            "writeback": self.writeback,
            "rank0_only": self.rank0_only,
            "offload_to_cpu": self.offload_to_cpu,
            "recurse": self.recurse,
            "with_grads": self.with_grads,
        }


@dataclass(frozen=True)
class BackendEnv:
    """Where an adapter runs: the default process group is already initialised."""

    rank: int
    world_size: int
    device: torch.device
    # This rank's index among the ranks of its host (torchrun's LOCAL_RANK); None when the
    # caller does not know it. Libraries that read LOCAL_RANK (DeepSpeed) take it from here.
    local_rank: int | None = None


@dataclass(frozen=True)
class ShardEvent:
    """One state change of a sharded unit, named by the unit's FQN from the model root."""

    kind: str  # "unshard" or "reshard"
    unit: str


# Builds the optimizer for an iterable of parameters, e.g. functools.partial(torch.optim.Adam, lr=1e-2).
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class ParameterGroups:
    """Optimizer parameter groups chosen by parameter name, as training scripts build them (no
    weight decay for biases and norms, another learning rate for some layers): ``group_of(fqn)``
    names the group of each trained parameter by its original FQN; ``options[group]`` holds the
    group's hyperparameters over the factory's defaults. Groups come in the order of
    ``options``, each parameter in model order, so every rank and the oracle build the same
    groups; a group no parameter falls in is left out."""

    group_of: Callable[[str], str]
    options: Mapping[str, Mapping[str, Any]]

    def split(self, named: Iterable[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
        """Parameter-group dicts for a torch optimizer from (original FQN, parameter) pairs
        (parameters that do not train left out; a parameter listed twice, once)."""
        members: dict[str, list[nn.Parameter]] = {group: [] for group in self.options}
        seen: set[int] = set()
        for fqn, param in named:
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            group = self.group_of(fqn)
            if group not in members:
                raise KeyError(
                    f"ParameterGroups: group_of({fqn!r}) is {group!r}, which options does not define "
                    f"({sorted(members)}); give options an entry for every group group_of returns"
                )
            members[group].append(param)
        return [{"params": params, **self.options[group]} for group, params in members.items() if params]


@dataclass(frozen=True)
class DeferredInit:
    """How a scenario initializes a model it built on the meta device (protocol 9): ``fill(module,
    tensors)`` writes, in place, the initial values of ``module``'s own parameters and buffers
    (not its children's) into ``tensors``, by their names in the module (``"weight"``,
    ``"scale"``), each a real tensor of the full shape. It issues no collective and may be called
    for the modules in any order, once each, as FSDP1's ``param_init_fn`` and a
    ``reset_parameters()`` per module are.

    A backend that materializes a meta model itself calls ``fill`` where it does (FSDP1's
    ``param_init_fn``; FSDP2 after ``fully_shard`` and ``to_empty``, writing the shard of the full
    values it filled); :meth:`materialize` is what a backend without such a mechanism needs
    before it shards."""

    fill: Callable[[nn.Module, Mapping[str, torch.Tensor]], None]

    @staticmethod
    def own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
        """``module``'s own parameters and buffers by name (None entries left out)."""
        own: dict[str, torch.Tensor] = {}
        for name, param in module.named_parameters(recurse=False):
            own[name] = param
        for name, buffer in module.named_buffers(recurse=False):
            own[name] = buffer
        return own

    def materialize_module(self, module: nn.Module, device: torch.device) -> None:
        """Give ``module``'s own meta parameters and buffers storage on ``device``
        (``to_empty(recurse=False)``) and fill them."""
        if any(t.is_meta for t in self.own_tensors(module).values()):
            module.to_empty(device=device, recurse=False)
        with torch.no_grad():
            self.fill(module, self.own_tensors(module))

    def materialize(self, model: nn.Module, device: torch.device) -> nn.Module:
        """Every module of ``model`` materialized on ``device`` and filled; returns ``model``."""
        for module in model.modules():
            self.materialize_module(module, device)
        return model
