"""Scenario-family mutants: built-in adapters with one defect of the kind a scenario family is for.

``mutant_backends`` breaks the training arithmetic (what ``test_runtime`` catches); the defects
here belong to the other families and are injected the same way, from outside the backend:

* ``exec_order`` -- the forward-order check runs in the first iteration only: a later change of
  the forward order issues no warning (every ``warnings.warn`` whose text is the later-iteration
  order warning is dropped while the mutant is active);
* ``eval_ignored`` -- ``eval()`` on the module ``shard()`` returns leaves it (and its units) in
  training mode, so eval forwards are order-checked like training ones;
* ``two_d`` -- the sharded 2-D state dict shards dimension 1 over dp (``Shard(1)`` where the
  seed requires ``Shard(0)``; same values, another layout a checkpoint consumer would misread);
* ``zero1`` -- rank 1's optimizer steps its shard twice per step (SHARD_OPTIM_STATE, ZeRO-1);
* ``divergence`` -- the reference engine's forward-order validation is switched off (its
  ``check_exec_order`` option, on by default): ranks running equal-sized units in different
  orders then pair each other's collectives silently, which is what torch FSDP1 (without
  TORCH_DISTRIBUTED_DEBUG=DETAIL) and FSDP2 do out of the box;
* ``lowp_double`` -- every gradient backward computes in low precision comes out doubled: the
  loss is doubled before the backend's ``backward`` when it is float16 / bfloat16 (mixed
  precision computes it in ``param_dtype``), so each reduced gradient is twice the average, as
  from a low-precision reduction that sums without dividing at world size 2; float32 training
  is untouched;
* ``accumulation_overwrite`` -- each backward overwrites the stored gradients instead of adding
  to them: the backend's own ``zero_grad`` runs before every ``backward``, so a step sees only
  the last backward pass's gradients;
* ``clip_local_norm`` -- gradient clipping by this rank's local norm: ``clip_grad_norm`` scales
  the gradient pieces this rank stores by ``max_norm`` over their own norm (the classic bug:
  ``torch.nn.utils.clip_grad_norm_`` over plain-tensor shards, or over a DTensor's local
  tensors), so each rank's update is scaled differently and by too much;
* ``checkpoint_reduced_twice`` -- a backward that recomputes a checkpointed unit's forward
  reduces the gradients twice: after such a backward every gradient this rank stores is doubled
  (through ``local_grad_shard`` / ``set_local_grad_shard``, the backend's own layout), as from a
  reduction issued again by the hook the recomputed forward fires; a backward without
  recomputation (no checkpointing) is untouched;
* ``sample_weighted`` -- each rank's gradient weighted by its share of the samples (the mean
  over every sample, not the mean of the rank losses that data parallelism optimises): the
  loss is scaled by this rank's batch size times the world size over the total batch (one
  all-reduce of the batch sizes per backward) before the backend's ``backward``; with even
  batches the factor is exactly 1;
* ``untied`` -- tied parameters untied when the model is sharded: each module that shared a
  parameter gets a copy of its own (what a backend that flattens or partitions each module's
  parameters without noticing the sharing does), so each copy trains on one use's gradient;
  a model without tied parameters is untouched;
* ``init_skipped`` -- deferred initialization leaves the submodules nested below the root's
  children uninitialized: ``shard_deferred`` gets an init whose ``fill`` does nothing for them,
  so they keep what ``to_empty`` allocated (uninitialized memory), as a backend that calls
  ``param_init_fn`` / ``reset_parameters`` on the top-level modules only does; a model built on a
  real device is untouched;
* ``groups_ignored`` -- ``make_optimizer_with_groups`` drops the parameter groups: the optimizer
  is the factory's over every parameter with its defaults (what a backend that builds its own
  optimizer from ``model.parameters()`` does).

``tests/conformance_tests/test_family_mutants.py`` runs each family's scenarios against the mutants.
The classes are also module attributes ``<backend>__<mutation>`` (``reference__divergence``), so
a session can use one: ``--backend family_mutants:reference__divergence`` with this directory
on ``PYTHONPATH`` (and an empty ``--expectations-dir``). Call :func:`restore` after a mutant ran
in a process: it removes what the mutant installed globally.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from collections.abc import Callable
from typing import Any

import mutant_backends  # tests/conformance_tests/mutant_backends.py
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from conformance.protocol import ApiForm, BackendAdapter, BackendEnv, DeferredInit, ShardingSpec, StateDictKind
from conformance.suite import registry

DOUBLE_STEP_RANK = 1
LATER_ORDER_WARNING = "Forward order differs from that of the first iteration"

MUTATIONS: dict[str, str] = {
    "exec_order": "no forward-order warning after the first iteration",
    "eval_ignored": "eval() ignored by the sharded module: eval forwards checked as training ones",
    "two_d": "dimension 1 sharded over dp in the sharded 2-D state dict (Shard(1), not Shard(0))",
    "zero1": f"rank {DOUBLE_STEP_RANK}'s optimizer shard updated twice per step",
    "divergence": "forward-order validation switched off (reference engine: check_exec_order=False)",
    "lowp_double": "gradients computed in low precision doubled (a low-precision reduction that does not average)",
    "accumulation_overwrite": "each backward overwrites the stored gradients instead of adding to them",
    "clip_local_norm": "gradients clipped by the norm of this rank's own pieces, not the total over ranks",
    "checkpoint_reduced_twice": "gradients reduced twice by a backward that recomputes a checkpointed unit",
    "sample_weighted": "each rank's gradient weighted by its share of the samples (uneven batches)",
    "untied": "tied parameters untied by shard(): each module that shared one holds a copy of its own",
    "groups_ignored": "optimizer parameter groups dropped: every parameter with the factory's defaults",
    "init_skipped": "deferred init skips the submodules below the root's children (left as to_empty allocated them)",
}
# The built-in backends each mutation applies to (a family's scenarios need what they need).
APPLIES_TO: dict[str, tuple[str, ...]] = {
    "exec_order": ("reference", "torch-fsdp1"),  # the backends with EXEC_ORDER_CHECK
    "eval_ignored": ("reference", "torch-fsdp1"),
    "two_d": ("reference", "torch-fsdp1", "torch-fsdp2"),  # TENSOR_PARALLEL + SHARDED_STATE_DICT
    "zero1": ("reference", "deepspeed"),  # SHARD_OPTIM_STATE
    "divergence": ("reference",),  # the only built-in whose order check is on by default
    "lowp_double": ("reference", "torch-fsdp1", "torch-fsdp2", "deepspeed"),  # MIXED_PRECISION
    # Every backend trains; torch-zero (a torch ZeroRedundancyOptimizer backend) runs where registered.
    "accumulation_overwrite": ("reference", "torch-fsdp1", "torch-fsdp2", "deepspeed", "torch-zero"),
    # The backends whose ranks store distinct pieces of a gradient in param.grad (DDP's are whole,
    # so its local norm is the total; DeepSpeed clips inside its own step).
    "clip_local_norm": ("reference", "torch-fsdp1", "torch-fsdp2"),
    # Every backend that runs the activation-checkpointing scenario.
    "checkpoint_reduced_twice": ("reference", "torch-fsdp1", "torch-fsdp2", "deepspeed", "torch-zero"),
    "sample_weighted": ("reference", "torch-fsdp1", "torch-fsdp2", "deepspeed", "torch-zero"),
    "untied": ("reference", "torch-fsdp1", "torch-fsdp2", "deepspeed", "torch-zero"),
    "groups_ignored": ("reference", "torch-fsdp1", "torch-fsdp2", "deepspeed", "torch-zero"),  # PARAMETER_GROUPS
    "init_skipped": ("reference", "torch-fsdp1", "torch-fsdp2", "deepspeed", "torch-zero"),  # every backend
}
LOW_PRECISION = frozenset({torch.float16, torch.bfloat16})

_original_warn = warnings.warn


def _warn_without_later_order_warning(message: Any, *args: Any, **kwargs: Any) -> None:
    if str(message).startswith(LATER_ORDER_WARNING):
        return
    _original_warn(message, *args, **kwargs)


def restore() -> None:
    """Undo what a mutant installed process-wide (the dropped warning)."""
    warnings.warn = _original_warn


def _step_twice(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer`` with a post-step hook that steps it once more (not recursively)."""
    stepping_again = False

    def again(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        nonlocal stepping_again
        if stepping_again:
            return
        stepping_again = True
        try:
            opt.step()
        finally:
            stepping_again = False

    optimizer.register_step_post_hook(again)
    return optimizer


def _shard_dim_1_over_dp(value: Any) -> Any:
    """``value`` laid out with ``Shard(1)`` over its first mesh dimension (dp) where it has
    ``Shard(0)`` there and a second dimension; other values unchanged. A collective: every rank
    calls it on the same keys in the same order."""
    if not isinstance(value, DTensor) or value.dim() < 2 or value.placements[0] != Shard(0):
        return value
    placements = [Shard(1), *value.placements[1:]]
    return value.redistribute(value.device_mesh, placements)


def mutant(base: type[BackendAdapter], mutation: str) -> type[BackendAdapter]:
    """``base`` with ``mutation`` (a key of :data:`MUTATIONS`)."""

    class Mutant(base):  # type: ignore[valid-type, misc]
        name = mutant_backends.mutant_name(base, mutation, MUTATIONS)

        def __init__(self, env: BackendEnv) -> None:
            super().__init__(env)
            self._optimizer: Any = None  # what make_optimizer returned: zero_grad needs it
            self._recomputed = False  # a module's forward ran inside the current backward
            self._samples = 0  # the batch size of the latest forward of the sharded model
            if mutation == "exec_order":
                warnings.warn = _warn_without_later_order_warning

        def make_optimizer(self, model: nn.Module, factory: Callable[..., Any]) -> Any:
            if mutation == "zero1" and self.env.rank == DOUBLE_STEP_RANK:
                factory = _compose(_step_twice, factory)
            self._optimizer = super().make_optimizer(model, factory)
            return self._optimizer

        def make_optimizer_with_groups(self, model: nn.Module, factory: Callable[..., Any], groups: Any) -> Any:
            if mutation == "groups_ignored":
                return self.make_optimizer(model, factory)
            self._optimizer = super().make_optimizer_with_groups(model, factory, groups)
            return self._optimizer

        def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
            if mutation == "lowp_double" and loss.dtype in LOW_PRECISION:
                loss = loss * 2
            if mutation == "accumulation_overwrite":
                if self._optimizer is None:
                    raise RuntimeError("the accumulation_overwrite mutant needs make_optimizer before backward")
                # What earlier backward passes stored is dropped, by the backend's own means.
                self.zero_grad(model, self._optimizer)
            if mutation == "sample_weighted":
                loss = loss * _share_of_samples(self._samples, self.env)
            self._recomputed = False
            super().backward(model, loss)
            if mutation == "checkpoint_reduced_twice" and self._recomputed:
                _double_stored_gradients(self, model)

        def clip_grad_norm(self, model: nn.Module, optimizer: Any, max_norm: float) -> Any:
            if mutation != "clip_local_norm":
                return super().clip_grad_norm(model, optimizer, max_norm)
            return _clip_by_local_norm(model, max_norm)

        def _state_dict(self, model: nn.Module, kind: StateDictKind) -> dict[str, Any]:
            state = super()._state_dict(model, kind)
            if mutation != "two_d" or kind is not StateDictKind.SHARDED:
                return state
            return {key: _shard_dim_1_over_dp(value) for key, value in state.items()}

        def _options(self, spec: ShardingSpec, *args: Any) -> dict[str, Any]:
            # The reference adapter's engine options (the only base with _options).
            options = super()._options(spec, *args)
            if mutation == "divergence":
                options["check_exec_order"] = False
            return options

        def close(self) -> None:
            # What the exec_order mutant installed process-wide ends with the adapter: warm ranks
            # run other backends' tests (and generated programs) after this one.
            try:
                super().close()
            finally:
                if mutation == "exec_order":
                    restore()

        def _shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
            if mutation == "divergence" and not hasattr(base, "_options"):
                raise TypeError(f"the divergence mutant needs the reference adapter, not {base.name}")
            if mutation == "untied":
                _untie(model)
            sharded = super()._shard(model, spec, form)
            if mutation == "eval_ignored":
                # nn.Module.eval() calls self.train(False): answer every call with train(True).
                always_train = type(sharded).train
                sharded.train = lambda mode=True: always_train(sharded, True)  # type: ignore[method-assign]
            if mutation == "sample_weighted":
                sharded.register_forward_pre_hook(self._note_samples)
            if mutation == "checkpoint_reduced_twice":
                for module in sharded.modules():
                    module.register_forward_pre_hook(self._note_recompute)
            return sharded

        def _shard_deferred(self, model: nn.Module, spec: ShardingSpec, form: ApiForm, init: DeferredInit) -> nn.Module:
            if mutation == "init_skipped":
                init = _skipping_nested(model, init)
            return super()._shard_deferred(model, spec, form, init)

        def _note_samples(self, module: nn.Module, args: Any) -> None:
            self._samples = int(args[0].shape[0])

        def _note_recompute(self, module: nn.Module, args: Any) -> None:
            # A forward inside a running backward is activation checkpointing's recomputation.
            if torch._C._current_graph_task_id() != -1:
                self._recomputed = True

    return mutant_backends.named_class(Mutant, base, mutation)


def _clip_by_local_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """torch's clip formula over the gradient pieces this rank holds in ``param.grad`` (a DTensor's
    local tensor), with no reduction across ranks."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
    grads = [g for g in grads if g is not None]
    norm = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]).norm()
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    with torch.no_grad():
        for grad in grads:
            grad.mul_(coefficient.to(grad.dtype))
    return norm


def _untie(model: nn.Module) -> None:
    """Give every module that shares a parameter with an earlier one a copy of its own."""
    seen: set[int] = set()
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) in seen:
                setattr(module, name, nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad))
            else:
                seen.add(id(param))


def _skipping_nested(model: nn.Module, init: DeferredInit) -> DeferredInit:
    """``init`` with a ``fill`` that leaves every module nested below ``model``'s children alone."""
    nested = {module for name, module in model.named_modules() if "." in name}

    def fill(module: nn.Module, tensors: Any) -> None:
        if module not in nested:
            init.fill(module, tensors)

    return DeferredInit(fill)


def _share_of_samples(samples: int, env: BackendEnv) -> float:
    """``samples`` times the world size over every rank's samples (a collective: every rank
    calls it once per backward). 1.0 exactly where every rank fed as many."""
    total = torch.tensor([samples], dtype=torch.int64, device=env.device)
    torch.distributed.all_reduce(total)
    return samples * env.world_size / int(total.item())


def _double_stored_gradients(adapter: BackendAdapter, model: nn.Module) -> None:
    """Double every gradient this rank stores of ``model``'s parameters, by the adapter's own
    storage hooks (a flat parameter's, a DTensor's local part, DeepSpeed's partition)."""
    for name, _param in model.named_parameters():
        fqn = adapter.original_fqn(name)
        grad = adapter.local_grad_shard(model, fqn)
        if grad is not None:
            adapter.set_local_grad_shard(model, fqn, grad * 2)


def _compose(outer: Callable[[Any], Any], inner: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(inner)
    def composed(*args: Any, **kwargs: Any) -> Any:
        return outer(inner(*args, **kwargs))

    return composed


def _attribute(backend: str, mutation: str) -> str:
    return f"{backend.replace('-', '_')}__{mutation}"


def installed(backend: str) -> bool:
    """Whether this installation can load the built-in ``backend`` (DeepSpeed is optional; a
    name the registry does not know yet, a backend still being added, is not installed)."""
    if backend in registry.BUILTIN:
        return True
    if backend not in registry.OPTIONAL_BUILTIN:
        return False
    library, _target, _install = registry.OPTIONAL_BUILTIN[backend]
    return importlib.util.find_spec(library) is not None


for _mutation, _backends in APPLIES_TO.items():
    for _backend in _backends:
        if _backend in registry.BUILTIN:
            globals()[_attribute(_backend, _mutation)] = mutant(registry.load(_backend), _mutation)


# Two defects in one backend, each caught by its own seed program (the eval family's and the
# forward-order family's), neither showing in the other's: a campaign must report both, each once
# (tests/conformance_tests/test_generated_mutants.py).
reference__eval_ignored_and_exec_order = mutant(mutant(registry.load("reference"), "eval_ignored"), "exec_order")
TWO_DEFECTS = f"{__name__}:reference__eval_ignored_and_exec_order"


def selection(backend: str, mutation: str) -> str:
    """The ``--backend`` value of ``backend`` with ``mutation``."""
    return f"{__name__}:{_attribute(backend, mutation)}"


def __getattr__(name: str) -> type[BackendAdapter]:
    """``<backend>__<mutation>`` of an optional built-in backend (DeepSpeed), built on first use:
    its library is imported only where a session selects it."""
    backend, _, mutation = name.partition("__")
    backend = backend.replace("_", "-")
    if mutation in APPLIES_TO and backend in APPLIES_TO[mutation] and installed(backend):
        return mutant(registry.load(backend), mutation)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
