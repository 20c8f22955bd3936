"""The backend adapter protocol: the only way scenarios talk to a sharding backend.

A scenario never imports a backend. It describes *what* to shard with a :class:`ShardingSpec`
and asks the adapter to apply it, to unshard, to produce or load state dicts, and (where the
backend allows it) to report what it is doing. Everything a backend may lack is a
:class:`Capability`; a scenario that needs one calls :func:`require`, which skips the test with
``unsupported: <capability>: <reason>`` instead of letting it pass silently.

Writing an adapter: see ``docs/writing-an-adapter.md``.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import re
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from harness import strip_path_components as strip_path_components  # re-exported for adapters


class ShardingStrategy(enum.Enum):
    """Our strategy names; adapters map them onto their backend's own knobs."""

    FULL_SHARD = "FULL_SHARD"  # params, grads, optimizer state sharded; reshard after forward
    SHARD_GRAD_OP = "SHARD_GRAD_OP"  # like FULL_SHARD but keep params unsharded forward->backward
    NO_SHARD = "NO_SHARD"  # replicate everything, all-reduce grads (DDP-like)
    HYBRID_SHARD = "HYBRID_SHARD"  # FULL_SHARD inside a shard group, replicate across groups
    # Params and grads replicated (grads all-reduced), only optimizer state sharded (ZeRO-1).
    SHARD_OPTIM_STATE = "SHARD_OPTIM_STATE"


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
    # The backend's own sharded checkpoint (save / load of model and optimizer through its
    # format, opaque to the suite): checked by round trip, for backends whose sharded state is
    # neither DTensor nor ShardedTensor (see BackendAdapter.save_checkpoint).
    NATIVE_CHECKPOINT = "native sharded checkpoint (save_checkpoint / load_checkpoint)"

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
class Refusal:
    """How a backend refuses a misuse: an exception of one of ``types`` whose message matches
    the regular expression ``pattern`` (``re.search``)."""

    types: tuple[type[BaseException], ...]
    pattern: str

    def __post_init__(self) -> None:
        if not self.types:
            raise ValueError("Refusal.types names no exception type; give the type(s) the backend raises")
        re.compile(self.pattern)  # a bad pattern fails where it is declared, not in every scenario

    def mismatch(self, error: BaseException) -> str | None:
        """What differs between ``error`` and this declaration, or None when it matches."""
        if isinstance(error, self.types) and re.search(self.pattern, str(error)):
            return None
        return f"raised {type(error).__name__}: {error}; expected {self}"

    def __str__(self) -> str:
        return f"{' or '.join(t.__name__ for t in self.types)} matching {self.pattern!r}"


_UNSHARD_IN_COMPUTE = Refusal((AssertionError,), "Cannot manually unshard parameters during forward/backward")
_NOT_SUPPORTED = Refusal((NotImplementedError,), "is not supported")

# The upstream seeds' refusals, verbatim (test_fsdp_summon_full_params.py, test_fsdp_tp_integration.py):
# what a backend that declares no REFUSALS of its own is held to, and what the torch adapters declare.
SEED_REFUSALS: Mapping[Misuse, Refusal] = {
    Misuse.UNSHARD_DURING_FORWARD: _UNSHARD_IN_COMPUTE,
    Misuse.UNSHARD_DURING_BACKWARD: _UNSHARD_IN_COMPUTE,
    Misuse.UNSHARD_RANK0_ONLY_WITH_WRITEBACK: _NOT_SUPPORTED,
    Misuse.UNSHARD_OFFLOAD_TO_CPU_NO_SHARD: _NOT_SUPPORTED,
    Misuse.TENSOR_PARALLEL_OUTER_MESH_DIM: Refusal(
        (RuntimeError,), r"Found TP device_mesh on the \d dimension of its parent mesh"
    ),
}


@dataclass(frozen=True)
class MixedPrecisionUnshard:
    """What ``unshard()`` does under mixed precision (``ShardingSpec.param_dtype``), where the
    seeds leave a backend the choice. The defaults are torch FSDP1's (the seeds').

    ``shows_compute_dtype``: inside the context parameters are in ``param_dtype`` (FSDP2 and
    DeepSpeed gather the low-precision copy) rather than the original float32 (FSDP1).
    ``root_stays_unsharded``: an unshard between forward and backward leaves the root's
    gathered low-precision parameters in place (FSDP2) rather than replacing them with the
    full-precision view and resharding the root, so that backward gathers again (FSDP1).
    Without mixed precision neither applies: an unshard changes nothing a strategy keeps gathered.
    """

    shows_compute_dtype: bool = False
    root_stays_unsharded: bool = False


