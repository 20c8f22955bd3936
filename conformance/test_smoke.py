"""Smoke scenarios: an adapter's basics, in well under a minute.

    python -m pytest conformance -k smoke --backend my_pkg.adapter:MyAdapter

Run these first when writing an adapter (they are also marked ``smoke``, for ``-m smoke``).
Each asks as little of the backend as the basics allow: one world of two ranks, the whole model
as one unit (no ``UNITS``), every API form the backend has, and the most sharded strategy it
declares (FULL_SHARD, else SHARD_GRAD_OP, SHARD_GRAD_AND_OPTIM_STATE, SHARD_OPTIM_STATE, NO_SHARD). They check:

* training through the adapter's training-loop hooks (three plain-SGD steps, which show a wrong
  gradient scale or a missing reduction) matches the single-process oracle: losses and every
  parameter, by name;
* ``unshard()`` shows every parameter under its original name, full and bit-equal to the
  unsharded model;
* the full state dict equals the unsharded model's and loads into a differently initialised
  sharded model;
* every collective label the adapter gives (``collective_label``) names parameters of the model.

The full scenarios (``conformance/test_*.py``) check all of this and much more; a failure here
names the parameter and what was observed, so it is the quickest place to start debugging.
"""

from __future__ import annotations

import pytest
import torch

import conformance.test_runtime as runtime  # a module, so its tests are not collected here
import fixtures
import harness
from conformance.protocol import (
    ApiForm,
    BackendAdapter,
    Capability,
    ShardingSpec,
    ShardingStrategy,
    StateDictKind,
    declared_fqn,
    require,
    require_all,
    unshard_capabilities,
)
from fixtures.compare import EXACT, differences, report
from harness import current_seed

pytestmark = [pytest.mark.smoke, pytest.mark.world_size(2)]

# Most sharded first: the smoke run exercises as much of the backend as it declares.
STRATEGY_PREFERENCE = (
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.SHARD_GRAD_AND_OPTIM_STATE,
    ShardingStrategy.SHARD_OPTIM_STATE,
    ShardingStrategy.NO_SHARD,
)
ITERATIONS = 3


def _spec(backend: BackendAdapter) -> ShardingSpec:
    """The whole model as one unit, with the most sharded strategy the backend declares."""
    for strategy in STRATEGY_PREFERENCE:
        if backend.supports(Capability.for_strategy(strategy)):
            return ShardingSpec(strategy=strategy)
    reasons = dict.fromkeys(backend.unsupported_reason(Capability.for_strategy(s)) for s in STRATEGY_PREFERENCE)
    pytest.skip(
        f"unsupported: none of the strategies {', '.join(s.name for s in STRATEGY_PREFERENCE)}: " + "; ".join(reasons)
    )


def _where(spec: ShardingSpec, form: ApiForm, rank: int) -> str:
    return f"rank {rank}: {form.value} form, {spec.strategy.name}"


def test_smoke_training_matches_the_oracle(
    backend: BackendAdapter, world_size: int, rank: int, device: torch.device
) -> None:
    """Three plain-SGD steps through make_optimizer / zero_grad / backward / step: this rank's
    losses and the final full state dict equal the single-process oracle's (the tolerances of
    ``test_runtime.test_training``)."""
    require(backend, Capability.FULL_STATE_DICT)
    spec = _spec(backend)
    plan = fixtures.TrainingPlan(
        seed=current_seed(),
        iterations=ITERATIONS,
        batch_size=runtime.LOCAL_BATCH,
        make_optimizer=runtime.OPTIMIZERS["sgd"],
    )
    oracle = fixtures.train_oracle(
        fixtures.build(fixtures.CompositeModel, plan.seed, device),
        plan,
        world_size=world_size,
        device=device,
    )
    expected_losses = torch.tensor([per_rank[rank] for per_rank in oracle.rank_losses])
    tolerance = runtime.PARAM_TOLERANCE["sgd"]
    problems = []  # asserted after every form ran (no rank left waiting in a collective)
    for form in backend.forms():
        model = fixtures.build(fixtures.CompositeModel, plan.seed, device)
        sharded = backend.shard(model, spec, form)
        losses = torch.tensor(fixtures.train_sharded(backend, sharded, model, plan, rank=rank, device=device))
        state = backend.state_dict(sharded, StateDictKind.FULL)
        found = differences(state, oracle.state_dict, tolerance)
        if found:
            problems.append(
                report(
                    f"{_where(spec, form, rank)}: full state dict after {ITERATIONS} SGD steps vs the oracle",
                    found,
                    len(oracle.state_dict),
                    tolerance,
                )
            )
        if not torch.allclose(losses, expected_losses, **runtime.LOSS_TOLERANCE["sgd"]):
            problems.append(
                f"{_where(spec, form, rank)}: local losses {losses.tolist()}, the oracle's {expected_losses.tolist()}"
            )
    assert not problems, "\n".join(problems)


