"""Training numerics: mixed precision, gradient accumulation, clipping and activation
checkpointing against the oracle.

Both scenarios train ``fixtures.CompositeModel`` (width 16) with plain SGD, which moves each
parameter by lr x gradient and so shows any wrong gradient scale, and compare the run with the
single-process oracle (``fixtures.train_oracle``) running the same program: the local losses of
every backward pass, the final full state dict and, where the backend shows full gradients
(``UNSHARD_WITH_GRADS``), the gradients each optimizer step uses. Every difference is reported
by parameter name with its size.

* ``test_mixed_precision_training``: compute in ``param_dtype`` (float16 or bfloat16), reduce
  gradients in it (``reduce_dtype`` None, the libraries' default) or in float32
  (``REDUCE_DTYPE``), step float32 master parameters. The oracle runs the same casts per rank
  (``fixtures.Precision``), from the float32 parameters the model was built with, or, for a
  backend that stores them in the compute dtype once it has sharded the model (DeepSpeed's
  bf16/fp16 mode: float32 only as its optimizer's master copy, made from the cast model), from
  those values rounded to it, all such a backend still has.
* ``test_gradient_accumulation``: several backward passes per optimizer step, each reducing
  (``plain``); the first ones inside the backend's ``no_gradient_sync`` (``no_sync``,
  ``NO_SYNC``); or no ``zero_grad`` at all, a step after every backward (``no_zero_grad``, the
  2-D seed's loop), so each step uses the sum of every gradient so far. A gradient overwritten
  instead of added fails them (tests/conformance_tests/family_mutants.py, accumulation_overwrite).
* ``test_gradient_clipping``: three SGD steps, each clipping to one total norm through the
  backend's ``clip_grad_norm`` (``GRADIENT_CLIPPING``); the norm it returns, the losses and the
  final parameters equal the oracle's, which clips the whole averaged gradient. Clipping by the
  local norm fails it (clip_local_norm).
* ``test_activation_checkpointing``: every unit called through ``torch.utils.checkpoint``
  (non-reentrant), so backward runs each unit's forward again, module hooks included; two SGD
  steps against the oracle running the same checkpointed model. Gradients reduced twice by the
  recomputation fail it (checkpoint_reduced_twice).
* ``test_uneven_batches``: rank r feeds LOCAL_BATCH + r samples; the rank gradients are still
  averaged (divided by the world size), as the oracle's objective says. Weighting by each
  rank's share of the samples fails it (sample_weighted).

Unit plans: the whole model as one unit (``none``: no auto-wrap classes, no manual units) or
every ``fixtures.Unit`` auto-wrapped below the root (``auto``: ``UNITS`` + ``AUTO_WRAP``), over
every strategy the backend declares (HYBRID_SHARD on an explicit (replicate, shard) mesh).
The axes are covered pairwise, not as full products (see ``MIXED_PRECISION_CASES`` and
``ACCUMULATION_CASES``): world size 2 by default.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn

import fixtures
from conformance.programs.tolerances import CLIP_NORM_RTOL
from conformance.protocol import (
    ApiForm,
    BackendAdapter,
    Capability,
    DeferredInit,
    ParameterGroups,
    ShardingSpec,
    ShardingStrategy,
    StateDictKind,
    declared_fqn,
    require,
    require_all,
)
from conformance.scenario_specs import hybrid_fits, spec_with_mesh
from fixtures.compare import EXACT, Tolerance, differences, report
from harness import current_seed

WIDTH = 16  # CompositeModel(dim=WIDTH): small enough that float16 sums stay far from overflow
LOCAL_BATCH = 2
STRATEGIES = list(ShardingStrategy)

# -- tolerances ------------------------------------------------------------------------------
# Measured on CPU + gloo, torch 2.13, seed 1234, world size 2: every strategy with both unit plans
# (and both reduction dtypes, both low-precision dtypes) on the reference (both forms), torch-fsdp1
# and torch-fsdp2 (FSDP1's HYBRID_SHARD, an expected failure, left out), as the largest difference
# from the oracle of the losses (absolute), of the final parameters (absolute) and of the full
# gradients (absolute, over the tensor's largest entry).
#
# Mixed precision: torch FSDP1 and FSDP2 equal the oracle bit for bit in every case (their
# forward, backward and low-precision reduce-scatter / all-reduce are the oracle's operations on
# the same values, ws2). The reference engine reduces in float32 even where reduce_dtype is None,
# which moves each averaged gradient by up to half an ulp of the low-precision dtype: with fp16
# losses 9.8e-4, parameters 3.9e-6, gradients 4.9e-4 of their scale; with bf16 1.6e-2, 3.1e-5,
# 3.8e-3. DeepSpeed, which stores its parameters in the compute dtype (bf16 on every CPU; fp16
# where its CPU accelerator has it, a CPU with AVX512-FP16 or AMX-FP16, and on CUDA), against the
# oracle started from them rounded (above): equal bit for bit with reduce_param_dtype; with
# reduce_fp32 losses equal and 2 (fp16) or 4 (bf16) of 15 final parameters one ulp of the dtype
# off in an entry. Against an oracle started from the float32 values, as these bounds were first
# measured, the rounded start moved one rank's second loss by 0.10 (bf16): the loss sums 32
# outputs that largely cancel, so its rounding noise scales with the outputs, not with the
# loss. That is the noise a correct backend may add (a reduction in higher precision, a ring
# summing in another order at larger world sizes), so the bounds are a few times it: losses
# rtol 2 eps of the dtype plus atol 16 eps (fp16, 1.6e-2) or 32 eps (bf16, 0.25, 2.5 times that
# 0.10, kept), parameters 4x, gradients 2 eps of their scale (4x). A gradient doubled
# in low precision (tests/conformance_tests/family_mutants.py, lowp_double) moves losses by at least
# 2.3, parameters by 3.8e-2 and gradients by 1.2x their scale: 9 to 300 times these bounds.
#
# Gradient accumulation (float32): losses 1.4e-6, parameters 3.0e-8 (one ulp), gradients 4.2e-7
# of their scale, on every backend alike; the bounds are about four times that. A gradient
# overwritten instead of added (accumulation_overwrite) moves losses by at least 2.3 and
# parameters by 3.8e-2.


@dataclass(frozen=True)
class Bounds:
    """How far a run may be from the oracle: losses (``torch.allclose`` rtol / atol), final
    parameters and full gradients (``fixtures.compare.Tolerance``)."""

    loss_rtol: float
    loss_atol: float
    params: Tolerance
    grads: Tolerance


FULL_PRECISION_BOUNDS = Bounds(
    loss_rtol=2e-6,
    loss_atol=5e-6,
    params=Tolerance(rtol=0.0, atol=1.2e-7),
    grads=Tolerance(rtol=0.0, atol=0.0, scaled_atol=2e-6),
)
MIXED_PRECISION_BOUNDS = {
    torch.float16: Bounds(
        loss_rtol=2e-3,
        loss_atol=1.6e-2,
        params=Tolerance(rtol=0.0, atol=1.6e-5),
        grads=Tolerance(rtol=0.0, atol=0.0, scaled_atol=2e-3),
    ),
    torch.bfloat16: Bounds(
        loss_rtol=1.6e-2,
        loss_atol=0.25,
        params=Tolerance(rtol=0.0, atol=1.2e-4),
        grads=Tolerance(rtol=0.0, atol=0.0, scaled_atol=1.6e-2),
    ),
}

# Large enough that a doubled or dropped gradient moves parameters far beyond rounding noise
# (3.8e-2 against bounds of 1e-4 and less), small enough that the width-16 sum loss stays in
# float16 range over three steps.
LEARNING_RATE = 1e-3
SGD = functools.partial(torch.optim.SGD, lr=LEARNING_RATE)


# -- cases -----------------------------------------------------------------------------------
# Mixed precision: the reduction dtype by id part. None reduces in param_dtype.
REDUCE_DTYPES: dict[str, torch.dtype | None] = {"reduce_param_dtype": None, "reduce_fp32": torch.float32}


# Auto-wrapped units, beside the unit-less plan every strategy runs in: the strategies whose
# units every backend with units has (a backend without units, or with units under some
# strategies only, such as DeepSpeed's ZeRO-3, runs the unit-less cases of every strategy).
MIXED_PRECISION_WITH_UNITS = (
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.HYBRID_SHARD,
)


def _mixed_precision_cases() -> list[object]:
    """Every strategy without units, the reduction dtype alternating along the strategies; then
    MIXED_PRECISION_WITH_UNITS with auto-wrapped units and the other reduction dtype, so those
    meet both. Pairwise: plan x reduction dtype and strategy x plan where units exist; every
    case runs each low-precision dtype the backend has (mixed_precision_dtypes())."""
    names = list(REDUCE_DTYPES)
    cases = []
    for s, strategy in enumerate(STRATEGIES):
        cases.append(pytest.param("none", strategy, names[s % 2], id=f"none-{strategy.name}-{names[s % 2]}"))
    for strategy in MIXED_PRECISION_WITH_UNITS:
        other = names[(STRATEGIES.index(strategy) + 1) % 2]
        cases.append(pytest.param("auto", strategy, other, id=f"auto-{strategy.name}-{other}"))
    return cases


@dataclass(frozen=True)
class Accumulation:
    """A gradient-accumulation program: optimizer steps, backward passes per step, whether the
    first ones run inside the backend's no_gradient_sync, whether gradients are dropped before
    each step."""

    steps: int
    micro_batches: int
    without_sync: bool = False
    zero_grad: bool = True

    def describe(self) -> str:
        if not self.zero_grad:
            return f"{self.steps} steps, one backward each, never zero_grad (gradients summed over steps)"
        synced = f", the first {self.micro_batches - 1} inside no_gradient_sync" if self.without_sync else ""
        return f"{self.steps} steps of {self.micro_batches} backward passes{synced}"


ACCUMULATION = {
    "plain": Accumulation(steps=2, micro_batches=2),
    "no_sync": Accumulation(steps=2, micro_batches=3, without_sync=True),
    "no_zero_grad": Accumulation(steps=3, micro_batches=1, zero_grad=False),
}


# One auto-wrapped case per mode, beside the unit-less cases: (mode, strategy) pairs that the
# mixed-precision cases with units leave out (NO_SHARD units; no_sync across several units).
ACCUMULATION_WITH_UNITS = {
    "plain": ShardingStrategy.FULL_SHARD,
    "no_sync": ShardingStrategy.HYBRID_SHARD,
    "no_zero_grad": ShardingStrategy.NO_SHARD,
}


def _accumulation_cases() -> list[object]:
    """Every mode with every strategy, the whole model one unit (so a backend without units
    runs every mode it has), and one case per mode with auto-wrapped units
    (ACCUMULATION_WITH_UNITS). Pairwise: mode x strategy in full, mode x plan in full."""
    cases = []
    for mode, strategy in itertools.product(ACCUMULATION, STRATEGIES):
        cases.append(pytest.param(mode, "none", strategy, id=f"{mode}-none-{strategy.name}"))
    for mode, strategy in ACCUMULATION_WITH_UNITS.items():
        cases.append(pytest.param(mode, "auto", strategy, id=f"{mode}-auto-{strategy.name}"))
    return cases


MIXED_PRECISION_CASES = _mixed_precision_cases()
ACCUMULATION_CASES = _accumulation_cases()


# -- the shared run ----------------------------------------------------------------------------


def _shown_grads(backend: BackendAdapter, sharded: nn.Module) -> dict[str, torch.Tensor]:
    """Full gradients by declared FQN; call inside ``unshard(with_grads=True)``."""
    return {
        declared_fqn(backend, name): param.grad.detach().clone()
        for name, param in sharded.named_parameters()
        if param.grad is not None
    }


def _compare_with_oracle(
    backend: BackendAdapter,
    spec: ShardingSpec,
    plan: fixtures.TrainingPlan,
    oracle: OracleFor,
    bounds: Bounds,
    *,
    rank: int,
    device: torch.device,
    without_sync: bool = False,
    build_model: ModelBuilder | None = None,
    deferred: bool = False,
) -> list[str]:
    """Train ``plan`` with ``spec`` in every form the backend has; return what differs from
    the oracle's run, ``oracle(stored_low)`` (empty: nothing), where ``stored_low`` names the
    parameters the sharded model stores in the compute dtype (:func:`_stored_in_compute_dtype`).
    ``build_model(seed, device)`` makes the unsharded model (default: ``_composite``).
    ``deferred``: the model is built on the meta device and sharded by ``shard_deferred`` with
    the values ``build_model`` gives (:func:`_shard_deferred_checked`).
    Problems are collected, not raised, so a defect seen on one rank only never leaves the
    others waiting in the next form's collectives."""
    build_model = build_model or _composite
    shows_grads = backend.supports(Capability.UNSHARD_WITH_GRADS)
    problems: list[str] = []
    for form in backend.forms():
        if deferred:
            model = build_model(plan.seed, torch.device("meta"))
            sharded = _shard_deferred_checked(backend, model, spec, form, build_model(plan.seed, device), problems)
        else:
            model = build_model(plan.seed, device)
            sharded = backend.shard(model, spec, form)
        expected = oracle(_stored_in_compute_dtype(backend, sharded, spec.param_dtype))
        oracle_losses = torch.tensor([per_rank[rank] for per_rank in expected.rank_losses])

        def check_grads(
            step: int, sharded: nn.Module = sharded, form: ApiForm = form, expected: fixtures.OracleRun = expected
        ) -> None:
            if not shows_grads:
                return
            with backend.unshard(sharded, writeback=False, with_grads=True):
                grads = _shown_grads(backend, sharded)
            found = differences(grads, expected.grads[step], bounds.grads)
            if found:
                what = f"{form.value} form: gradients used by step {step}"
                problems.append(report(what, found, len(expected.grads[step]), bounds.grads))

        def check_norm(step: int, norm: torch.Tensor | None, form: ApiForm = form, expected=expected) -> None:
            if norm is None:  # a backend that clips inside its step: its training is what is checked
                return
            value, wanted = float(norm), expected.grad_norms[step]
            if not abs(value - wanted) <= CLIP_NORM_RTOL * wanted:
                problems.append(
                    f"{form.value} form: clip_grad_norm at step {step} returned the total norm {value:.7g}; the "
                    f"oracle's whole averaged gradient has norm {wanted:.7g} (relative difference "
                    f"{abs(value - wanted) / wanted:.3g}, allowed {CLIP_NORM_RTOL:g}; a norm over this rank's "
                    "shards only, the classic clipping bug, is smaller by up to the square root of the world size)"
                )

        accumulate = functools.partial(backend.no_gradient_sync, sharded) if without_sync else None
        losses = fixtures.train_sharded(
            backend,
            sharded,
            model,
            plan,
            rank=rank,
            device=device,
            after_backward=check_grads,
            accumulate_without_sync=accumulate,
            clipped=check_norm,
        )
        state = backend.state_dict(sharded, StateDictKind.FULL)
        problems += _state_differences(backend, state, expected.state_dict, spec.param_dtype, bounds.params, form, plan)
        actual = torch.tensor(losses)
        if not torch.allclose(actual, oracle_losses, rtol=bounds.loss_rtol, atol=bounds.loss_atol):
            largest = (actual.double() - oracle_losses.double()).abs().max().item()
            problems.append(
                f"{form.value} form: local losses differ by up to {largest:.3g} "
                f"(rtol {bounds.loss_rtol:g}, atol {bounds.loss_atol:g}):\n"
                f"  sharded {actual.tolist()}\n  oracle  {oracle_losses.tolist()}"
            )
    return problems


