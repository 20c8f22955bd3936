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
     (``unit_fqns``, where ``INTROSPECT_UNIT_FQNS`` is declared: a backend that shards lazily),
     or this rank is one whose share is all of every parameter: under the declared
     ``SHARD_LAYOUT`` its share of each parameter is the whole parameter, the storage hooks
     (``local_shard``) show exactly that, and another rank of its shard group has less of some
     parameter (a model of 1-element parameters: the group's first rank holds each, the others
     none). Such a rank's storage cannot show the share, the others' does, and the same rule run
     on them fails a backend that replicates, so a correct backend without units passes;
   * gradients, where the strategy shards them and the test left gradients stored: this rank
     stores fewer gradient elements (``local_grad_shard``) than the model has parameter elements;
   * optimizer state, where the strategy shards it and an optimizer the adapter made has state:
     for each state tensor name, this rank stores fewer elements (``local_optim_state``) than
     the model has parameter elements.

   A claim that is observable and not met fails the test as :class:`StorageClaimNotMet`, with
   the numbers: a backend that replicates what it claims to shard (plain DDP declaring ZeRO-1)
   trains exactly like the oracle, so its passes would be false. The message names the
   strategies whose claims match what this rank stores of each kind the test left observable
   (:func:`matching_strategies`: an adapter written when the docs mapped DeepSpeed's stage 2 to
   SHARD_GRAD_OP stores what SHARD_GRAD_AND_OPTIM_STATE claims), or says that none does. The exact check over all ranks
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

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from conformance.protocol import (
    ApiForm,
    BackendAdapter,
    Capability,
    Holding,
    Phase,
    ShardingSpec,
    ShardingStrategy,
    Stored,
    expected_local_numel,
    shard_group_size,
    storage_claim,
    stored_elements,
)
from harness import collectives_issued