def test_smoke_unshard_shows_the_full_parameters(backend: BackendAdapter, rank: int, device: torch.device) -> None:
    """Inside a read-only ``unshard()`` every parameter shows under its original name (only the
    declared ``WRAPPER_COMPONENTS`` removed), full and equal to the unsharded model's."""
    require_all(backend, unshard_capabilities())
    spec = _spec(backend)
    local = fixtures.build(fixtures.CompositeModel, current_seed(), device)
    expected = {name: p.detach().clone() for name, p in local.named_parameters()}
    for form in backend.forms():
        sharded = backend.shard(fixtures.build(fixtures.CompositeModel, current_seed(), device), spec, form)
        with backend.unshard(sharded, writeback=False):
            shown = {declared_fqn(backend, n): p.detach().clone() for n, p in sharded.named_parameters()}
        found = differences(shown, expected, EXACT)
        assert not found, report(
            f"{_where(spec, form, rank)}: parameters inside unshard() vs the unsharded model",
            found,
            len(expected),
            EXACT,
        )


def test_smoke_full_state_dict_round_trip(backend: BackendAdapter, rank: int, device: torch.device) -> None:
    """The full state dict holds the unsharded model's keys and values bit for bit; loaded
    into a sharded model built from another seed, that model's full state dict is the same."""
    require(backend, Capability.FULL_STATE_DICT)
    spec = _spec(backend)
    local = fixtures.build(fixtures.CompositeModel, current_seed(), device)
    expected = {name: value.detach().clone() for name, value in local.state_dict().items()}
    for form in backend.forms():
        where = _where(spec, form, rank)
        saved = backend.shard(fixtures.build(fixtures.CompositeModel, current_seed(), device), spec, form)
        state = backend.state_dict(saved, StateDictKind.FULL)
        found = differences(state, expected, EXACT)
        assert not found, report(f"{where}: full state dict vs the unsharded model", found, len(expected), EXACT)
        target = backend.shard(fixtures.build(fixtures.CompositeModel, current_seed() + 1, device), spec, form)
        backend.load_state_dict(target, {k: v.clone() for k, v in state.items()}, StateDictKind.FULL)
        found = differences(backend.state_dict(target, StateDictKind.FULL), expected, EXACT)
        assert not found, report(
            f"{where}: full state dict after loading into a model built from another seed",
            found,
            len(expected),
            EXACT,
        )


def test_smoke_collective_labels_name_parameters(backend: BackendAdapter, rank: int, device: torch.device) -> None:
    """Every label ``collective_label()`` gives while the backend's collectives of a training
    step run is a comma-separated list of the model's parameter FQNs (declared wrapper
    components removed) or, for a collective that moves no parameter, a description in words
    (the reference engine's "forward order check"); asking never raises. An adapter that labels
    nothing passes: labels are optional, wrong ones are not (the divergence diff would name
    the wrong parameters)."""
    spec = _spec(backend)
    seen: list[tuple[str, str | None]] = []
    errors: list[str] = []

    def observe(record: harness.CollectiveRecord) -> None:
        try:
            seen.append((record.op, backend.collective_label()))
        except Exception as error:  # noqa: BLE001 - reported below, with the collective it broke
            errors.append(f"{record.op}: collective_label() raised {type(error).__name__}: {error}")

    for form in backend.forms():
        model = fixtures.build(fixtures.CompositeModel, current_seed(), device)
        names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        sharded = backend.shard(model, spec, form)
        plan = fixtures.TrainingPlan(
            seed=current_seed(),
            iterations=1,
            batch_size=runtime.LOCAL_BATCH,
            make_optimizer=runtime.OPTIMIZERS["sgd"],
        )
        seen.clear()
        harness.set_interceptor(observe)  # returns None: every collective is issued as usual
        try:
            fixtures.train_sharded(backend, sharded, model, plan, rank=rank, device=device)
        finally:
            harness.set_interceptor(None)
        strangers = sorted(
            {
                f"{op} labelled {label!r}: {unknown}"
                for op, label in seen
                if label is not None
                for unknown in [[n for n in _label_names(backend, label) if n not in names]]
                if unknown
            }
        )
        assert not errors and not strangers, (
            f"{_where(spec, form, rank)}: labels of the {len(seen)} collectives of one training "
            "step:\n  " + "\n  ".join(errors + strangers) + f"\n(the model's parameters: {sorted(names)})"
        )


def _label_names(backend: BackendAdapter, label: str) -> list[str]:
    """The parameter names a label gives: its comma-separated parts, without the parts that
    are words (parameter FQNs have no spaces)."""
    parts = [part.strip() for part in label.split(",")]
    return [declared_fqn(backend, part) for part in parts if part and not any(c.isspace() for c in part)]