ModelBuilder = Callable[[int, torch.device], nn.Module]
"""Makes a scenario's unsharded model from its seed, on a device (the meta device: built there,
without values)."""


def _shard_deferred_checked(
    backend: BackendAdapter,
    model: nn.Module,
    spec: ShardingSpec,
    form: ApiForm,
    source: nn.Module,
    problems: list[str],
) -> nn.Module:
    """``backend.shard_deferred`` of the meta-built ``model`` to ``source``'s values, then its
    full state dict right away: every parameter and buffer must hold exactly its value (one left
    to ``to_empty``'s uninitialized memory, or still on the meta device, is reported by name)."""
    init = DeferredInit(fixtures.deferred_fill(source, model))
    sharded = backend.shard_deferred(model, spec, form, init)
    state = backend.state_dict(sharded, StateDictKind.FULL)
    expected = {name: value.detach().cpu() for name, value in source.state_dict().items()}
    on_meta = sorted(name for name, value in state.items() if isinstance(value, torch.Tensor) and value.is_meta)
    if on_meta:
        problems.append(f"{form.value} form: after shard_deferred, still on the meta device: {on_meta}")
        state = {name: value for name, value in state.items() if name not in on_meta}
        expected = {name: value for name, value in expected.items() if name not in on_meta}
    found = differences(state, expected, EXACT)
    if found:
        what = f"{form.value} form: values right after shard_deferred (not those the init filled in)"
        problems.append(report(what, found, len(expected), EXACT))
    return sharded


