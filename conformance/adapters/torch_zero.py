"""Adapter for torch's own data parallelism: ``DistributedDataParallel`` (DDP), and for ZeRO-1
``torch.distributed.optim.ZeroRedundancyOptimizer`` on top of it.

A design with no units and no parameter sharding: every rank holds every parameter whole at all
times, gradients are all-reduced whole, and ZeRO-1 partitions only the optimizer state, whole
parameters assigned to owner ranks. Strategy mapping:

* ``NO_SHARD``: DDP and the factory's own optimizer (plain data parallelism).
* ``SHARD_OPTIM_STATE``: DDP and ``ZeroRedundancyOptimizer(params, optimizer_class=<the
  factory's class>, **<its defaults>)``: each rank's inner optimizer (``optimizer.optim``) keeps
  the state of the parameters assigned to it and steps them; ``step()`` then broadcasts every
  updated parameter from its owner.

Forms: the wrapper is ``DistributedDataParallel`` (names gain ``module.``); the composable form
is ``torch.distributed._composable.replicate``, which runs a DDP over the module's parameters
from hooks on the module itself (it builds that DDP at the first forward, so the construction
broadcast of rank 0's parameters happens there).

The optimizer factory contract (``make_optimizer``): ZeroRedundancyOptimizer needs the class of
the optimizer and its keyword arguments, not a factory, so the factory must be either
``functools.partial(<torch.optim.Optimizer subclass>, **kwargs)`` (read as is), or any callable
that, given an iterable of parameters, returns an optimizer with one parameter group over them
whose class accepts that optimizer's ``defaults`` as keyword arguments (true of torch.optim's
optimizers): such a factory is called once on a one-element probe parameter to read the class and
``defaults``. Under NO_SHARD the factory is simply called on the parameters.

Everything DDP and ZeroRedundancyOptimizer do not do is declared missing with the reason, never
emulated; each gap is tried on torch in tests/conformance_tests/test_declared_absences.py. What is
declared is what holds trivially for whole parameters: ``unshard()`` is a context that changes
nothing (the parameters are always full; changes made inside persist, as torch FSDP1 documents
for its unsharded units whatever ``writeback`` says; with ``with_grads`` the parameters show the
all-reduced gradients they hold; there are no nested units for ``recurse=False`` to leave out).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable import replicate
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from conformance.protocol import (
    ApiForm,
    BackendAdapter,
    BackendEnv,
    Capability,
    OptimizerFactory,
    ParameterGroups,
    ShardingSpec,
    ShardingStrategy,
    StateDictKind,
    UnshardRequest,
    submodule,
)

_REPLICATES = (
    "DistributedDataParallel replicates every parameter whole on every rank and "
    "ZeroRedundancyOptimizer partitions only the optimizer state"
)
_NO_UNITS = (
    "DistributedDataParallel has no units: it wraps one module whose parameters stay whole on every "
    "rank, so there is nothing to gather or free per submodule"
)
_NOT_GATHERED = (
    "DistributedDataParallel never gathers parameters: the only full copy is the module's own, on "
    "every rank, wherever the model lives"
)
_NO_PUBLIC_MIXED_PRECISION = (
    "DistributedDataParallel's mixed_precision argument takes torch.nn.parallel.distributed."
    "_MixedPrecision, a private, experimental class"
)


class TorchZeroAdapter(BackendAdapter):
    PROTOCOL_VERSION = 9  # the protocol version this adapter was written for
    name = "torch-zero"
    WRAPPER_COMPONENTS = frozenset({"module"})  # DistributedDataParallel holds the model as .module
    CAPABILITIES = frozenset(
        {
            Capability.WRAPPER,
            Capability.COMPOSABLE,
            # DDP all-reduces every gradient whole to every rank (ZeroRedundancyOptimizer shards
            # only the optimizer state): the hook's default, torch's clip over them, is right.
            Capability.GRADIENT_CLIPPING,
            Capability.PARAMETER_GROUPS,
            Capability.NO_SHARD,
            Capability.SHARD_OPTIM_STATE,
            Capability.NO_SYNC,
            Capability.UNSHARD,
            Capability.UNSHARD_WRITEBACK,
            Capability.UNSHARD_NON_RECURSIVE,
            Capability.UNSHARD_WITH_GRADS,
            Capability.FULL_STATE_DICT,
            Capability.OPTIM_STATE_DICT,
        }
    )
    UNSUPPORTED_REASONS = {
        Capability.FULL_SHARD: f"{_REPLICATES}: no strategy shards parameters",
        Capability.SHARD_GRAD_OP: f"{_REPLICATES}: no strategy shards parameters or gradients",
        Capability.HYBRID_SHARD: f"{_REPLICATES}: no strategy shards parameters, within groups or otherwise",
        Capability.SHARD_GRAD_AND_OPTIM_STATE: (
            f"{_REPLICATES}: gradients are all-reduced whole to every rank, never reduced to "
            "the rank that owns their optimizer state (ZeRO-2)"
        ),
        Capability.AUTO_WRAP: _NO_UNITS,
        Capability.UNITS: _NO_UNITS,
        Capability.UNMANAGED_ROOT: _NO_UNITS,
        Capability.MIXED_STRATEGIES: f"{_NO_UNITS}; one strategy covers the whole model",
        Capability.INTROSPECT_UNSHARDED: _NO_UNITS,
        Capability.INTROSPECT_UNIT_FQNS: _NO_UNITS,
        Capability.INTROSPECT_EVENTS: _NO_UNITS,
        Capability.INTROSPECT_STORAGE: _NO_UNITS,
        Capability.MIXED_PRECISION: _NO_PUBLIC_MIXED_PRECISION,
        Capability.REDUCE_DTYPE: _NO_PUBLIC_MIXED_PRECISION,
        Capability.CPU_OFFLOAD: (
            "DistributedDataParallel has no parameter offload: parameters stay on the model's device"
        ),
        Capability.IGNORED_MODULES: (
            "DistributedDataParallel has no ignored-modules option (only the private "
            "_set_params_and_buffers_to_ignore_for_model)"
        ),
        Capability.FLAT_PARAMETERS: "DistributedDataParallel always exposes the original parameters",
        Capability.UNSHARD_RANK0_ONLY: f"{_NOT_GATHERED}: no rank can be left without the full parameters",
        Capability.UNSHARD_OFFLOAD_TO_CPU: f"{_NOT_GATHERED}: there is no gathered copy to place on CPU",
        Capability.SHARDED_STATE_DICT: (
            "DistributedDataParallel's state dict holds plain, whole tensors: it has no sharded state dict"
        ),
        Capability.EXEC_ORDER_CHECK: "DistributedDataParallel performs no execution-order validation",
        Capability.TENSOR_PARALLEL: (
            "DistributedDataParallel refuses DTensor parameters (its construction broadcast has no "
            "DTensor sharding rule); torch combines it with tensor parallelism only through the "
            "private torch.distributed.tensor.parallel.ddp._pre_dp_module_transform"
        ),
        Capability.NATIVE_CHECKPOINT: (
            "neither DistributedDataParallel nor ZeroRedundancyOptimizer has a sharded checkpoint "
            "format: ZeroRedundancyOptimizer saves only through consolidate_state_dict, which "
            "gathers the whole state onto one rank"
        ),
    }

    def __init__(self, env: BackendEnv) -> None:
        super().__init__(env)
        # What each module shard() returned was sharded with: make_optimizer reads its strategy,
        # ZeroRedundancyOptimizer its process group.
        self._sharded: weakref.WeakKeyDictionary[nn.Module, _Sharding] = weakref.WeakKeyDictionary()

    # -- applying sharding ----------------------------------------------------------------
    def _shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
        group = self._process_group(spec)
        if form is ApiForm.WRAPPER:
            device_ids = None if self.env.device.type == "cpu" else [self.env.device]
            sharded: nn.Module = DistributedDataParallel(model, device_ids=device_ids, process_group=group)
        else:
            sharded = replicate(model, device_id=self.env.device, process_group=group)
        self._sharded[sharded] = _Sharding(spec.strategy, group)
        return sharded

    @staticmethod
    def _process_group(spec: ShardingSpec) -> dist.ProcessGroup | None:
        """The group to replicate over: the default one, or a 1-D mesh's."""
        if spec.mesh is None:
            return None
        if spec.mesh.ndim != 1:
            raise ValueError(
                f"torch-zero adapter: DistributedDataParallel replicates over one process group; "
                f"got a {spec.mesh.ndim}-D mesh: pass a 1-D mesh, or none for the default group"
            )
        return spec.mesh.get_group()

    def _sharding(self, model: nn.Module) -> _Sharding:
        sharding = self._sharded.get(model)
        if sharding is None:
            raise ValueError(
                f"torch-zero adapter: {type(model).__name__} was not returned by this adapter's "
                "shard(); pass the module shard() returned"
            )
        return sharding

    @staticmethod
    def _user_module(model: nn.Module) -> nn.Module:
        """The user's model: the wrapper's child, or the model itself in the composable form."""
        return model.module if isinstance(model, DistributedDataParallel) else model

    # -- training loop ----------------------------------------------------------------------
    def make_optimizer(self, model: nn.Module, factory: OptimizerFactory) -> torch.optim.Optimizer:
        return self._build_optimizer(model, factory, list(model.parameters()))

    def make_optimizer_with_groups(
        self, model: nn.Module, factory: OptimizerFactory, groups: ParameterGroups
    ) -> torch.optim.Optimizer:
        # ZeroRedundancyOptimizer takes parameter-group dicts as a torch optimizer does, and
        # shards each group's parameters over the ranks, keeping its options.
        named = [(self.original_fqn(name), param) for name, param in model.named_parameters()]
        return self._build_optimizer(model, factory, groups.split(named))

    def _build_optimizer(self, model: nn.Module, factory: OptimizerFactory, params: list[Any]) -> torch.optim.Optimizer:
        """``factory`` over ``params`` (parameters or group dicts): plain under NO_SHARD, else
        through a ZeroRedundancyOptimizer of the factory's class and keyword arguments."""
        sharding = self._sharding(model)
        if sharding.strategy is ShardingStrategy.NO_SHARD:
            return factory(params)
        optimizer_class, defaults = optimizer_class_and_defaults(factory, self.env.device)
        try:
            return ZeroRedundancyOptimizer(
                params, optimizer_class=optimizer_class, process_group=sharding.group, **defaults
            )
        except TypeError as error:
            raise TypeError(
                f"torch-zero adapter: ZeroRedundancyOptimizer could not build {optimizer_class.__name__} "
                f"with the factory's keyword arguments {sorted(defaults)} ({error}); give the factory as "
                "functools.partial(<optimizer class>, **kwargs)"
            ) from error

    # -- storage ----------------------------------------------------------------------------
    def local_optim_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, fqn: str
    ) -> dict[str, torch.Tensor]:
        if not isinstance(optimizer, ZeroRedundancyOptimizer):
            return super().local_optim_state(model, optimizer, fqn)
        # The state lives in this rank's inner optimizer, under the parameter object itself,
        # for the parameters assigned to this rank only.
        state = optimizer.optim.state.get(self.named_parameter(model, fqn), {})
        return {
            name: value.detach().clone()
            for name, value in state.items()
            if isinstance(value, torch.Tensor) and value.dim() > 0
        }

    # -- gradient accumulation -------------------------------------------------------------
    def no_gradient_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        # DDP decides in forward whether the next backward reduces: the forward belongs inside.
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return _replicate_without_sync(model)

    # -- unshard ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _unshard(self, model: nn.Module, request: UnshardRequest) -> Iterator[None]:
        # Parameters (and their all-reduced gradients) are whole on every rank at all times:
        # the context only checks that the submodule exists. rank0_only and offload_to_cpu
        # are declared missing, so they never reach here.
        submodule(self._user_module(model), request.fqn)
        yield

    # -- state dicts ----------------------------------------------------------------------
    def _state_dict(self, model: nn.Module, kind: StateDictKind) -> dict[str, Any]:
        # Copies, as a gathered state dict would be: the values do not move with later steps.
        return {name: value.detach().clone() for name, value in self._user_module(model).state_dict().items()}

    def _load_state_dict(self, model: nn.Module, state_dict: Mapping[str, Any], kind: StateDictKind) -> None:
        self._user_module(model).load_state_dict(dict(state_dict), strict=True)

    def _optim_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, kind: StateDictKind) -> dict[str, Any]:
        names = self._indexed_fqns(model, optim)
        indexed = self._whole_indexed_state(model, optim)
        devices = {index: param.device for index, param in enumerate(_optimizer_params(optim))}
        return {
            "state": {
                names[index]: {key: _placed(value, devices[index]) for key, value in state.items()}
                for index, state in indexed["state"].items()
                if state is not None  # ZeroRedundancyOptimizer's placeholder for state another rank loaded
            },
            "param_groups": [
                {**group, "params": [names[index] for index in group["params"]]} for group in indexed["param_groups"]
            ],
        }

    def _load_optim_state_dict(
        self,
        model: nn.Module,
        optim: torch.optim.Optimizer,
        state_dict: Mapping[str, Any],
        kind: StateDictKind,
    ) -> None:
        index_of = {name: index for index, name in enumerate(self._indexed_fqns(model, optim))}

        def index(name: str) -> int:
            if name not in index_of:
                raise KeyError(
                    f"torch-zero adapter: the optimizer state dict names {name!r}, which this optimizer "
                    f"does not hold; it holds {sorted(index_of)}"
                )
            return index_of[name]

        # ZeroRedundancyOptimizer.load_state_dict takes the consolidated (index-keyed) form and
        # keeps, on each rank, the state of the parameters assigned to it.
        optim.load_state_dict(
            {
                "state": {index(name): dict(state) for name, state in state_dict["state"].items()},
                "param_groups": [
                    {**group, "params": [index(name) for name in group["params"]]}
                    for group in state_dict["param_groups"]
                ],
            }
        )

    def _indexed_fqns(self, model: nn.Module, optim: torch.optim.Optimizer) -> list[str]:
        """The original FQN of each parameter, in the order optimizer state dicts index them."""
        fqn_of = {id(param): self.original_fqn(name) for name, param in model.named_parameters()}
        names = []
        for param in _optimizer_params(optim):
            if id(param) not in fqn_of:
                raise ValueError("torch-zero adapter: the optimizer holds a parameter the model does not have")
            names.append(fqn_of[id(param)])
        return names

    def _whole_indexed_state(self, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's whole, index-keyed state dict, on every rank.

        A plain optimizer holds it already. ZeroRedundancyOptimizer gathers it onto one rank
        (``consolidate_state_dict``, a collective) and ``state_dict()`` reads it there; that
        rank sends it to the others.
        """
        if not isinstance(optim, ZeroRedundancyOptimizer):
            return optim.state_dict()
        group = self._sharding(model).group
        owner = dist.get_global_rank(group, 0) if group is not None else 0
        optim.consolidate_state_dict(to=0)
        whole = [optim.state_dict() if dist.get_rank() == owner else None]
        dist.broadcast_object_list(whole, src=owner, group=group)
        return whole[0]


class _Sharding:
    """What shard() was asked for: the strategy and the process group replicated over."""

    __slots__ = ("group", "strategy")

    def __init__(self, strategy: ShardingStrategy, group: dist.ProcessGroup | None) -> None:
        self.strategy = strategy
        self.group = group


@contextlib.contextmanager
def _replicate_without_sync(model: nn.Module) -> Iterator[None]:
    """``replicate()``'s switch: forwards run with it off leave their backward unreduced."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def optimizer_class_and_defaults(
    factory: OptimizerFactory, device: torch.device
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The optimizer class and keyword arguments ``factory`` builds with (see the module
    docstring for the contract): read from a ``functools.partial`` of an optimizer class, else
    from an optimizer the factory builds over a one-element probe parameter on ``device``."""
    if (
        isinstance(factory, functools.partial)
        and not factory.args
        and isinstance(factory.func, type)
        and issubclass(factory.func, torch.optim.Optimizer)
    ):
        return factory.func, dict(factory.keywords)
    probe = factory([nn.Parameter(torch.zeros(1, device=device))])
    if not isinstance(probe, torch.optim.Optimizer):
        raise TypeError(
            f"torch-zero adapter: the optimizer factory returned {type(probe).__name__}, not a "
            "torch.optim.Optimizer; give functools.partial(<optimizer class>, **kwargs)"
        )
    if len(probe.param_groups) != 1:
        raise ValueError(
            f"torch-zero adapter: the optimizer factory made {len(probe.param_groups)} parameter groups "
            "of one parameter; ZeroRedundancyOptimizer needs one group: give "
            "functools.partial(<optimizer class>, **kwargs)"
        )
    return type(probe), dict(probe.defaults)


def _optimizer_params(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters in the order an optimizer's state dict numbers them."""
    return list(itertools.chain.from_iterable(group["params"] for group in optim.param_groups))


def _placed(value: Any, device: torch.device) -> Any:
    """A copy of an optimizer-state value where the unsharded optimizer keeps it: tensors with
    elements on their parameter's device (ZeroRedundancyOptimizer consolidates onto CPU), scalar
    tensors (Adam's ``step``) where they are."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device if value.dim() > 0 else value.device, copy=True)
    return value