# Adapter calls whose collectives are the backend's: shard() (a DDP-style broadcast, DeepSpeed's
# engine set-up) and everything a scenario runs through the adapter after it.
BACKEND_CALLS = (
    "shard",
    "shard_deferred",
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


# What other libraries and papers call a strategy, for the message naming the one that matches.
KNOWN_AS: Mapping[ShardingStrategy, str] = {
    ShardingStrategy.FULL_SHARD: "ZeRO-3",
    ShardingStrategy.NO_SHARD: "DDP, ZeRO stage 0",
    ShardingStrategy.SHARD_OPTIM_STATE: "ZeRO-1",
    ShardingStrategy.SHARD_GRAD_AND_OPTIM_STATE: "ZeRO-2",
}


def matching_strategies(measured: Mapping[Stored, Holding]) -> list[ShardingStrategy]:
    """The strategies, in the vocabulary's order, whose storage claim at rest
    (``conformance.protocol.STORAGE_CLAIMS``) is what ``measured`` shows for every kind in it
    (kinds a test left unobserved are not in it and rule nothing out)."""
    return [
        strategy
        for strategy in ShardingStrategy
        if all(storage_claim(strategy).holding(kind, Phase.AT_REST) is holding for kind, holding in measured.items())
    ]


def _named(strategy: ShardingStrategy) -> str:
    known_as = KNOWN_AS.get(strategy)
    return f"{strategy.name} ({known_as})" if known_as else strategy.name


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def storage_verdict(declared: ShardingStrategy, where: str, measured: Mapping[Stored, Holding]) -> str:
    """What to declare instead of ``declared``, whose claim ``measured`` (what this rank stores of
    the model ``where`` names) does not meet: the strategies that match it, or that none does."""
    stores = ", ".join(f"{kind.value} {measured[kind].value}" for kind in Stored if kind in measured)
    matches = matching_strategies(measured)
    if not matches:
        failed = _listed(
            [
                kind.value
                for kind in Stored
                if kind in measured and _claims_sharded(declared, kind) and measured[kind] is Holding.WHOLE
            ]
        )
        return (
            f"{where}: its claim for {failed} failed, and no strategy matches what your backend stores "
            f"({stores}): declaring another one would not help; make the backend shard what "
            f"{declared.name} claims, or fix the storage hooks if they read the wrong tensor"
        )
    if len(matches) == 1:
        return (
            f"{where}: what your backend stores ({stores}) matches {_named(matches[0])}: declare that "
            f"instead of {declared.name}"
        )
    return (
        f"{where}: what your backend stores ({stores}) matches {_listed([_named(s) for s in matches])}, which "
        f"this test cannot tell apart: declare the one your backend implements instead of {declared.name} "
        "(conformance/test_storage.py reads every kind)"
    )


def _claims_sharded(strategy: ShardingStrategy, kind: Stored) -> bool:
    return storage_claim(strategy).holding(kind, Phase.AT_REST) is Holding.SHARDED


@dataclass
class ShardedModel:
    """One model ``shard()`` returned during the test, with what its storage showed."""

    module: nn.Module
    spec: ShardingSpec
    form: ApiForm
    storage_shrank: bool
    # The unsharded model's parameters by FQN (the names the storage hooks take), sizes and
    # shapes, in registration order.
    numels: dict[str, int] = field(default_factory=dict)
    shapes: dict[str, torch.Size] = field(default_factory=dict)
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
        make_optimizer = self.adapter.make_optimizer

        def watched(shard: Any) -> Any:
            # shard() and shard_deferred() (a meta-device model: its parameters have their full
            # shapes, and count as whole before sharding, as a materialized model's would).
            def watched_shard(model: nn.Module, spec: ShardingSpec, form: ApiForm, *init: Any) -> Any:
                self.calls += 1
                numels = {name: param.numel() for name, param in model.named_parameters()}
                shapes = {name: param.shape for name, param in model.named_parameters()}
                before = local_numel(model)
                result = shard(model, spec, form, *init)
                if isinstance(result, nn.Module):
                    shrank = local_numel(result) < before
                    self.sharded.append(ShardedModel(result, spec, form, shrank, numels, shapes))
                    self._attribute_forward(result)
                return result

            return watched_shard

        def watched_make_optimizer(model: nn.Module, factory: Any) -> Any:
            optimizer = make_optimizer(model, factory)
            for sharded in self.sharded:
                if sharded.module is model:
                    sharded.optimizers.append(optimizer)
            return optimizer

        self.adapter.shard = watched(self.adapter.shard)  # type: ignore[method-assign]
        self.adapter.shard_deferred = watched(self.adapter.shard_deferred)  # type: ignore[method-assign]
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
            problems = [problem for problem in observed.values() if isinstance(problem, str)]
            if problems:
                # What the rank stores of every kind, not only those the claim shards: what matches.
                measured = {kind: holding for kind, (holding, _) in self._measured(model, Stored).items()}
                broken += [*problems, storage_verdict(model.spec.strategy, self._where(model), measured)]
        if broken:
            return StorageClaimNotMet(
                f"this test passed, but the {self.adapter.name} backend does not store what its strategy "
                f"claims at world size {world_size}:\n  " + "\n  ".join(dict.fromkeys(broken)) + "\nA backend "
                "that replicates what its strategy shards trains exactly like the single-process oracle, so "
                "this pass would be false. Fix the adapter: declare the strategy its storage matches where "
                "one is named above, or map the strategy onto a configuration of the backend that shards what "
                "conformance.protocol.STORAGE_CLAIMS says, leaving out of CAPABILITIES the strategies the "
                "backend does not implement; if the storage hooks (local_shard, local_grad_shard, "
                "local_optim_state) read the wrong tensor, fix them. conformance/test_storage.py shows every "
                "rank's numbers at every phase"
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
        sharded = [kind for kind in Stored if claim.holding(kind, Phase.AT_REST) is Holding.SHARDED]
        measured = self._measured(model, sharded)
        observed: dict[Stored, bool | str] = {}
        for kind in sharded:
            if kind in measured:
                holding, stores = measured[kind]
                observed[kind] = holding is Holding.SHARDED or (
                    f"{self._where(model)} claims {kind.value} sharded; this rank stores {stores}"
                )
            elif kind is Stored.PARAMETERS:  # whole storage, but a unit: a backend that shards lazily
                observed[kind] = True
        return observed

    def _measured(self, model: ShardedModel, kinds: Iterable[Stored]) -> dict[Stored, tuple[Holding, str]]:
        """What this rank stores of each of ``kinds`` that the test left observable: its share
        (fewer elements than the model has parameter elements) or all of it, with what it stores
        as the message says it. Parameters at full size with a unit reported are left out: a
        backend that shards lazily, or whole NO_SHARD units, the storage cannot tell."""
        total = sum(model.numels.values())
        measured: dict[Stored, tuple[Holding, str]] = {}
        for kind in kinds:
            if kind is Stored.PARAMETERS:
                if model.storage_shrank or local_numel(model.module) < total or self._holds_whole_share(model):
                    measured[kind] = (Holding.SHARDED, "")
                elif not self._has_units(model):
                    stores = f"all {total} parameter elements and the adapter reports no unit"
                    measured[kind] = (Holding.WHOLE, stores)
            elif kind is Stored.GRADIENTS:
                grads = self._stored(model, Stored.GRADIENTS)
                if grads:
                    stored = sum(grads.values())
                    stores = f"{stored} gradient elements of a model with {total} parameter elements"
                    sharded = stored < total or self._holds_whole_share(model, Stored.GRADIENTS)
                    measured[kind] = (Holding.SHARDED if sharded else Holding.WHOLE, stores)
            else:
                for optimizer in model.optimizers:
                    by_name: dict[str, int] = {}
                    for key, count in self._stored(model, Stored.OPTIMIZER_STATE, optimizer).items():
                        name = key.rsplit("[", 1)[1].rstrip("]")
                        by_name[name] = by_name.get(name, 0) + count
                    whole = [(name, stored) for name, stored in sorted(by_name.items()) if stored >= total]
                    if whole:
                        name, stored = whole[0]
                        stores = (
                            f"{stored} elements of the optimizer's {name!r} state for a model with {total} "
                            "parameter elements"
                        )
                        measured[kind] = (Holding.WHOLE, stores)
                        break
                    if by_name:
                        measured[kind] = (Holding.SHARDED, "")
        return measured

    def _holds_whole_share(self, model: ShardedModel, kind: Stored = Stored.PARAMETERS) -> bool:
        """This rank's share of every parameter under the declared ``SHARD_LAYOUT`` is all of
        it, the storage hooks show exactly that of ``kind`` (the parameters, or their gradients),
        and another rank of its shard group has less of some parameter: sharding is right on
        this rank and shows on the others. Original
        parameters of a unit-less model only (the root is the one unit a FLAT_UNIT layout
        splits); a flat parameter pads every rank to the same size, which shows nothing."""
        if not model.spec.use_orig_params or not model.shapes or len(model.spec.strategies()) != 1:
            return False
        layout = type(self.adapter).SHARD_LAYOUT
        group = shard_group_size(model.spec, self.adapter.env.world_size)
        mesh = model.spec.mesh
        hybrid = ShardingStrategy.HYBRID_SHARD in model.spec.strategies() and mesh is not None
        index = mesh.get_local_rank(1) if hybrid else self.adapter.env.rank  # this rank's place in its group
        shapes = list(model.shapes.values())
        stored = self._stored(model, kind)
        for position, (fqn, shape) in enumerate(model.shapes.items()):
            share = expected_local_numel(layout, shapes, position, index, group)
            if share != shape.numel() or stored.get(fqn) != share:
                return False
        return any(
            expected_local_numel(layout, shapes, position, other, group) < shape.numel()
            for other in range(group)
            for position, shape in enumerate(shapes)
        )

    @staticmethod
    def _where(model: ShardedModel) -> str:
        return f"{model.spec.strategy.name} ({model.form.name.lower()} form)"

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
