"""Training numerics: mixed-precision training and gradient accumulation against the oracle.

Both scenarios train ``fixtures.CompositeModel`` (width 16) with plain SGD, which moves each
parameter by lr x gradient and so shows any wrong gradient scale, and compare the run with the
single-process oracle (``fixtures.train_oracle``) running the same program: the local losses of
every backward pass, the final full state dict and, where the backend shows full gradients
(``UNSHARD_WITH_GRADS``), the gradients each optimizer step uses. Every difference is reported
by parameter name with its size.

* ``test_mixed_precision_training``: compute in ``param_dtype`` (float16 or bfloat16), reduce
  gradients in it (``reduce_dtype`` None, the libraries' default) or in float32
  (``REDUCE_DTYPE``), step float32 master parameters. The oracle runs the same casts per rank
  (``fixtures.Precision``).
* ``test_gradient_accumulation``: several backward passes per optimizer step, each reducing
  (``plain``); the first ones inside the backend's ``no_gradient_sync`` (``no_sync``,
  ``NO_SYNC``); or no ``zero_grad`` at all, a step after every backward (``no_zero_grad``, the
  2-D seed's loop), so each step uses the sum of every gradient so far. A backend that
  overwrites the stored gradient instead of adding to it fails all three.

Unit plans: the whole model as one unit (``root``: no auto-wrap classes, no manual units) or
every ``fixtures.Unit`` auto-wrapped below the root (``auto``: ``UNITS`` + ``AUTO_WRAP``), over
every strategy the backend declares (HYBRID_SHARD on an explicit (replicate, shard) mesh).
The axes are covered pairwise, not as full products (see ``MIXED_PRECISION_CASES`` and
``ACCUMULATION_CASES``): world size 2 by default.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn

import fixtures
from conformance.protocol import (
    ApiForm,
    BackendAdapter,
    Capability,
    ShardingSpec,
    ShardingStrategy,
    StateDictKind,
    declared_fqn,
    require,
)
from conformance.scenario_specs import hybrid_fits, spec_with_mesh
from fixtures.compare import Tolerance, differences, report
from harness import current_seed

WIDTH = 16  # CompositeModel(dim=WIDTH): small enough that float16 sums stay far from overflow
LOCAL_BATCH = 2
WRAPS = ("root", "auto")
STRATEGIES = list(ShardingStrategy)
LOW_PRECISION = {"fp16": torch.float16, "bf16": torch.bfloat16}

# -- tolerances ------------------------------------------------------------------------------
# Measured on CPU + gloo, torch 2.13, seed 1234, world size 2: every case of both scenarios on the
# reference (both forms), torch-fsdp1 and torch-fsdp2 (FSDP1's HYBRID_SHARD, an expected failure,
# left out), as the largest difference from the oracle of the losses (absolute), of the final
# parameters (absolute) and of the full gradients (absolute, over the tensor's largest entry).
#
# Mixed precision: torch FSDP1 and FSDP2 equal the oracle bit for bit in every case (their
# forward, backward and low-precision reduce-scatter / all-reduce are the oracle's operations on
# the same values, ws2). The reference engine reduces in float32 even where reduce_dtype is None,
# which moves each averaged gradient by up to half an ulp of the low-precision dtype: with fp16
# losses 9.8e-4, parameters 3.9e-6, gradients 4.9e-4 of their scale; with bf16 1.6e-2, 3.1e-5,
# 3.8e-3. That is the noise a correct backend may add (a reduction in higher precision, or a ring
# summing in another order at larger world sizes), so the bounds are about four times it: losses
# rtol = atol = 2 eps of the dtype (3 ulps of a loss near 2), parameters 4x, gradients 2 eps of
# their scale (4x). A gradient doubled in low precision (tests/conformance/family_mutants.py,
# lowp_double) moves losses by at least 2.3, parameters by 3.8e-2 and gradients by 1.2x their
# scale: 40 to 1000 times these bounds.
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
        loss_atol=2e-3,
        params=Tolerance(rtol=0.0, atol=1.6e-5),
        grads=Tolerance(rtol=0.0, atol=0.0, scaled_atol=2e-3),
    ),
    torch.bfloat16: Bounds(
        loss_rtol=1.6e-2,
        loss_atol=1.6e-2,
        params=Tolerance(rtol=0.0, atol=1.2e-4),
        grads=Tolerance(rtol=0.0, atol=0.0, scaled_atol=1.6e-2),
    ),
}

LEARNING_RATE = 1e-3
SGD = functools.partial(torch.optim.SGD, lr=LEARNING_RATE)


# -- cases -----------------------------------------------------------------------------------
# Mixed precision: (param_dtype name, reduce_dtype). None reduces in param_dtype.
PRECISIONS: list[tuple[str, torch.dtype | None]] = [
    ("fp16", None),
    ("bf16", None),
    ("bf16", torch.float32),
    ("fp16", torch.float32),
]


def _mixed_precision_cases() -> list[object]:
    """Every strategy with both unit plans; the precisions rotate so that each strategy meets
    both dtypes and both reduction dtypes, and each unit plan every precision (pairwise:
    strategy x plan and plan x precision in full, strategy x precision half)."""
    cases = []
    for (s, strategy), (w, wrap) in itertools.product(enumerate(STRATEGIES), enumerate(WRAPS)):
        dtype_name, reduce_dtype = PRECISIONS[(s + 2 * w) % len(PRECISIONS)]
        reduce_name = "fp32" if reduce_dtype is torch.float32 else dtype_name
        cases.append(
            pytest.param(
                wrap,
                strategy,
                dtype_name,
                reduce_dtype,
                id=f"{wrap}-{strategy.name}-{dtype_name}-reduce_{reduce_name}",
            )
        )
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


def _accumulation_cases() -> list[object]:
    """Every mode with every strategy; the unit plan alternates so that each mode and each
    strategy meets both plans (pairwise: mode x strategy in full, the plan paired with each)."""
    cases = []
    for (m, mode), (s, strategy) in itertools.product(enumerate(ACCUMULATION), enumerate(STRATEGIES)):
        wrap = WRAPS[(m + s) % len(WRAPS)]
        cases.append(pytest.param(mode, wrap, strategy, id=f"{mode}-{wrap}-{strategy.name}"))
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
    oracle: fixtures.OracleRun,
    bounds: Bounds,
    *,
    rank: int,
    device: torch.device,
    without_sync: bool = False,
) -> list[str]:
    """Train ``plan`` with ``spec`` in every form the backend has; return what differs from
    ``oracle`` (empty: nothing). Problems are collected, not raised, so a defect seen on one
    rank only never leaves the others waiting in the next form's collectives."""
    oracle_losses = torch.tensor([per_rank[rank] for per_rank in oracle.rank_losses])
    shows_grads = backend.supports(Capability.UNSHARD_WITH_GRADS)
    problems: list[str] = []
    for form in backend.forms():
        model = fixtures.build(fixtures.CompositeModel, plan.seed, device, dim=WIDTH)
        sharded = backend.shard(model, spec, form)

        def check_grads(step: int, sharded: nn.Module = sharded, form: ApiForm = form) -> None:
            if not shows_grads:
                return
            with backend.unshard(sharded, writeback=False, with_grads=True):
                grads = _shown_grads(backend, sharded)
            found = differences(grads, oracle.grads[step], bounds.grads)
            if found:
                what = f"{form.value} form: gradients used by step {step}"
                problems.append(report(what, found, len(oracle.grads[step]), bounds.grads))

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
        )
        state = backend.state_dict(sharded, StateDictKind.FULL)
        found = differences(state, oracle.state_dict, bounds.params)
        if found:
            what = f"{form.value} form: final parameters after {plan.iterations} steps"
            problems.append(report(what, found, len(oracle.state_dict), bounds.params))
        actual = torch.tensor(losses)
        if not torch.allclose(actual, oracle_losses, rtol=bounds.loss_rtol, atol=bounds.loss_atol):
            largest = (actual.double() - oracle_losses.double()).abs().max().item()
            problems.append(
                f"{form.value} form: local losses differ by up to {largest:.3g} "
                f"(rtol {bounds.loss_rtol:g}, atol {bounds.loss_atol:g}):\n"
                f"  sharded {actual.tolist()}\n  oracle  {oracle_losses.tolist()}"
            )
    return problems