def _composite(seed: int, device: torch.device, checkpointed: bool = False) -> nn.Module:
    """The scenarios' model: ``fixtures.CompositeModel`` of width WIDTH."""
    return fixtures.build(fixtures.CompositeModel, seed, device, dim=WIDTH, checkpointed=checkpointed)


OracleFor = Callable[[frozenset[str]], fixtures.OracleRun]
"""The oracle's run of a scenario's program, its starting parameters named in the argument
rounded to the compute dtype (:func:`_oracle_runs`)."""


def _stored_in_compute_dtype(backend: BackendAdapter, sharded: nn.Module, dtype: torch.dtype | None) -> frozenset[str]:
    """The parameters (original FQNs) of which this rank stores, right after ``shard()``, a part
    in the compute dtype ``dtype`` (``local_shard``; no collective): a backend that keeps its
    model in low precision, float32 only as its optimizer's master copy (DeepSpeed's bf16/fp16
    mode), has only those rounded values to start its masters from."""
    if dtype is None:
        return frozenset()
    stored = set()
    for name, _ in sharded.named_parameters():
        fqn = backend.original_fqn(name)
        if backend.local_shard(sharded, fqn).dtype == dtype:
            stored.add(fqn)
    return frozenset(stored)


def _oracle_runs(
    plan: fixtures.TrainingPlan,
    *,
    world_size: int,
    device: torch.device,
    precision: fixtures.Precision | None = None,
    build_model: ModelBuilder | None = None,
) -> OracleFor:
    """``fixtures.train_oracle`` of the scenario's model, as a function of the parameters whose
    starting values are rounded to ``precision.param_dtype`` first (what a backend that stores
    them in low precision starts from: the float32 values are gone once it has cast its model),
    each run made once. ``build_model`` as for :func:`_compare_with_oracle`."""
    build_model = build_model or _composite
    runs: dict[frozenset[str], fixtures.OracleRun] = {}

    def run(rounded: frozenset[str]) -> fixtures.OracleRun:
        if rounded not in runs:
            model = build_model(plan.seed, device)
            if precision is not None:
                with torch.no_grad():
                    for name, param in model.named_parameters():
                        if name in rounded:
                            param.copy_(param.to(precision.param_dtype).to(param.dtype))
            runs[rounded] = fixtures.train_oracle(
                model, plan, world_size=world_size, device=device, precision=precision
            )
        return runs[rounded]

    return run


