"""Hypothesis strategies for generated programs, drawing only what the backend declares.

Runs in the pytest process, where hypothesis draws, shrinks and keeps its database; the ranks
only run what is drawn. Every axis is drawn from the backend's :class:`Declared` capabilities and
admitted only where ``require_all`` would admit it (no unsupported combination), so a program
never skips. Choices are listed simplest first, which is where hypothesis shrinks to: one rank
pair, a narrow model, FULL_SHARD-like strategies first, fewer operations, plain options.

The operations are drawn as a small state machine (what may follow what), each kind's part of it
in its handler (``conformance.programs.operations``): backward only in training mode, a step only
after a backward since the last step, gradients read only while they exist, an optimizer round
trip only once the optimizer has state; and a first iteration whose order differs between ranks
only where the backend checks the order, as the only other operation (the program ends at the
refusal).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hypothesis import strategies as st

import fixtures
from conformance.programs.declared import Declared
from conformance.programs.operations import DRAW_ORDER, HANDLERS, TWO_D_DRAW_ORDER, DrawContext, DrawState, handler_for
from conformance.programs.program import (
    TENSOR_PARALLEL_DEGREE,
    UNIT_PLANS,
    Backward,
    ModelShape,
    Operation,
    Program,
    Setup,
    SwapRoute,
    spec_requirements,
)
from conformance.protocol import ApiForm, Capability, ShardingStrategy

MAX_OPERATIONS = 8
# Widths that no world size divides (3, 5, 7) beside ones that some do: uneven shards and
# padding are where sharding arithmetic goes wrong.
WIDTHS = (4, 3, 5, 8, 7, 6, 2)
STRATEGY_ORDER = (
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.NO_SHARD,
    ShardingStrategy.SHARD_OPTIM_STATE,
    ShardingStrategy.SHARD_GRAD_AND_OPTIM_STATE,
    ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.HYBRID_SHARD,
)


def hybrid_possible(world_size: int) -> bool:
    """HYBRID_SHARD needs two shard groups (a pool is one host: local world size = world size)."""
    return fixtures.hybrid_shard_group_size(world_size, world_size) is not None


def base_setups(declared: Declared, world_size: int) -> list[Setup]:
    """Every (strategy, form, unit plan, other strategy) the backend admits at this world size,
    simplest first."""
    strategies = [s for s in STRATEGY_ORDER if s in declared.strategies()]
    if not hybrid_possible(world_size):
        strategies = [s for s in strategies if s is not ShardingStrategy.HYBRID_SHARD]
    forms = [f for f in ApiForm if declared.has(Capability.for_form(f))]
    setups = []
    for strategy in strategies:
        for form in forms:
            for plan in UNIT_PLANS:
                others: list[ShardingStrategy | None] = [None]
                if plan == "mixed":
                    others = [
                        s
                        for s in strategies
                        if s is not strategy and ShardingStrategy.HYBRID_SHARD not in (s, strategy)
                    ]
                for other in others:
                    setup = Setup(strategy=strategy, form=form, unit_plan=plan, other_strategy=other)
                    if declared.admits(spec_requirements(setup) | {Capability.for_form(form)}):
                        setups.append(setup)
    return setups


def tensor_parallel_possible(declared: Declared, setup: Setup, world_size: int) -> bool:
    """Whether ``setup`` may be drawn 2-D: the backend declares TENSOR_PARALLEL with it, the world
    splits into (dp, tp=2) with dp >= 2, and its units are the blocks or none (a tensor-parallel
    linear nested as a unit of its own is left to test_2d's plans)."""
    if world_size < 2 * TENSOR_PARALLEL_DEGREE or world_size % TENSOR_PARALLEL_DEGREE:
        return False
    if setup.unit_plan not in ("none", "auto", "leaves") or setup.strategy is ShardingStrategy.HYBRID_SHARD:
        return False
    return _admitted(declared, Setup(**{**setup.__dict__, "tensor_parallel": True}))


def _admitted(declared: Declared, setup: Setup) -> bool:
    return declared.admits(spec_requirements(setup) | {Capability.for_form(setup.form)})


@st.composite
def setups(draw: st.DrawFn, declared: Declared, world_size: int) -> Setup:
    candidates = base_setups(declared, world_size)
    if not candidates:
        raise ValueError(
            f"{declared.name} admits no sharding setup at world size {world_size}: it declares no strategy "
            "with an API form (see its CAPABILITIES and UNSUPPORTED_COMBINATIONS)"
        )
    setup = draw(st.sampled_from(candidates))
    optimizer = draw(st.sampled_from(("sgd", "adam")))
    setup = Setup(**{**setup.__dict__, "optimizer": optimizer})
    if tensor_parallel_possible(declared, setup, world_size) and draw(st.booleans()):
        # 2-D programs keep the other axes plain: the 2-D scenarios' ground (test_2d).
        return Setup(**{**setup.__dict__, "tensor_parallel": True})
    # Each further axis: drawn only where the backend admits it with what is drawn so far.
    # Mixed precision with SGD only, as test_training_numerics has it: Adam's first steps move an
    # entry by the learning rate whatever its gradient's size, so an entry whose gradient is
    # low-precision rounding noise around zero moves by +-lr on one side and not the other
    # (measured: the reference engine, fp16, a 0.001 difference in one entry of 36), while a
    # gradient off by a factor is what Adam hides and SGD shows.
    if declared.low_precision_dtypes and setup.optimizer == "sgd":
        dtype = draw(st.sampled_from((None, *declared.low_precision_dtypes)))
        if dtype is not None:
            candidate = Setup(**{**setup.__dict__, "param_dtype": dtype})
            if _admitted(declared, candidate):
                setup = candidate
                if draw(st.booleans()):
                    candidate = Setup(**{**setup.__dict__, "reduce_fp32": True})
                    setup = candidate if _admitted(declared, candidate) else setup
    for name in ("offload_params", "check_exec_order"):
        if draw(st.booleans()):
            candidate = Setup(**{**setup.__dict__, name: True})
            setup = candidate if _admitted(declared, candidate) else setup
    if draw(st.booleans()):
        candidate = Setup(**{**setup.__dict__, "use_orig_params": False})
        setup = candidate if _admitted(declared, candidate) else setup
    if draw(st.integers(0, 3)) == 0:  # parameter groups, one program in four where admitted
        candidate = Setup(**{**setup.__dict__, "param_groups": True})
        setup = candidate if _admitted(declared, candidate) else setup
    return setup


@st.composite
def model_shapes(
    draw: st.DrawFn, frozen_allowed: bool, tensor_parallel: bool = False, tied_allowed: bool = False
) -> ModelShape:
    if tensor_parallel:
        # Column-wise then row-wise blocks 0 and 1: an even width, no per-feature buffer (a
        # column-wise block's output is this rank's half of the features).
        return ModelShape(
            in_width=draw(st.sampled_from(WIDTHS)),
            width=draw(st.sampled_from(tuple(w for w in WIDTHS if w % TENSOR_PARALLEL_DEGREE == 0))),
            out_width=draw(st.sampled_from(WIDTHS)),
            depth=draw(st.integers(2, 3)),
        )
    depth = draw(st.integers(1, 3))
    # Block 1 tied to block 0 (one program in four where the whole model is one unit).
    tied = tied_allowed and depth >= 2 and draw(st.integers(0, 3)) == 0
    frozen: tuple[int, ...] = ()
    if frozen_allowed and depth >= 2 and draw(st.booleans()):
        # Never every block: a model that trains nothing but its ends is still a model, but a
        # frozen block between trained ones is the case that matters (gradients flow through).
        # A tied pair stays trained (a frozen block beside it is block 2).
        first = 2 if tied else 0
        if first < depth:
            frozen = (draw(st.integers(first, depth - 1)),)
    return ModelShape(
        in_width=draw(st.sampled_from(WIDTHS)),
        width=draw(st.sampled_from(WIDTHS)),
        out_width=draw(st.sampled_from(WIDTHS)),
        depth=depth,
        buffers=draw(st.booleans()),
        frozen=frozen,
        tied=tied,
        # Recomputation changes no value, so every backend draws it; one in four programs.
        checkpointed=draw(st.integers(0, 3)) == 0,
    )


@st.composite
def operations(
    draw: st.DrawFn, declared: Declared, setup: Setup, shape: ModelShape, world_size: int
) -> tuple[Operation, ...]:
    """The program's operations: each drawn from what every kind's handler offers after the
    operations before it (``conformance.programs.operations``), in the kinds' draw order."""
    base = frozenset(spec_requirements(setup) | {Capability.for_form(setup.form)})
    two_d = setup.tensor_parallel
    order_checked = setup.check_exec_order and setup.unit_plan != "none" and shape.depth >= 2 and world_size >= 2
    if not two_d and order_checked and draw(st.integers(0, 9)) == 0:
        # The first iteration's misuse, a program of its own: it ends at the backend's refusal.
        return (SwapRoute(odd_ranks_only=True), Backward())
    context = DrawContext(declared, setup, shape, world_size, base, two_d=two_d)
    kinds = TWO_D_DRAW_ORDER if two_d else DRAW_ORDER
    state = DrawState()
    ops: list[Operation] = []
    for _ in range(draw(st.integers(1, MAX_OPERATIONS))):
        choices = [choice for kind in kinds for choice in HANDLERS[kind].choices(context, state)]
        op = draw(st.sampled_from(choices))
        ops.append(op)
        handler_for(op).advance(state, op)
    return tuple(ops)


@st.composite
def programs(draw: st.DrawFn, declared: Declared, world_sizes: Sequence[int]) -> Program:
    """A whole program for ``declared`` at one of ``world_sizes``."""
    world_size = draw(st.sampled_from(tuple(world_sizes)))
    setup = draw(setups(declared, world_size))
    shape = draw(
        model_shapes(
            frozen_allowed=setup.use_orig_params,
            tensor_parallel=setup.tensor_parallel,
            tied_allowed=setup.unit_plan == "none",
        )
    )
    ops = draw(operations(declared, setup, shape, world_size))
    seed = draw(st.integers(0, 2**16))
    # Uneven data (one program in four): float32 and 1-D only, since the low-precision bounds of
    # conformance.programs.tolerances were measured at LOCAL_BATCH samples per rank.
    uneven = (
        world_size >= 2 and setup.param_dtype is None and not setup.tensor_parallel and draw(st.integers(0, 3)) == 0
    )
    # Built on the meta device (one program in four; drawn last, so the rest of a draw is what
    # it was before the axis existed): not tied (to_empty unties) nor tensor-parallel.
    if not shape.tied and not setup.tensor_parallel and draw(st.integers(0, 3)) == 0:
        shape = dataclasses.replace(shape, deferred_init=True)
    return Program(world_size=world_size, model=shape, setup=setup, operations=ops, seed=seed, uneven_data=uneven)