class ShardLayout(enum.Enum):
    """How a backend splits a unit's parameters over the ranks (``SHARD_LAYOUT``): what each rank
    stores of a parameter (:meth:`BackendAdapter.local_shard`) and how many elements a unit's
    unsharded storage holds (:meth:`BackendAdapter.unsharded_storage_numel`), both exactly
    (:func:`expected_local_numel`, :func:`expected_unsharded_numel`).

    FLAT_UNIT (torch FSDP1, the seeds', the default): a unit's parameters, flattened in
    registration order, form one buffer padded at its end to a multiple of the world size; rank r
    stores elements [r*c, (r+1)*c) with c = ceil(padded / world size); an original parameter's
    local shard is its part of that range (empty where it has none), the flat parameter's is c
    elements. ROWS (torch FSDP2): each parameter is split along dim 0 into chunks of
    ceil(rows / world size) rows, rank r holding chunk r unpadded (empty past the last row); the
    unsharded storage of a parameter holds ceil(rows / world size) x world size rows. PER_PARAMETER
    (DeepSpeed ZeRO-3): each parameter on its own, flattened and padded to a multiple of the world
    size; every rank stores ceil(numel / world size) elements, padding included.
    """

    FLAT_UNIT = "flat buffer per unit"
    ROWS = "dim-0 chunks per parameter"
    PER_PARAMETER = "flat padded buffer per parameter"


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def expected_local_numel(
    layout: ShardLayout, shapes: list[torch.Size], index: int | None, rank: int, world_size: int
) -> int:
    """Elements rank ``rank`` stores of parameter ``index`` of a unit whose parameters have
    ``shapes`` (registration order), or of the unit's flat parameter (``index`` None, FLAT_UNIT
    only). FLAT_UNIT assumes no gaps between parameters: exact for one-parameter units, where
    the alignment padding a backend may insert between parameters cannot arise."""
    numels = [shape.numel() for shape in shapes]
    if layout is ShardLayout.FLAT_UNIT:
        chunk = _ceil_div(sum(numels), world_size)
        if index is None:
            return chunk
        start = sum(numels[:index])
        stop = start + numels[index]
        return max(0, min(stop, (rank + 1) * chunk) - max(start, rank * chunk))
    if index is None:
        raise ValueError(f"{layout.name} has no flat parameter per unit: name a parameter")
    shape = shapes[index]
    if layout is ShardLayout.ROWS:
        rows = shape[0] if len(shape) else 1
        per_row = numels[index] // rows if rows else 0
        chunk = _ceil_div(rows, world_size)
        return max(0, min(rows, (rank + 1) * chunk) - rank * chunk) * per_row
    return _ceil_div(numels[index], world_size)