def _state_differences(
    backend: BackendAdapter,
    state: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    compute_dtype: torch.dtype | None,
    tolerance: Tolerance,
    form: ApiForm,
    plan: fixtures.TrainingPlan,
) -> list[str]:
    """The final full state dict against the oracle's float32 one.

    A backend whose model parameters live in the compute dtype, float32 only as its optimizer's
    master copy (``MIXED_PRECISION_UNSHARD.shows_compute_dtype`` with a state dict in that dtype:
    DeepSpeed), is compared with the oracle's parameters rounded to that dtype, one ulp of it
    allowed on top (the masters may straddle a rounding boundary); any other dtype is reported."""
    rounded = {
        name
        for name, value in state.items()
        if compute_dtype is not None
        and backend.MIXED_PRECISION_UNSHARD.shows_compute_dtype
        and value.dtype == compute_dtype
        and name in expected
        and expected[name].dtype == torch.float32
    }
    problems = []
    what = f"{form.value} form: final parameters after {plan.iterations} steps"
    kept = {name: value for name, value in state.items() if name not in rounded}
    found = differences(kept, {k: v for k, v in expected.items() if k not in rounded}, tolerance)
    if found:
        problems.append(report(what, found, len(expected) - len(rounded), tolerance))
    if rounded:
        assert compute_dtype is not None
        one_ulp = dataclasses.replace(tolerance, rtol=tolerance.rtol + torch.finfo(compute_dtype).eps)
        found = differences(
            {name: state[name] for name in rounded},
            {name: expected[name].to(compute_dtype) for name in rounded},
            one_ulp,
        )
        if found:
            kept_in = f"{what} (in {compute_dtype}, as the backend keeps them)"
            problems.append(report(kept_in, found, len(rounded), one_ulp))
    return problems


def _plan(
    steps: int,
    micro_batches: int = 1,
    zero_grad: bool = True,
    clip_norm: float | None = None,
    make_optimizer: fixtures.OptimizerFactory = SGD,
    extra_rows_per_rank: int = 0,
    parameter_groups: ParameterGroups | None = None,
) -> fixtures.TrainingPlan:
    return fixtures.TrainingPlan(
        seed=current_seed(),
        iterations=steps,
        batch_size=LOCAL_BATCH,
        make_optimizer=make_optimizer,
        micro_batches=micro_batches,
        zero_grad=zero_grad,
        clip_norm=clip_norm,
        extra_rows_per_rank=extra_rows_per_rank,
        parameter_groups=parameter_groups,
    )


