"""No vacuous pass: a scenario that passed without sharding anything fails.

The rank fixture watches what a test asks of its adapter (:class:`ShardWatch`). Once the test
body passed, two things must hold:

1. It called ``shard()`` at least once. A test that never did (a scenario that loops over
   ``backend.forms()`` of a backend offering none, a body that returns early) checked nothing of
   the backend. A call counts when it is made, whatever it returns or raises, so misuse
   scenarios (the backend refuses at shard time) exercise the backend too.
2. At world size > 1, the backend stores what its strategy claims (``conformance.protocol.
   storage.STORAGE_CLAIMS``) for everything the claim shards and the test left observable, read
   on this rank at the end of the test for every model ``shard()`` returned:

   * parameters, where the strategy shards them at rest: this rank's parameter storage shrank
     (local numel after ``shard()`` or at the end below the model's: a proper shard, a DeepSpeed
     ZeRO-3 placeholder, a DTensor's local part), or the adapter reports a unit for the model
     (``unit_fqns``, where ``INTROSPECT_UNIT_FQNS`` is declared: a backend that shards lazily);
   * gradients, where the strategy shards them and the test left gradients stored: this rank
     stores fewer gradient elements (``local_grad_shard``) than the model has parameter elements;
   * optimizer state, where the strategy shards it and an optimizer the adapter made has state:
     for each state tensor name, this rank stores fewer elements (``local_optim_state``) than
     the model has parameter elements.

   A claim that is observable and not met fails the test as :class:`StorageClaimNotMet`, with
   the numbers: a backend that replicates what it claims to shard (plain DDP declaring ZeRO-1)
   trains exactly like the oracle, so its passes would be false. The exact check over all ranks
   and phases is the storage scenario's (``conformance/test_storage.py``); this one is rank-local
   and runs after every test.

   Where the strategy shards nothing (NO_SHARD, a shard group of one rank) or nothing it shards
   was observable (a ZeRO-1 test that never stepped an optimizer), any sign that the backend
   took the model over is the evidence: storage that shrank, a unit the adapter reports, or a
   collective issued by the backend during the test, inside ``shard()``, the forward of a module
   it returned, or a training-loop, state-dict or checkpoint call of the adapter
   (``harness.collectives_issued()`` read around each call: the harness's trace counts every
   collective it records). That is what
   replicating strategies show: NO_SHARD and DeepSpeed stage 0 broadcast or all-reduce.

   Collectives the scenario issues itself (its own ``dist.all_reduce`` of a verdict) are not the
   backend's and do not count; neither do those inside ``unshard()`` (a backend only gathers
   there what it sharded, which the storage already shows). Tests that did not pass (a
   refusal raised as expected still passes: ``shard()`` raised, so no model to inspect), world
   size 1 and skips are left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from conformance.protocol import (
    ApiForm,
    BackendAdapter,
    Capability,
    Holding,
    Phase,
    ShardingSpec,
    Stored,
    shard_group_size,
    storage_claim,
    stored_elements,
)
from harness import collectives_issued

# Adapter calls whose collectives are the backend's: shard() (a DDP-style broadcast, DeepSpeed's
# engine set-up) and everything a scenario runs through the adapter after it.
BACKEND_CALLS = (
    "shard",
    "make_optimizer",
    "backward",
    "step",
    "zero_grad",
    "state_dict",
    "load_state_dict",
    "optim_state_dict",
    "load_optim_state_dict",
    "save_checkpoint",
    "load_checkpoint",
)


class ExercisedNothing(AssertionError):
    """A test passed without making its backend shard anything."""


class StorageClaimNotMet(AssertionError):
    """A test passed, but its backend stores whole what its strategy claims to shard."""


@dataclass
class ShardedModel:
    """One model ``shard()`` returned during the test, with what its storage showed."""

    module: nn.Module
    spec: ShardingSpec
    form: ApiForm
    storage_shrank: bool
    # The unsharded model's parameters by FQN (the names the storage hooks take) and sizes.
    numels: dict[str, int] = field(default_factory=dict)
    optimizers: list[Any] = field(default_factory=list)  # what make_optimizer returned for it


@dataclass
class ShardWatch:
    """What one adapter instance was asked to do, and did, during one test."""

    adapter: BackendAdapter
    # This rank's collectives so far in the test (the harness's trace); a fake in unit tests.
    collectives: Callable[[], int] = collectives_issued
    calls: int = 0
    backend_collectives: int = 0
    sharded: list[ShardedModel] = field(default_factory=list)
    _inside_backend: int = 0

    def __post_init__(self) -> None:
        # On the instance (built fresh for each test): the class and its subclasses are untouched.
        for name in BACKEND_CALLS:
            setattr(self.adapter, name, self._attributed(getattr(self.adapter, name)))
        shard = self.adapter.shard
        make_optimizer = self.adapter.make_optimizer

        def watched_shard(model: nn.Module, spec: ShardingSpec, form: ApiForm) -> Any:
            self.calls += 1
            numels = {name: param.numel() for name, param in model.named_parameters()}
            before = local_numel(model)
            result = shard(model, spec, form)
            if isinstance(result, nn.Module):
                self.sharded.append(ShardedModel(result, spec, form, local_numel(result) < before, numels))
                self._attribute_forward(result)
            return result

        def watched_make_optimizer(model: nn.Module, factory: Any) -> Any:
            optimizer = make_optimizer(model, factory)
            for sharded in self.sharded:
                if sharded.module is model:
                    sharded.optimizers.append(optimizer)
            return optimizer

        self.adapter.shard = watched_shard  # type: ignore[method-assign]
        self.adapter.make_optimizer = watched_make_optimizer  # type: ignore[method-assign]

    def _attribute_forward(self, module: nn.Module) -> None:
        """Collectives issued in the forward of a module ``shard()`` returned are the backend's
        too (FSDP's all-gathers, DeepSpeed's engine set-up and broadcast at its first forward)."""
        state = {"before": 0, "outermost": False}

        def enter(_module: nn.Module, _args: Any) -> None:
            state["outermost"] = not self._inside_backend
            if state["outermost"]:
                state["before"] = self.collectives()
            self._inside_backend += 1

        def leave(_module: nn.Module, _args: Any, _output: Any) -> None:
            self._inside_backend -= 1
            if state["outermost"]:
                self.backend_collectives += self.collectives() - state["before"]

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)  # also when forward raises

    def _attributed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def inside_backend(*args: Any, **kwargs: Any) -> Any:
            outermost = not self._inside_backend  # an adapter call may make another: count once
            before = self.collectives() if outermost else 0
            self._inside_backend += 1
            try:
                return method(*args, **kwargs)
            finally:
                self._inside_backend -= 1
                if outermost:
                    self.backend_collectives += self.collectives() - before

        return inside_backend

    def finding(self, body_passed: bool) -> AssertionError | None:
        """Why the passed test is vacuous or false, or None. Call before ``adapter.close()``: it
        may ask the adapter for the units and the storage of the models it sharded."""
        try:
            return self._finding(body_passed)
        finally:
            # The models are the test's: a raised finding's traceback must not keep them alive.
            self.sharded.clear()

    def _finding(self, body_passed: bool) -> AssertionError | None:
        if not body_passed:
            return None
        if not self.calls:
            forms = [form.value for form in self.adapter.forms()]
            return ExercisedNothing(
                f"this test passed without calling backend.shard(): it checked nothing of the "
                f"{self.adapter.name} backend (its API forms here: {forms or 'none'}); a scenario must "
                "shard a model, or skip (pytest.skip / conformance.protocol.require) when it cannot"
            )
        world_size = self.adapter.env.world_size
        if world_size < 2:
            return None
        shown: list[bool] = []
        broken: list[str] = []
        for model in self.sharded:
            observed = self._claims_observed(model, world_size)
            # Nothing the claim shards was observable: the signs replication shows (shrunk
            # storage, units, or a collective below) are the evidence.
            shown.append(any(observed.values()) or model.storage_shrank or self._has_units(model))
            broken += [problem for problem in observed.values() if isinstance(problem, str)]
        if broken:
            return StorageClaimNotMet(
                f"this test passed, but the {self.adapter.name} backend does not store what its strategy "
                f"claims at world size {world_size}:\n  " + "\n  ".join(broken) + "\nA backend that "
                "replicates what its strategy shards trains exactly like the single-process oracle, so "
                "this pass would be false. Fix the adapter: map the strategy onto a configuration of the "
                "backend that shards what conformance.protocol.STORAGE_CLAIMS says, or leave the strategy "
                "out of CAPABILITIES and declare the one the backend implements; if the storage hooks "
                "(local_shard, local_grad_shard, local_optim_state) read the wrong tensor, fix them. "
                "conformance/test_storage.py shows every rank's numbers at every phase"
            )
        if self.backend_collectives or all(shown):
            return None
        unsharded = [model for model, evidence in zip(self.sharded, shown) if not evidence]
        what = ", ".join(f"{model.spec.strategy.name} ({model.form.name.lower()} form)" for model in unsharded)
        return ExercisedNothing(
            f"this test passed, but the {self.adapter.name} backend showed no sign of sharding at "
            f"world size {world_size}: the model(s) shard() returned for {what} kept every parameter "
            "at full size on this rank, it reported no unit for them, and it issued no collective "
            "in shard(), the training loop or the state-dict calls. An unsharded model trains "
            "exactly like the single-process oracle, so this pass checked nothing. Fix the "
            "adapter: _shard() must apply the backend's sharding; a backend that cannot shard on "
            "this device (CUDA-only on a CPU runner) leaves those capabilities out of "
            "capabilities() so the scenario skips as unsupported; one that shards lazily declares "
            "INTROSPECT_UNIT_FQNS so its units show"
        )

    def _claims_observed(self, model: ShardedModel, world_size: int) -> dict[Stored, bool | str]:
        """For each kind the model's strategy shards and the test left observable: True where
        this rank's storage shows the share, the problem where it shows a whole copy."""
        if len(model.spec.strategies()) != 1 or shard_group_size(model.spec, world_size) < 2:
            return {}  # mixed strategies or a group of one: no single claim to read
        claim = storage_claim(model.spec.strategy)
        observed: dict[Stored, bool | str] = {}
        where = f"{model.spec.strategy.name} ({model.form.name.lower()} form)"
        total = sum(model.numels.values())
        if claim.parameters[Phase.AT_REST] is Holding.SHARDED:
            if model.storage_shrank or local_numel(model.module) < total or self._has_units(model):
                observed[Stored.PARAMETERS] = True
            else:
                observed[Stored.PARAMETERS] = (
                    f"{where} claims parameters sharded; this rank stores all {total} parameter elements "
                    "and the adapter reports no unit"
                )
        if claim.gradients is Holding.SHARDED:
            grads = self._stored(model, Stored.GRADIENTS)
            if grads:
                stored = sum(grads.values())
                observed[Stored.GRADIENTS] = stored < total or (
                    f"{where} claims gradients sharded; this rank stores {stored} gradient elements of a "
                    f"model with {total} parameter elements"
                )
        if claim.optimizer_state is Holding.SHARDED:
            for optimizer in model.optimizers:
                state = self._stored(model, Stored.OPTIMIZER_STATE, optimizer)
                by_name: dict[str, int] = {}
                for key, count in state.items():
                    name = key.rsplit("[", 1)[1].rstrip("]")
                    by_name[name] = by_name.get(name, 0) + count
                for name, stored in sorted(by_name.items()):
                    if stored >= total:
                        observed[Stored.OPTIMIZER_STATE] = (
                            f"{where} claims optimizer state sharded; this rank stores {stored} elements of "
                            f"the optimizer's {name!r} state for a model with {total} parameter elements"
                        )
                        break
                    observed[Stored.OPTIMIZER_STATE] = True
        return observed

    def _stored(self, model: ShardedModel, stored: Stored, optimizer: Any = None) -> dict[str, int]:
        try:
            return stored_elements(self.adapter, model.module, stored, model.numels, optimizer)
        except Exception:  # noqa: BLE001 - storage the hooks cannot read (flat parameters) is no evidence either way
            return {}

    def _has_units(self, model: ShardedModel) -> bool:
        if not self.adapter.supports(Capability.INTROSPECT_UNIT_FQNS):
            return False
        try:
            return bool(self.adapter.unit_fqns(model.module))
        except Exception:  # noqa: BLE001 - a failing introspection is no evidence; the verdict says what is missing
            return False


def local_numel(module: nn.Module) -> int:
    """How many parameter elements this rank stores for ``module`` (a DTensor's local part)."""
    total = 0
    for param in module.parameters():
        to_local = getattr(param, "to_local", None)
        total += (to_local() if callable(to_local) else param).numel()
    return total