def expected_unsharded_numel(layout: ShardLayout, shapes: list[torch.Size], world_size: int) -> int:
    """Elements of a unit's unsharded storage while it is allocated (padding included)."""
    numels = [shape.numel() for shape in shapes]
    if layout is ShardLayout.FLAT_UNIT:
        return _ceil_div(sum(numels), world_size) * world_size
    if layout is ShardLayout.ROWS:
        total = 0
        for shape, numel in zip(shapes, numels):
            rows = shape[0] if len(shape) else 1
            total += _ceil_div(rows, world_size) * world_size * (numel // rows if rows else 0)
        return total
    return sum(_ceil_div(numel, world_size) * world_size for numel in numels)


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


# The protocol's version. An adapter states the one it was written for (``PROTOCOL_VERSION``);
# an older one keeps running, with one warning naming what it does not declare of what came
# later and how many scenarios that costs (conformance.protocol.versions).
PROTOCOL_VERSION = 4

# The public methods that check the declared capabilities, then call the adapter's
# implementation: public name -> the method an adapter implements.
TEMPLATE_METHODS = {
    "shard": "_shard",
    "unshard": "_unshard",
    "state_dict": "_state_dict",
    "load_state_dict": "_load_state_dict",
    "optim_state_dict": "_optim_state_dict",
    "load_optim_state_dict": "_load_optim_state_dict",
    "save_checkpoint": "_save_checkpoint",
    "load_checkpoint": "_load_checkpoint",
}


# Builds the optimizer for an iterable of parameters, e.g. functools.partial(torch.optim.Adam, lr=1e-2).
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class BackendAdapter(abc.ABC):
    """Base class of every adapter. Subclasses set ``name`` and ``CAPABILITIES``.

    Every ``model`` argument is the module :meth:`shard` returned. Module FQNs in arguments
    and results are always those of the *original* model (no wrapper prefixes), so a scenario
    is written once for every backend.
    """

    name: ClassVar[str]
    CAPABILITIES: ClassVar[frozenset[Capability]]
    # The protocol version this adapter was written for; unstated means the first.
    PROTOCOL_VERSION: ClassVar[int] = 1
    # Why a capability is missing; shown in the skip reason. Missing entries read "not provided".
    UNSUPPORTED_REASONS: ClassVar[Mapping[Capability, str]] = {}
    # Capabilities the backend has one by one but not together (DeepSpeed: CPU offload, but not
    # with NO_SHARD, its ZeRO stage 0), each with the reason. require_all() skips a scenario
    # that needs every member of one, as "unsupported: <a> with <b>: <reason>".
    # Members may also be SpecConditions: spec-field values that need no capability (optimizer
    # state dicts only with flat parameters: {OPTIM_STATE_DICT, SpecCondition.ORIGINAL_PARAMETERS}).
    UNSUPPORTED_COMBINATIONS: ClassVar[Mapping[frozenset[Requirement], str]] = {}
    # Module path components the backend's *wrappers* insert between a module and its children
    # (torch FSDP1: "_fsdp_wrapped_module"). Scenarios compare parameter names after removing
    # exactly these and nothing else (see :func:`declared_fqn`): a backend that leaks any other
    # prefix into names fails. Declare them; there is no other way to have names cleaned.
    WRAPPER_COMPONENTS: ClassVar[frozenset[str]] = frozenset()
    # The adapter's own expected-failure file (conformance.suite.expectations): a path relative to the
    # file of the module that sets it, e.g. "expectations.toml" next to the adapter module, so
    # a package registered as an entry point ships its known failures with it.
    EXPECTATIONS: ClassVar[str | None] = None
    # Backend facts where backends legitimately differ, declared and then checked exactly
    # (docs/writing-an-adapter.md, "Backend facts"); prove yours as test_declared_facts.py does.
    # The name of a unit's flat parameter (with FLAT_PARAMETERS): "<unit FQN>.<name>".
    FLAT_PARAMETER_NAME: ClassVar[str] = "_flat_param"
    # How each misuse is refused; a misuse left out is held to the seeds' refusal.
    REFUSALS: ClassVar[Mapping[Misuse, Refusal]] = SEED_REFUSALS
    MIXED_PRECISION_UNSHARD: ClassVar[MixedPrecisionUnshard] = MixedPrecisionUnshard()
    # How parameters are split over the ranks (protocol 4): local_shard sizes and, with
    # INTROSPECT_STORAGE, unsharded storage sizes are checked exactly against it.
    SHARD_LAYOUT: ClassVar[ShardLayout] = ShardLayout.FLAT_UNIT
    # What the module shard() returns puts in front of every original FQN in the names it lists
    # inside the unshard context (its own child attribute, for an adapter whose root wrapper does
    # not hide itself): "" (the seeds') means named_parameters() / named_buffers() list exactly
    # the unsharded model's names. Scenarios compare raw names with it, nothing stripped.
    UNSHARDED_NAME_PREFIX: ClassVar[str] = ""
    # With TENSOR_PARALLEL: where a sharded 2-D state dict puts the values tensor parallelism
    # left whole. "2-D" (the seed's, FSDP1): on the 2-D mesh, placements (Shard(0), Replicate());
    # "dp": on the dp mesh, (Shard(0),). Tensor-parallel values are always on the 2-D mesh.
    NON_TP_2D_STATE_DICT_MESH: ClassVar[str] = "2-D"
    # Where the backend runs (conformance.suite.platforms): device kind ("cpu", "cuda") -> the torch
    # versions it runs on there, as an expectation's `when.torch` (">=2.7"; "" for every torch).
    # A device kind left out is not supported. A session whose devices or torch the backend does
    # not run on refuses it at start, once, with PLATFORM_REASONS[device kind] as the reason.
    SUPPORTED_PLATFORMS: ClassVar[Mapping[str, str]] = {"cpu": "", "cuda": ""}
    PLATFORM_REASONS: ClassVar[Mapping[str, str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _adopt_implementations(cls)
        declared = getattr(cls, "CAPABILITIES", None)
        if declared is not None and not declared & {Capability.WRAPPER, Capability.COMPOSABLE}:
            raise TypeError(
                f"{cls.__name__}.CAPABILITIES must include Capability.WRAPPER and/or "
                "Capability.COMPOSABLE: scenarios need at least one way to apply sharding"
            )

    def __init__(self, env: BackendEnv) -> None:
        self.env = env

    # -- capabilities -------------------------------------------------------------------
    def capabilities(self) -> frozenset[Capability]:
        """Override when support depends on the environment (e.g. the device)."""
        return self.CAPABILITIES

    def supports(self, capability: Capability) -> bool:
        return capability in self.capabilities()

    def unsupported_reason(self, capability: Capability) -> str:
        return self.UNSUPPORTED_REASONS.get(capability, f"the {self.name} adapter does not provide it")

    def forms(self) -> list[ApiForm]:
        return [f for f in ApiForm if self.supports(Capability.for_form(f))]

    def unsupported_combinations(self) -> Mapping[frozenset[Requirement], str]:
        """Override when it depends on the environment, like :meth:`capabilities`."""
        return self.UNSUPPORTED_COMBINATIONS

    def mixed_precision_dtypes(self) -> tuple[torch.dtype, ...]:
        """The low-precision compute dtypes ``ShardingSpec.param_dtype`` may take here,
        preferred first (scenarios with a mixed-precision axis use the first; see
        :func:`mixed_precision_dtype`). Default: float16, then bfloat16. Override when the
        backend computes in only some of them on ``env.device`` (DeepSpeed's CPU accelerator
        has bfloat16 but no float16). Only read where ``MIXED_PRECISION`` is declared."""
        return (torch.float16, torch.bfloat16)

    # -- applying sharding ----------------------------------------------------------------
    # The public methods below check every capability the call exercises (a missing one skips
    # the test as "unsupported: ...", never runs it half-supported), then call the adapter's
    # implementation (the underscored abstract method). An adapter implements those and never
    # repeats the checks: a forgotten refusal cannot happen.

    def shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
        """Shard ``model`` (already on ``env.device``) and return the module to run, after
        checking ``spec.needed_capabilities(form)`` and the declared combinations."""
        require_all(self, spec.needed_capabilities(form) | spec.conditions())
        sharded = self._shard(model, spec, form)
        self._specs()[sharded] = spec
        return sharded

    def _specs(self) -> weakref.WeakKeyDictionary[nn.Module, ShardingSpec]:
        """The spec each module :meth:`shard` returned was sharded with (for the combinations
        a later call on it completes, e.g. an optimizer state dict of a model with original
        parameters)."""
        specs = self.__dict__.get("_sharded_with")
        if specs is None:
            specs = self.__dict__["_sharded_with"] = weakref.WeakKeyDictionary()
        return specs

    def _spec_requirements(self, model: nn.Module) -> set[Requirement]:
        spec = self._specs().get(model)
        return set() if spec is None else spec.feature_capabilities() | spec.conditions()

    @abc.abstractmethod
    def _shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
        """Shard ``model`` (already on ``env.device``) and return the module to run.

        The wrapper form returns the root wrapper; the composable form returns ``model``
        itself (sharded in place). The result's ``parameters()`` are what the optimizer gets.
        Every capability the spec uses is declared (:meth:`shard` checked).
        """

    # -- unshard ------------------------------------------------------------------------
    @contextlib.contextmanager
    def unshard(
        self,
        model: nn.Module,
        fqn: str = "",
        *,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        recurse: bool = True,
        with_grads: bool = False,
    ) -> Iterator[None]:
        """Context in which the submodule at ``fqn`` ("" = root) exposes full parameters, after
        checking the capabilities these options exercise (:func:`unshard_capabilities`)."""
        options = {
            "writeback": writeback,
            "rank0_only": rank0_only,
            "offload_to_cpu": offload_to_cpu,
            "recurse": recurse,
            "with_grads": with_grads,
        }
        require_all(self, unshard_capabilities(**options) | self._spec_requirements(model))
        with self._unshard(model, fqn, **options):
            yield

    @abc.abstractmethod
    def _unshard(
        self,
        model: nn.Module,
        fqn: str = "",
        *,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        recurse: bool = True,
        with_grads: bool = False,
    ) -> AbstractContextManager[None]:
        """Context in which the submodule at ``fqn`` ("" = root) exposes full parameters.

        Inside, ``named_parameters()`` of the module :meth:`shard` returned shows full
        tensors under the original FQNs once the declared :attr:`WRAPPER_COMPONENTS` are
        removed (also with flat parameters: the originals, not the flat parameter).
        ``writeback``: changes made inside persist after exit. ``rank0_only``: only rank 0
        materialises full parameters. ``offload_to_cpu``: the full parameters live on CPU.
        ``recurse=False``: only the unit at ``fqn`` is unsharded, not units nested in it.
        ``with_grads``: gradients are unsharded too. Invalid combinations raise the backend's
        own error, declared in :attr:`REFUSALS` (scenarios check it exactly).
        """

    def original_fqn(self, name: str) -> str:
        """The original model's FQN for a name seen on a sharded model: the name without the
        declared :attr:`WRAPPER_COMPONENTS`. Scenarios use :func:`declared_fqn`, which an
        override of this method cannot widen."""
        return declared_fqn(self, name)

    # -- state dicts ----------------------------------------------------------------------
    def state_dict(self, model: nn.Module, kind: StateDictKind) -> dict[str, Any]:
        """Model state dict keyed by original FQNs (see :class:`StateDictKind`)."""
        require_all(self, {Capability.for_state_dict(kind)} | self._spec_requirements(model))
        return self._state_dict(model, kind)

    def load_state_dict(self, model: nn.Module, state_dict: Mapping[str, Any], kind: StateDictKind) -> None:
        """Load a state dict of ``kind`` produced by :meth:`state_dict` (strict)."""
        require_all(self, {Capability.for_state_dict(kind)} | self._spec_requirements(model))
        self._load_state_dict(model, state_dict, kind)

    def optim_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, kind: StateDictKind) -> dict[str, Any]:
        """Optimizer state dict keyed by parameter FQNs."""
        needed = {Capability.OPTIM_STATE_DICT, Capability.for_state_dict(kind)}
        require_all(self, needed | self._spec_requirements(model))
        return self._optim_state_dict(model, optim, kind)

    def load_optim_state_dict(
        self,
        model: nn.Module,
        optim: torch.optim.Optimizer,
        state_dict: Mapping[str, Any],
        kind: StateDictKind,
    ) -> None:
        """Load an optimizer state dict produced by :meth:`optim_state_dict`."""
        needed = {Capability.OPTIM_STATE_DICT, Capability.for_state_dict(kind)}
        require_all(self, needed | self._spec_requirements(model))
        self._load_optim_state_dict(model, optim, state_dict, kind)

    @abc.abstractmethod
    def _state_dict(self, model: nn.Module, kind: StateDictKind) -> dict[str, Any]:
        """Model state dict keyed by original FQNs (see :class:`StateDictKind`)."""

    @abc.abstractmethod
    def _load_state_dict(self, model: nn.Module, state_dict: Mapping[str, Any], kind: StateDictKind) -> None:
        """Load a state dict of ``kind`` produced by :meth:`state_dict` (strict)."""

    @abc.abstractmethod
    def _optim_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, kind: StateDictKind) -> dict[str, Any]:
        """Optimizer state dict keyed by parameter FQNs."""

    @abc.abstractmethod
    def _load_optim_state_dict(
        self,
        model: nn.Module,
        optim: torch.optim.Optimizer,
        state_dict: Mapping[str, Any],
        kind: StateDictKind,
    ) -> None:
        """Load an optimizer state dict produced by :meth:`optim_state_dict`."""

    # -- native checkpoint (optional capability) -------------------------------------------
    def save_checkpoint(self, model: nn.Module, optim: torch.optim.Optimizer, directory: str) -> None:
        """Save model and optimizer state in the backend's own sharded format under
        ``directory`` (the same path on every rank; every rank calls this). The suite never
        reads the files: it checks them by round trip (load, compare full state, train on)."""
        require_all(self, {Capability.NATIVE_CHECKPOINT} | self._spec_requirements(model))
        self._save_checkpoint(model, optim, directory)

    def load_checkpoint(self, model: nn.Module, optim: torch.optim.Optimizer, directory: str) -> None:
        """Load what :meth:`save_checkpoint` wrote into ``model`` and ``optim`` (sharded alike)."""
        require_all(self, {Capability.NATIVE_CHECKPOINT} | self._spec_requirements(model))
        self._load_checkpoint(model, optim, directory)

    def _save_checkpoint(self, model: nn.Module, optim: torch.optim.Optimizer, directory: str) -> None:
        raise AssertionError(f"{type(self).__name__} declares NATIVE_CHECKPOINT but lacks _save_checkpoint")

    def _load_checkpoint(self, model: nn.Module, optim: torch.optim.Optimizer, directory: str) -> None:
        raise AssertionError(f"{type(self).__name__} declares NATIVE_CHECKPOINT but lacks _load_checkpoint")

    # -- introspection (optional capabilities) ------------------------------------------
    def is_unsharded(self, model: nn.Module, unit: str) -> bool:
        """Whether the unit rooted at FQN ``unit`` currently holds unsharded parameter storage."""
        require(self, Capability.INTROSPECT_UNSHARDED)
        raise AssertionError(f"{type(self).__name__} declares INTROSPECT_UNSHARDED but lacks it")

    def unsharded_storage_numel(self, model: nn.Module, unit: str) -> int:
        """Elements of storage this rank holds allocated right now for the unsharded parameters
        of the unit at FQN ``unit`` (every copy counted: a compute-dtype buffer and a
        full-precision one both allocated count twice): 0 once freed; while unsharded, the
        padded size the declared ``SHARD_LAYOUT`` gives (:func:`expected_unsharded_numel`).
        Reads only (no collective). Only for sharded units (a NO_SHARD unit is never freed)."""
        require(self, Capability.INTROSPECT_STORAGE)
        raise AssertionError(f"{type(self).__name__} declares INTROSPECT_STORAGE but lacks unsharded_storage_numel")

    def unit_fqns(self, model: nn.Module) -> dict[str, list[str]]:
        """Unit FQN -> FQNs (from the model root) of the parameters that unit manages."""
        require(self, Capability.INTROSPECT_UNIT_FQNS)
        raise AssertionError(f"{type(self).__name__} declares INTROSPECT_UNIT_FQNS but lacks it")

    def record_events(self, model: nn.Module) -> AbstractContextManager[list[ShardEvent]]:
        """Context yielding a list that fills with every unshard/reshard state change."""
        require(self, Capability.INTROSPECT_EVENTS)
        raise AssertionError(f"{type(self).__name__} declares INTROSPECT_EVENTS but lacks it")

    # -- training loop (optional hooks; the defaults are plain torch) ----------------------
    # A scenario that trains calls only these, in this order (docs/writing-an-adapter.md,
    # "The training-loop contract"):
    #
    #     optim = backend.make_optimizer(sharded, factory)   # once, before the first forward
    #     for each iteration:
    #         backend.zero_grad(sharded, optim)
    #         loss = loss_of(sharded(*inputs))
    #         backend.backward(sharded, loss)
    #         backend.step(sharded, optim)
    #
    # A backend that owns its training loop (DeepSpeed builds the optimizer into its engine and
    # runs engine.backward / engine.step) overrides them; nothing global is patched.

    def make_optimizer(self, model: nn.Module, factory: OptimizerFactory) -> torch.optim.Optimizer:
        """The optimizer that trains ``model``: called once, after :meth:`shard`, before the
        first forward. Default: ``factory(model.parameters())``.

        A backend that must own the optimizer builds it from ``factory`` here. The result is
        an opaque handle to scenarios: they pass it back to :meth:`zero_grad`, :meth:`step`
        and the optimizer state dict methods, and call nothing on it themselves.
        """
        return factory(model.parameters())

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` (a scalar computed from ``model``'s output) and leave the
        reduced gradients where the backend keeps them. Default: ``loss.backward()``."""
        loss.backward()

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Apply one optimizer step with the current gradients. Default: ``optimizer.step()``."""
        optimizer.step()

    def zero_grad(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Drop the gradients before the next backward. Default:
        ``optimizer.zero_grad(set_to_none=True)``."""
        optimizer.zero_grad(set_to_none=True)

    # -- storage: what this rank holds of a parameter --------------------------------------
    # ``fqn`` names a parameter of the module shard() returned, as original_fqn() gives its
    # name in ``model.named_parameters()`` (flat parameters keep their own names). None of
    # these issue a collective, so a scenario may call them on some ranks only.

    def named_parameter(self, model: nn.Module, fqn: str) -> nn.Parameter:
        """The parameter object of ``model`` that :meth:`original_fqn` names ``fqn``."""
        names = []
        for name, param in model.named_parameters(remove_duplicate=False):
            original = self.original_fqn(name)
            if original == fqn:
                return param
            names.append(original)
        raise KeyError(f"{type(self).__name__}: no parameter {fqn!r}; the sharded model has {names}")

    def local_shard(self, model: nn.Module, fqn: str) -> torch.Tensor:
        """A detached copy of what this rank stores of parameter ``fqn``.

        In the backend's own layout: any shape, empty where this rank stores nothing of it,
        padding included where the backend pads. Default: the parameter itself, or its
        local shard when it is a DTensor. Under DeepSpeed ZeRO-3 ``param`` is an empty
        placeholder and the shard lives elsewhere, which is why scenarios ask here.
        """
        return _local_tensor(self.named_parameter(model, fqn)).detach().clone()

    def set_local_shard(self, model: nn.Module, fqn: str, value: torch.Tensor) -> None:
        """Overwrite this rank's stored part of ``fqn`` with ``value`` (shaped like
        :meth:`local_shard`'s result), everywhere the backend keeps it (a master copy an
        optimizer holds included), so later gathers and steps see it."""
        _copy_into(_local_tensor(self.named_parameter(model, fqn)), value, fqn)

    def local_grad_shard(self, model: nn.Module, fqn: str) -> torch.Tensor | None:
        """A detached copy of this rank's stored gradient of ``fqn`` (layout as
        :meth:`local_shard`), or None when this rank stores no gradient for it.
        Default: ``param.grad`` or its DTensor local shard."""
        grad = self.named_parameter(model, fqn).grad
        return None if grad is None else _local_tensor(grad).detach().clone()

    def set_local_grad_shard(self, model: nn.Module, fqn: str, value: torch.Tensor) -> None:
        """Overwrite this rank's stored gradient of ``fqn`` (which must exist) with ``value``."""
        grad = self.named_parameter(model, fqn).grad
        if grad is None:
            raise ValueError(f"{fqn}: this rank stores no gradient to overwrite (run a backward first)")
        _copy_into(_local_tensor(grad), value, f"{fqn} gradient")

    # -- collective labels and lifetime ------------------------------------------------------
    def collective_label(self) -> str | None:
        """What the collective being issued right now carries (e.g. ``"unit1.inp.weight,
        unit1.inp.bias"``), or None to leave it to the harness (the running module's FQN).

        The rank fixture registers this with the harness's collective trace for the duration
        of each test, so the divergence diff names what two same-shaped collectives moved.
        Called inside every traced collective: cheap, no collectives, no exceptions.
        """
        return None

    def close(self) -> None:  # noqa: B027 - an optional hook: doing nothing is the right default
        """Called once after each test body (passed or not), before the harness destroys
        the process groups the test created. Drop what the backend caches across models
        (e.g. process groups a library keeps in module globals). Default: nothing."""


def _adopt_implementations(cls: type[BackendAdapter]) -> None:
    """Keep the public methods the protocol's templates.

    An adapter written for a protocol before version 3 implemented ``shard``, ``unshard`` and the
    state-dict methods itself: its methods become the implementations (``_shard``, ...) behind
    the checking templates, so it keeps running and gains the checks. From version 3 on, an
    adapter implements the underscored methods; overriding a public one is refused, since it
    would bypass the capability checks.
    """
    for public, implementation in TEMPLATE_METHODS.items():
        if public not in vars(cls):
            continue
        if cls.PROTOCOL_VERSION >= 3:
            raise TypeError(
                f"{cls.__name__} overrides {public}(), which checks the declared capabilities before "
                f"calling the adapter: implement {implementation}() instead (protocol version "
                f"{cls.PROTOCOL_VERSION}; docs/writing-an-adapter.md)"
            )
        if implementation not in vars(cls):
            setattr(cls, implementation, vars(cls)[public])
        delattr(cls, public)


def declared_fqn(backend: BackendAdapter, name: str) -> str:
    """``name`` without the path components ``backend`` declares in ``WRAPPER_COMPONENTS``."""
    return strip_path_components(name, type(backend).WRAPPER_COMPONENTS)


def unsharded_name(backend: BackendAdapter, name: str, prefix: str = "") -> str:
    """The raw name ``backend`` must list inside the unshard context for the unsharded model's
    ``name`` (listed with ``prefix``): the declared ``UNSHARDED_NAME_PREFIX`` inserted after the
    caller's prefix, nothing else."""
    parts = [prefix, type(backend).UNSHARDED_NAME_PREFIX, name[len(prefix) + 1 :] if prefix else name]
    return ".".join(part for part in parts if part)


def flat_param_fqn(backend: BackendAdapter, unit: str) -> str:
    """The name a unit's flat parameter must have: with ``use_orig_params=False`` the only
    parameter a unit shows outside the unshard context is ``<unit FQN>.<FLAT_PARAMETER_NAME>``
    (the name alone for the root), after removing the declared wrapper components; each rank's
    holds ceil(N / world size) elements for a unit managing N parameter elements (the flat
    buffer is padded at its end to split evenly)."""
    name = type(backend).FLAT_PARAMETER_NAME
    return f"{unit}.{name}" if unit else name


def declared_refusal(backend: BackendAdapter | type[BackendAdapter], misuse: Misuse) -> Refusal:
    """How ``backend`` (an adapter or its class) declares it refuses ``misuse`` (the seeds'
    refusal where it declares none)."""
    adapter_cls = backend if isinstance(backend, type) else type(backend)
    return adapter_cls.REFUSALS.get(misuse, SEED_REFUSALS[misuse])


@contextlib.contextmanager
def refused(backend: BackendAdapter, misuse: Misuse, where: str = "") -> Iterator[None]:
    """Expect the body to raise the refusal ``backend`` declares for ``misuse``; fail with what
    was raised (or ``DID NOT RAISE``) and what was declared otherwise."""
    declared = declared_refusal(backend, misuse)
    prefix = f"{where}: " if where else ""
    try:
        yield
    except Exception as error:
        problem = declared.mismatch(error)
        if problem is not None:
            raise AssertionError(f"{prefix}{misuse.value}: {backend.name} {problem}") from error
        return
    raise AssertionError(f"{prefix}{misuse.value}: DID NOT RAISE; {backend.name} declares {declared}")


def unshard_capabilities(
    *,
    writeback: bool = False,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    recurse: bool = True,
    with_grads: bool = False,
) -> set[Capability]:
    """What an ``unshard()`` call with these options exercises (defaults: a plain read)."""
    needed = {Capability.UNSHARD}
    for wanted, capability in (
        (writeback, Capability.UNSHARD_WRITEBACK),
        (rank0_only, Capability.UNSHARD_RANK0_ONLY),
        (offload_to_cpu, Capability.UNSHARD_OFFLOAD_TO_CPU),
        (not recurse, Capability.UNSHARD_NON_RECURSIVE),
        (with_grads, Capability.UNSHARD_WITH_GRADS),
    ):
        if wanted:
            needed.add(capability)
    return needed


def mixed_precision_dtype(backend: BackendAdapter) -> torch.dtype:
    """The ``param_dtype`` a mixed-precision scenario asks ``backend`` for: its preferred
    low-precision dtype. The contract is the same for each (compute in it, keep float32 shards
    and show float32 full parameters), so a backend is tested in a dtype it has rather than
    skipped for lack of another. Float16 for a backend that names none (it lacks
    ``MIXED_PRECISION``, which the scenario's ``require`` then reports)."""
    dtypes = backend.mixed_precision_dtypes() if backend.supports(Capability.MIXED_PRECISION) else ()
    return dtypes[0] if dtypes else torch.float16


def require(backend: BackendAdapter, capability: Capability) -> None:
    """Skip the running test as ``unsupported: <capability>: <reason>`` unless supported.

    Every rank evaluates the same condition, so every rank skips together.
    """
    if not backend.supports(capability):
        pytest.skip(f"unsupported: {capability.value}: {backend.unsupported_reason(capability)}")


def require_all(backend: BackendAdapter, requirements: set[Requirement]) -> None:
    """:func:`require` each capability (in declaration order), then skip if the requirements
    (capabilities and spec conditions) include a combination the backend declares unsupported
    (``UNSUPPORTED_COMBINATIONS``)."""
    ordered = sorted(requirements, key=_declaration_order)
    for requirement in ordered:
        if isinstance(requirement, Capability):
            require(backend, requirement)
    for combination, reason in backend.unsupported_combinations().items():
        if combination <= set(requirements):
            together = " with ".join(c.value for c in sorted(combination, key=_declaration_order))
            pytest.skip(f"unsupported: {together}: {reason}")


def _declaration_order(requirement: Requirement) -> tuple[int, int]:
    """Capabilities first, each kind in its declaration order."""
    if isinstance(requirement, Capability):
        return (0, list(Capability).index(requirement))
    return (1, list(SpecCondition).index(requirement))


def submodule(model: nn.Module, fqn: str) -> nn.Module:
    """The submodule at ``fqn`` ("" = the model), with an error that lists what exists."""
    try:
        return model.get_submodule(fqn)
    except AttributeError:
        names = [n for n, _ in model.named_modules() if n]
        raise ValueError(f"no submodule {fqn!r}; the model has {names}") from None


def innermost_first(fqns: tuple[str, ...]) -> list[str]:
    """Order unit FQNs so a nested unit is sharded before the unit containing it.

    Stable and free of set ordering, so every rank shards (and issues collectives) in the
    same order.
    """
    return sorted(dict.fromkeys(fqns), key=lambda fqn: -(fqn.count(".") + 1) if fqn else 0)


def _local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``tensor``: a DTensor's local shard, else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _copy_into(target: torch.Tensor, value: torch.Tensor, what: str) -> None:
    if value.shape != target.shape:
        raise ValueError(
            f"{what}: this rank stores shape {tuple(target.shape)}, got a value of shape "
            f"{tuple(value.shape)} (write what local_shard / local_grad_shard returned, modified)"
        )
    with torch.no_grad():
        target.copy_(value)