def _assert_trains_like_oracle(
    backend: BackendAdapter,
    spec: ShardingSpec,
    plan: fixtures.TrainingPlan,
    oracle: OracleFor,
    what: str,
    *,
    rank: int,
    device: torch.device,
    build_model: ModelBuilder | None = None,
    deferred: bool = False,
) -> None:
    """:func:`_compare_with_oracle` within the float32 bounds; fail naming ``what`` (the program,
    its strategy and its units) and every difference."""
    problems = _compare_with_oracle(
        backend,
        spec,
        plan,
        oracle,
        FULL_PRECISION_BOUNDS,
        rank=rank,
        device=device,
        build_model=build_model,
        deferred=deferred,
    )
    assert not problems, f"rank {rank}: {what} differs from the single-process oracle:\n" + "\n".join(problems)


def _unit_words(wrap: str) -> str:
    return "auto-wrapped units" if wrap == "auto" else "one unit"


def _units(wrap: str) -> tuple[type[nn.Module], ...]:
    return (fixtures.Unit,) if wrap == "auto" else ()


# -- scenarios ---------------------------------------------------------------------------------

MIXED_PRECISION_STEPS = 2


@pytest.mark.world_size(min=2, default=2, exclude=hybrid_fits)
@pytest.mark.parametrize(("wrap", "strategy", "reduce_name"), MIXED_PRECISION_CASES)
def test_mixed_precision_training(
    backend: BackendAdapter,
    wrap: str,
    strategy: ShardingStrategy,
    reduce_name: str,
    world_size: int,
    rank: int,
    device: torch.device,
) -> None:
    """For each low-precision dtype the backend computes in (``mixed_precision_dtypes()``):
    two SGD steps computing in it, gradients reduced in it (``reduce_param_dtype``) or in
    float32 (``reduce_fp32``), equal the oracle running the same casts: losses, final float32
    parameters and (``UNSHARD_WITH_GRADS``) the full float32 gradients of each step, at the
    dtype's bounds (``MIXED_PRECISION_BOUNDS``). A gradient doubled in low precision fails them."""
    reduce_dtype = REDUCE_DTYPES[reduce_name]
    require(backend, Capability.FULL_STATE_DICT)
    require(backend, Capability.MIXED_PRECISION)
    dtypes = backend.mixed_precision_dtypes()
    # Every dtype the backend offers needs what the first needs: the spec decides the skips.
    spec = spec_with_mesh(
        backend,
        world_size,
        device,
        strategy=strategy,
        auto_wrap_classes=_units(wrap),
        param_dtype=dtypes[0],
        reduce_dtype=reduce_dtype,
    )
    plan = _plan(MIXED_PRECISION_STEPS)
    problems = []
    for param_dtype in dtypes:
        precision = fixtures.Precision(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        oracle = _oracle_runs(plan, world_size=world_size, device=device, precision=precision)
        found = _compare_with_oracle(
            backend,
            dataclasses.replace(spec, param_dtype=param_dtype),
            plan,
            oracle,
            _mixed_precision_bounds(param_dtype),
            rank=rank,
            device=device,
        )
        reduced_in = _dtype_name(reduce_dtype or param_dtype)
        problems += [f"{_dtype_name(param_dtype)} compute, gradients reduced in {reduced_in}: {p}" for p in found]
    assert not problems, f"rank {rank}: mixed-precision training differs from the single-process oracle:\n" + "\n".join(
        problems
    )


def _mixed_precision_bounds(dtype: torch.dtype) -> Bounds:
    if dtype not in MIXED_PRECISION_BOUNDS:
        raise ValueError(
            f"mixed_precision_dtypes() offers {dtype}, for which MIXED_PRECISION_BOUNDS has no measured "
            "bounds: measure this scenario's noise in it and add them"
        )
    return MIXED_PRECISION_BOUNDS[dtype]


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype))


@pytest.mark.world_size(min=2, default=2, exclude=hybrid_fits)
@pytest.mark.parametrize(("mode", "wrap", "strategy"), ACCUMULATION_CASES)
def test_gradient_accumulation(
    backend: BackendAdapter,
    mode: str,
    wrap: str,
    strategy: ShardingStrategy,
    world_size: int,
    rank: int,
    device: torch.device,
) -> None:
    """Gradients of several backward passes add up (float32 SGD) as the oracle's do: ``plain``,
    two backward passes per step, each reducing; ``no_sync``, three per step, the first two
    inside ``no_gradient_sync`` (``NO_SYNC``); ``no_zero_grad``, three steps of one backward
    each without ``zero_grad``. Losses of every backward pass, final parameters and
    (``UNSHARD_WITH_GRADS``) the gradients each step uses equal the oracle's."""
    program = ACCUMULATION[mode]
    require(backend, Capability.FULL_STATE_DICT)
    if program.without_sync:
        # Before any mesh exists, with what it is combined with: a backend may have the switch
        # under some strategies only (UNSUPPORTED_COMBINATIONS).
        units = {Capability.UNITS, Capability.AUTO_WRAP} if _units(wrap) else set()
        require_all(backend, {Capability.NO_SYNC, Capability.for_strategy(strategy), *units})
    spec = spec_with_mesh(backend, world_size, device, strategy=strategy, auto_wrap_classes=_units(wrap))
    plan = _plan(program.steps, program.micro_batches, program.zero_grad)
    oracle = _oracle_runs(plan, world_size=world_size, device=device)
    problems = _compare_with_oracle(
        backend,
        spec,
        plan,
        oracle,
        FULL_PRECISION_BOUNDS,
        rank=rank,
        device=device,
        without_sync=program.without_sync,
    )
    assert not problems, (
        f"rank {rank}: gradient accumulation ({mode}: {program.describe()}) differs from the "
        "single-process oracle:\n" + "\n".join(problems)
    )


