"""No vacuous pass: a scenario that passed without sharding anything fails.

The rank fixture watches what a test asks of its adapter (:class:`ShardWatch`). Once the test
body passed, two things must hold:

1. It called ``shard()`` at least once. A test that never did (a scenario that loops over
   ``backend.forms()`` of a backend offering none, a body that returns early) checked nothing of
   the backend. A call counts when it is made, whatever it returns or raises, so misuse
   scenarios (the backend refuses at shard time) exercise the backend too.
2. At world size > 1, the backend showed that it sharded. An adapter whose ``_shard()`` hands the
   model back unchanged (a CUDA-only backend falling back silently on CPU, a stub) trains
   exactly like the single-process oracle, so oracle comparisons pass trivially. Evidence, any
   one of which suffices:

   * a collective issued by the backend during the test: inside ``shard()`` or a training-loop,
     state-dict or checkpoint call of the adapter (``harness.collectives_issued()`` read around
     each call: the harness's trace counts every collective it records). This is what
     replicating strategies show: NO_SHARD and DeepSpeed stage 0 broadcast or all-reduce;
   * for every model ``shard()`` returned: this rank's parameter storage shrank (local numel
     after ``shard()`` below that before it: a proper shard, a DeepSpeed ZeRO-3 placeholder,
     a DTensor's local part), or the adapter reports at least one unit for it
     (``unit_fqns``, where ``INTROSPECT_UNIT_FQNS`` is declared).

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

from conformance.protocol import ApiForm, BackendAdapter, Capability, ShardingSpec
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


@dataclass
class ShardedModel:
    """One model ``shard()`` returned during the test, with what its storage showed."""

    module: nn.Module
    spec: ShardingSpec
    form: ApiForm
    storage_shrank: bool


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

        def watched_shard(model: nn.Module, spec: ShardingSpec, form: ApiForm) -> Any:
            self.calls += 1
            before = local_numel(model)
            result = shard(model, spec, form)
            if isinstance(result, nn.Module):
                self.sharded.append(ShardedModel(result, spec, form, local_numel(result) < before))
            return result

        self.adapter.shard = watched_shard  # type: ignore[method-assign]

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

    def finding(self, body_passed: bool) -> ExercisedNothing | None:
        """Why the passed test is vacuous, or None. Call before ``adapter.close()``: it may ask
        the adapter for the units of the models it sharded."""
        try:
            return self._finding(body_passed)
        finally:
            # The models are the test's: a raised finding's traceback must not keep them alive.
            self.sharded.clear()

    def _finding(self, body_passed: bool) -> ExercisedNothing | None:
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
        if world_size < 2 or self.backend_collectives:
            return None
        unsharded = [model for model in self.sharded if not model.storage_shrank and not self._has_units(model)]
        if not unsharded:
            return None
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