def _plan(steps: int, micro_batches: int = 1, zero_grad: bool = True) -> fixtures.TrainingPlan:
    return fixtures.TrainingPlan(
        seed=current_seed(),
        iterations=steps,
        batch_size=LOCAL_BATCH,
        make_optimizer=SGD,
        micro_batches=micro_batches,
        zero_grad=zero_grad,
    )


def _require_dtype(backend: BackendAdapter, dtype: torch.dtype) -> None:
    """Skip unless ``backend`` computes in ``dtype`` here (after MIXED_PRECISION is required)."""
    offered = backend.mixed_precision_dtypes()
    if dtype not in offered:
        names = ", ".join(str(d).removeprefix("torch.") for d in offered) or "none"
        pytest.skip(
            f"unsupported: {Capability.MIXED_PRECISION.value} {str(dtype).removeprefix('torch.')}: "
            f"{backend.name} computes in {names} here (mixed_precision_dtypes())"
        )


def _units(wrap: str) -> tuple[type[nn.Module], ...]:
    return (fixtures.Unit,) if wrap == "auto" else ()


# -- scenarios ---------------------------------------------------------------------------------

MIXED_PRECISION_STEPS = 2


@pytest.mark.world_size(min=2, default=2, exclude=hybrid_fits)
@pytest.mark.parametrize(("wrap", "strategy", "dtype_name", "reduce_dtype"), MIXED_PRECISION_CASES)
def test_mixed_precision_training(
    backend: BackendAdapter,
    wrap: str,
    strategy: ShardingStrategy,
    dtype_name: str,
    reduce_dtype: torch.dtype | None,
    world_size: int,
    rank: int,
    device: torch.device,
) -> None:
    """Two SGD steps computing in ``param_dtype``, gradients reduced in it or in float32, equal
    the oracle running the same casts: losses, final float32 parameters and (``UNSHARD_WITH_GRADS``)
    the full float32 gradients of each step, at the dtype's bounds (``MIXED_PRECISION_BOUNDS``).
    A low-precision reduction doubled (or left unaveraged) fails them."""
    param_dtype = LOW_PRECISION[dtype_name]
    require(backend, Capability.FULL_STATE_DICT)
    require(backend, Capability.MIXED_PRECISION)
    _require_dtype(backend, param_dtype)
    spec = spec_with_mesh(
        backend,
        world_size,
        device,
        strategy=strategy,
        auto_wrap_classes=_units(wrap),
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
    )
    plan = _plan(MIXED_PRECISION_STEPS)
    precision = fixtures.Precision(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    model = fixtures.build(fixtures.CompositeModel, plan.seed, device, dim=WIDTH)
    oracle = fixtures.train_oracle(model, plan, world_size=world_size, device=device, precision=precision)
    problems = _compare_with_oracle(
        backend, spec, plan, oracle, MIXED_PRECISION_BOUNDS[param_dtype], rank=rank, device=device
    )
    reduced_in = dtype_name if reduce_dtype is None else "fp32"
    assert not problems, (
        f"rank {rank}: mixed-precision training ({dtype_name} compute, gradients reduced in {reduced_in}) "
        "differs from the single-process oracle:\n" + "\n".join(problems)
    )


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
        require(backend, Capability.NO_SYNC)
    spec = spec_with_mesh(backend, world_size, device, strategy=strategy, auto_wrap_classes=_units(wrap))
    plan = _plan(program.steps, program.micro_batches, program.zero_grad)
    model = fixtures.build(fixtures.CompositeModel, plan.seed, device, dim=WIDTH)
    oracle = fixtures.train_oracle(model, plan, world_size=world_size, device=device)
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