# -- gradient clipping -------------------------------------------------------------------------
# Every step clips (the oracle's total norm is at least CLIP_ACTIVE times CLIP_NORM at every step,
# asserted: a clip that never acts proves nothing), so each step moves the parameters by exactly
# CLIPPING_LR x CLIP_NORM in total, in the direction of the whole gradient. A backend clipping by
# its local norm (its own shards only: smaller than the total) scales its update by up to
# sqrt(world size) more (tests/conformance_tests/family_mutants.py, clip_local_norm); the norm it
# returns is off by that much too. Measured on CPU + gloo, torch 2.13, seed 1234, ws2 and ws4,
# reference (both forms), torch-fsdp1, torch-fsdp2, torch-zero: the returned norm within 3e-7
# (relative) of the oracle's, losses and parameters within FULL_PRECISION_BOUNDS.
CLIP_NORM = 0.05
CLIP_ACTIVE = 1.5
CLIPPING_LR = 0.1  # SGD: large enough that a wrongly scaled clip moves parameters far beyond rounding
CLIPPING_STEPS = 3

# Units auto-wrapped for the strategies whose units every backend with units has; every
# strategy runs unit-less.
# The unit plans of the training-loop scenarios (clipping, checkpointing, uneven data, tied weights,
# parameter groups): the whole model one unit for every strategy; every Unit a unit for the
# strategies that gather per unit.
WITH_UNITS = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.HYBRID_SHARD)
UNIT_PLAN_CASES = [pytest.param("none", strategy, id=f"none-{strategy.name}") for strategy in STRATEGIES] + [
    pytest.param("auto", strategy, id=f"auto-{strategy.name}") for strategy in WITH_UNITS
]


@pytest.mark.world_size(min=2, default=2, exclude=hybrid_fits)
@pytest.mark.parametrize(("wrap", "strategy"), UNIT_PLAN_CASES)
def test_gradient_clipping(
    backend: BackendAdapter,
    wrap: str,
    strategy: ShardingStrategy,
    world_size: int,
    rank: int,
    device: torch.device,
) -> None:
    """Clipping by the total norm over ranks (``GRADIENT_CLIPPING``): three float32 SGD steps,
    each clipping the gradients to ``CLIP_NORM`` through the backend's ``clip_grad_norm``
    between backward and step. The norm it returns (where it returns one) is the oracle's norm of
    the whole averaged gradient, and every local loss, the gradients the steps use
    (``UNSHARD_WITH_GRADS``) and the final parameters equal the oracle's, which clips with
    ``torch.nn.utils.clip_grad_norm_`` over the unsharded model."""
    require_all(backend, {Capability.GRADIENT_CLIPPING, Capability.FULL_STATE_DICT})
    spec = spec_with_mesh(backend, world_size, device, strategy=strategy, auto_wrap_classes=_units(wrap))
    plan = _plan(
        CLIPPING_STEPS,
        clip_norm=CLIP_NORM,
        make_optimizer=functools.partial(torch.optim.SGD, lr=CLIPPING_LR),
    )
    oracle = _oracle_runs(plan, world_size=world_size, device=device)
    quiet = [norm for norm in oracle(frozenset()).grad_norms if norm < CLIP_ACTIVE * CLIP_NORM]
    assert not quiet, (
        f"the scenario's clip would not act: the oracle's gradient norms {oracle(frozenset()).grad_norms} "
        f"include some below {CLIP_ACTIVE} x CLIP_NORM ({CLIP_NORM}); lower CLIP_NORM"
    )
    what = f"gradient clipping to total norm {CLIP_NORM} ({strategy.name}, {_unit_words(wrap)})"
    _assert_trains_like_oracle(backend, spec, plan, oracle, what, rank=rank, device=device)


# -- activation checkpointing ------------------------------------------------------------------
CHECKPOINTING_STEPS = 2


@pytest.mark.world_size(min=2, default=2, exclude=hybrid_fits)
@pytest.mark.parametrize(("wrap", "strategy"), UNIT_PLAN_CASES)
def test_activation_checkpointing(
    backend: BackendAdapter,
    wrap: str,
    strategy: ShardingStrategy,
    world_size: int,
    rank: int,
    device: torch.device,
) -> None:
    """Activation checkpointing of every unit, as Hugging Face models apply it (the parent calls
    ``torch.utils.checkpoint.checkpoint(unit, hidden, use_reentrant=False)``): backward runs each
    unit's forward a second time, its module hooks included, so a backend that gathers in a
    pre-forward hook gathers again there, and one that reduces on a hook of the forward may
    reduce twice. Two float32 SGD steps; every local loss, the gradients each step uses
    (``UNSHARD_WITH_GRADS``) and the final parameters equal the oracle's, which runs the same
    checkpointed model in one process (recomputation changes no value). A unit whose gradients
    are reduced twice is off by a factor (tests/conformance_tests/family_mutants.py,
    checkpoint_reduced_twice)."""
    require_all(backend, {Capability.FULL_STATE_DICT})
    spec = spec_with_mesh(backend, world_size, device, strategy=strategy, auto_wrap_classes=_units(wrap))
    plan = _plan(CHECKPOINTING_STEPS)
    checkpointed = functools.partial(_composite, checkpointed=True)
    oracle = _oracle_runs(plan, world_size=world_size, device=device, build_model=checkpointed)
    what = f"activation-checkpointed training ({strategy.name}, {_unit_words(wrap)})"
    _assert_trains_like_oracle(backend, spec, plan, oracle, what, rank=rank, device=device, build_model=checkpointed)


# -- deferred initialization -------------------------------------------------------------------
DEFERRED_STEPS = 2


@pytest.mark.world_size(min=2, default=2, exclude=hybrid_fits)
@pytest.mark.parametrize(("wrap", "strategy"), UNIT_PLAN_CASES)
def test_deferred_init(
    backend: BackendAdapter,
    wrap: str,
    strategy: ShardingStrategy,
    world_size: int,
    rank: int,
    device: torch.device,
) -> None:
    """A model built on the meta device (``torch.device("meta")``: no storage, as large models
    are built) and materialized through ``shard_deferred``: the backend's own mechanism where it
    has one (FSDP1's ``param_init_fn``, FSDP2's ``fully_shard`` then ``to_empty``), else the
    default (materialize, then shard). Right after it, the full state dict holds exactly the
    values the init filled in, for every parameter and buffer (the root's own ``mix`` and
    ``scale`` and each unit's included); then two float32 SGD steps train like the oracle's model
    built with those values. A backend that leaves a submodule to ``to_empty``'s uninitialized
    memory fails it (tests/conformance_tests/family_mutants.py, init_skipped)."""
    require_all(backend, {Capability.FULL_STATE_DICT})
    spec = spec_with_mesh(backend, world_size, device, strategy=strategy, auto_wrap_classes=_units(wrap))
    plan = _plan(DEFERRED_STEPS)
    oracle = _oracle_runs(plan, world_size=world_size, device=device)
    what = f"training a model built on the meta device ({strategy.name}, {_unit_words(wrap)})"
    _assert_trains_like_oracle(backend, spec, plan, oracle, what, rank=rank, device=device, deferred=True)


# -- uneven batches ----------------------------------------------------------------------------
UNEVEN_STEPS = 2
UNEVEN_EXTRA_ROWS = 1  # rank r feeds LOCAL_BATCH + r samples


@pytest.mark.world_size(min=2, default=2, exclude=hybrid_fits)
@pytest.mark.parametrize(("wrap", "strategy"), UNIT_PLAN_CASES)
def test_uneven_batches(
    backend: BackendAdapter,
    wrap: str,
    strategy: ShardingStrategy,
    world_size: int,
    rank: int,
    device: torch.device,
) -> None:
    """Ranks feeding different numbers of samples (rank r: LOCAL_BATCH + r, as the last batch of
    an epoch that does not split evenly, or a packed-sequence loader, gives them): data
    parallelism averages the rank gradients, dividing by the world size whatever each rank fed,
    so the objective is the mean of the rank losses, as with even data. Two float32 SGD steps;
    losses, gradients (``UNSHARD_WITH_GRADS``) and final parameters equal the oracle's, which
    runs every rank's batch at its own size. A backend that weights each rank's gradient by its
    share of the samples (the mean over all samples instead) is off by that share
    (tests/conformance_tests/family_mutants.py, sample_weighted)."""
    require_all(backend, {Capability.FULL_STATE_DICT})
    spec = spec_with_mesh(backend, world_size, device, strategy=strategy, auto_wrap_classes=_units(wrap))
    plan = _plan(UNEVEN_STEPS, extra_rows_per_rank=UNEVEN_EXTRA_ROWS)
    oracle = _oracle_runs(plan, world_size=world_size, device=device)
    sizes = ", ".join(str(size) for size in plan.batch_sizes(world_size))
    what = f"training on uneven batches (samples per rank {sizes}; {strategy.name}, {_unit_words(wrap)})"
    _assert_trains_like_oracle(backend, spec, plan, oracle, what, rank=rank, device=device)


# -- tied weights ------------------------------------------------------------------------------
TIED_STEPS = 3


def _tied(seed: int, device: torch.device) -> nn.Module:
    return fixtures.build(fixtures.TiedTransformer, seed, device)


@pytest.mark.world_size(min=2, default=2, exclude=hybrid_fits)
@pytest.mark.parametrize(("wrap", "strategy"), UNIT_PLAN_CASES)
def test_tied_weights_training(
    backend: BackendAdapter,
    wrap: str,
    strategy: ShardingStrategy,
    world_size: int,
    rank: int,
    device: torch.device,
) -> None:
    """A model whose output projection shares the embedding weight (``fixtures.TiedTransformer``,
    as language models tie them), trained against the oracle on every backend: the shared
    weight's gradient is the sum of both uses', and one parameter steps with it, so both names
    hold the same values after every step. Three float32 SGD steps, the whole model one unit or
    each transformer layer a unit (the tied weight in the root); losses, gradients
    (``UNSHARD_WITH_GRADS``) and the final full state dict (both names of the tied weight) equal
    the oracle's. A backend that unties the weight when it shards (each use its own copy) fails
    it (tests/conformance_tests/family_mutants.py, untied)."""
    require_all(backend, {Capability.FULL_STATE_DICT})
    layers = fixtures.TiedTransformer.LAYER_CLASSES if wrap == "auto" else ()
    spec = spec_with_mesh(backend, world_size, device, strategy=strategy, auto_wrap_classes=layers)
    plan = _plan(TIED_STEPS)
    oracle = _oracle_runs(plan, world_size=world_size, device=device, build_model=_tied)
    units = "transformer layers as units" if wrap == "auto" else "one unit"
    what = f"training with tied weights ({strategy.name}, {units})"
    _assert_trains_like_oracle(backend, spec, plan, oracle, what, rank=rank, device=device, build_model=_tied)


# -- parameter groups --------------------------------------------------------------------------
GROUP_STEPS = 2


def _no_decay_for_biases(fqn: str) -> str:
    """The group of a parameter, as training scripts choose it: no weight decay for biases."""
    return "no_decay" if fqn.endswith("bias") else "decay"


# Weights decay and step at the factory's rate; biases step ten times faster without decay: a
# backend that drops the groups (one group of the factory's defaults) moves every bias by a tenth
# of its step and every weight without its decay.
PARAMETER_GROUPS = ParameterGroups(
    group_of=_no_decay_for_biases,
    options={"decay": {"weight_decay": 0.5}, "no_decay": {"lr": 1e-2, "weight_decay": 0.0}},
)
GROUPED_SGD = functools.partial(torch.optim.SGD, lr=1e-3, momentum=0.9)


@pytest.mark.world_size(min=2, default=2, exclude=hybrid_fits)
@pytest.mark.parametrize(("wrap", "strategy"), UNIT_PLAN_CASES)
def test_parameter_groups(
    backend: BackendAdapter,
    wrap: str,
    strategy: ShardingStrategy,
    world_size: int,
    rank: int,
    device: torch.device,
) -> None:
    """An optimizer with parameter groups chosen by name through the backend's
    ``make_optimizer_with_groups`` (``PARAMETER_GROUPS``): weights with weight decay 0.5 at lr
    1e-3, biases at lr 1e-2 without decay, SGD with momentum 0.9, two steps. Losses, gradients
    and the final parameters equal the oracle's, whose torch optimizer has the same groups. A
    backend that drops the groups (every parameter with the factory's defaults) fails it
    (tests/conformance_tests/family_mutants.py, groups_ignored)."""
    require_all(backend, {Capability.FULL_STATE_DICT, Capability.PARAMETER_GROUPS})
    spec = spec_with_mesh(backend, world_size, device, strategy=strategy, auto_wrap_classes=_units(wrap))
    plan = _plan(GROUP_STEPS, make_optimizer=GROUPED_SGD, parameter_groups=PARAMETER_GROUPS)
    oracle = _oracle_runs(plan, world_size=world_size, device=device)
    what = f"training with parameter groups ({strategy.name}, {_unit_words(wrap)})"
    _assert_trains_like_oracle(backend, spec, plan, oracle, what, rank=rank, device=device)


@pytest.mark.world_size(min=2, default=2, exclude=hybrid_fits)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_parameter_groups_round_trip(
    backend: BackendAdapter, strategy: ShardingStrategy, world_size: int, rank: int, device: torch.device
) -> None:
    """A resumed job keeps its parameter groups: two steps with the groups of
    test_parameter_groups, the full model and optimizer state dicts loaded into a model sharded
    afresh (built from other values) and an optimizer built with the same groups, then a third
    step; its loss and the parameters after it equal the oracle's three uninterrupted steps. A
    load that mixes up the groups (their options or which parameters they hold) or loses the
    momentum moves the third step."""
    require_all(backend, {Capability.FULL_STATE_DICT, Capability.OPTIM_STATE_DICT, Capability.PARAMETER_GROUPS})
    spec = spec_with_mesh(backend, world_size, device, strategy=strategy)
    plan = _plan(GROUP_STEPS + 1, make_optimizer=GROUPED_SGD, parameter_groups=PARAMETER_GROUPS)
    expected = _oracle_runs(plan, world_size=world_size, device=device)(frozenset())
    problems: list[str] = []
    for form in backend.forms():
        model = _composite(plan.seed, device)
        trained = backend.shard(model, spec, form)
        optimizer = backend.make_optimizer_with_groups(trained, GROUPED_SGD, PARAMETER_GROUPS)
        for step in range(GROUP_STEPS):
            _one_step(backend, trained, optimizer, model, plan, step, rank, device)
        model_state = copy.deepcopy(backend.state_dict(trained, StateDictKind.FULL))
        optim_state = copy.deepcopy(backend.optim_state_dict(trained, optimizer, StateDictKind.FULL))
        restored = backend.shard(_composite(plan.seed + 1, device), spec, form)
        restored_optimizer = backend.make_optimizer_with_groups(restored, GROUPED_SGD, PARAMETER_GROUPS)
        backend.load_state_dict(restored, model_state, StateDictKind.FULL)
        backend.load_optim_state_dict(restored, restored_optimizer, optim_state, StateDictKind.FULL)
        loss = _one_step(backend, restored, restored_optimizer, model, plan, GROUP_STEPS, rank, device)
        wanted = expected.rank_losses[GROUP_STEPS][rank]
        if not abs(loss - wanted) <= FULL_PRECISION_BOUNDS.loss_atol + FULL_PRECISION_BOUNDS.loss_rtol * abs(wanted):
            problems.append(f"{form.value} form: the loss of the step after the load is {loss}; the oracle's {wanted}")
        state = backend.state_dict(restored, StateDictKind.FULL)
        problems += _state_differences(
            backend, state, expected.state_dict, None, FULL_PRECISION_BOUNDS.params, form, plan
        )
    assert not problems, (
        f"rank {rank}: a job resumed from full model and optimizer state dicts with parameter groups "
        f"({strategy.name}) differs from the oracle's uninterrupted run:\n" + "\n".join(problems)
    )


def _one_step(
    backend: BackendAdapter,
    sharded: nn.Module,
    optimizer: Any,
    loss_model: nn.Module,
    plan: fixtures.TrainingPlan,
    step: int,
    rank: int,
    device: torch.device,
) -> float:
    """zero_grad, forward and backward of data iteration ``step``, step: the loop of
    ``fixtures.train_sharded`` for one step with a given optimizer. Returns the local loss."""
    backend.zero_grad(sharded, optimizer)
    inputs = fixtures.local_batch(
        loss_model, seed=plan.seed, iteration=step, rank=rank, batch_size=plan.batch_size_of(rank), device=device
    )
    loss = loss_model.loss(sharded(*inputs))
    backend.backward(sharded, loss)
    backend.step(sharded, optimizer)
    return loss.item()
