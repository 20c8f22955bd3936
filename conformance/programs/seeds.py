"""The programs every generated run starts with: one per family of the fixed scenarios.

Hypothesis runs these first (its explicit examples), then the programs it draws. Each is the
smallest program that exercises one family's check, built only from what the backend admits, so
that the derandomized CI budget meets every family whatever the draws are: training against the
oracle, ZeRO's optimizer steps, mixed precision, gradient accumulation with and without the
no-sync switch and across steps, gradient clipping, activation checkpointing, deferred initialization, parameter groups,
tied weights, uneven data, eval mode, the forward-order check and its refusal of rank-divergent
orders, state dict and optimizer round trips, and each strategy's storage claim.
"""

from __future__ import annotations

import dataclasses

from conformance.programs.declared import Declared
from conformance.programs.draw import base_setups, tensor_parallel_possible
from conformance.programs.program import (
    Backward,
    ClipStep,
    EvalForward,
    ModelShape,
    Operation,
    OptimRoundTrip,
    Program,
    SaveLoad,
    SetMode,
    Setup,
    Step,
    SwapRoute,
    ZeroGrad,
    spec_requirements,
)
from conformance.protocol import Capability, ShardingStrategy

# Widths no world size divides: uneven shards in every seed program.
SHAPE = ModelShape(in_width=3, width=5, out_width=3, depth=2, buffers=True)
SEED = 7


TWO_D_SHAPE = ModelShape(in_width=3, width=4, out_width=3, depth=2)


def seed_programs(declared: Declared, world_size: int, *, two_d_only: bool = False) -> list[Program]:
    """The family programs ``declared`` admits at ``world_size``, simplest first (``two_d_only``:
    the 2-D ones alone, for a run whose world sizes lack one that splits into (dp, tp))."""
    setups = base_setups(declared, world_size)
    if not setups:
        return []
    programs: list[Program] = []

    def add(setup: Setup, *ops: Operation, shape: ModelShape = SHAPE, uneven_data: bool = False) -> None:
        program = Program(world_size, shape, setup, tuple(ops), SEED, uneven_data=uneven_data)
        needed = spec_requirements(setup) | program.requirements()
        if declared.admits(needed) and program not in programs:
            programs.append(program)

    def first(predicate: object = None, **fields: object) -> Setup | None:
        for setup in setups:
            candidate = Setup(**{**setup.__dict__, **fields})
            if (predicate is None or predicate(candidate)) and declared.admits(
                spec_requirements(candidate) | {Capability.for_form(candidate.form)}
            ):
                return candidate
        return None

    train = (ZeroGrad(), Backward(), Step(), ZeroGrad(), Backward(), Step())
    # 2-D: training, then sharded and full model state dicts round trips of the 2-D model.
    two_d = next((s for s in setups if tensor_parallel_possible(declared, s, world_size)), None)
    if two_d is not None:
        two_d = Setup(**{**two_d.__dict__, "tensor_parallel": True})
        for kind in ("sharded", "full"):
            add(two_d, *train[:3], SaveLoad(kind), *train[3:], shape=TWO_D_SHAPE)
    if two_d_only:
        return programs
    # Every strategy: SGD training against the oracle, then Adam steps (the storage claim of
    # optimizer state, ZeRO's partitioned step).
    for strategy in ShardingStrategy:
        setup = first(lambda s, strategy=strategy: s.strategy is strategy and s.unit_plan == "none")
        setup = setup or first(lambda s, strategy=strategy: s.strategy is strategy)
        if setup is not None:
            add(setup, *train)
            add(Setup(**{**setup.__dict__, "optimizer": "adam"}), *train)
    plain = first()
    if plain is None:
        return programs
    # Mixed precision, every low-precision dtype the backend has: SGD steps, so a gradient that
    # is off by a factor shows in the parameters and the next loss.
    for dtype in declared.low_precision_dtypes:
        setup = first(param_dtype=dtype)
        if setup is not None:
            add(setup, *train)
    # Gradient accumulation: micro-batches, the no-sync switch, and steps without zero_grad, each
    # a program of its own (a backend's known finding of one shape must not hide the others: a
    # DeepSpeed step zeroes gradients, which says nothing of how its micro-batches add up).
    add(plain, ZeroGrad(), Backward(micro_batches=2), Step())
    add(plain, ZeroGrad(), Backward(micro_batches=3, no_sync=True), Step())
    add(plain, ZeroGrad(), Backward(), Step(), Backward(), Step())
    # Gradient clipping (GRADIENT_CLIPPING): the total norm over every rank's pieces, the whole
    # model one unit and with units, SGD so that a wrongly scaled clip shows in the parameters.
    add(plain, ZeroGrad(), Backward(), ClipStep(), ZeroGrad(), Backward(), ClipStep())
    with_units = first(lambda s: s.unit_plan in ("auto", "leaves"))
    if with_units is not None:
        add(with_units, ZeroGrad(), Backward(), ClipStep())
    # Activation checkpointing: backward recomputes every block's forward (its hooks, a
    # backend's gather, run again), with the whole model one unit and with units; SGD steps, so
    # gradients reduced twice show in the parameters and the next loss.
    checkpointed = dataclasses.replace(SHAPE, checkpointed=True)
    add(plain, *train, shape=checkpointed)
    if with_units is not None:
        add(with_units, *train, shape=checkpointed)
    # Deferred initialization: the model built on the meta device and materialized by the backend
    # (shard_deferred), the whole model one unit and with units; SGD steps, so a module left
    # uninitialized shows in the first loss and in the parameters.
    deferred = dataclasses.replace(SHAPE, deferred_init=True)
    add(plain, *train, shape=deferred)
    if with_units is not None:
        add(with_units, *train, shape=deferred)
    # Parameter groups (PARAMETER_GROUPS): weight decay for weights, none for biases, SGD steps so
    # dropped groups show in the parameters; then a full optimizer round trip, which must keep them.
    grouped = first(param_groups=True)
    if grouped is not None:
        add(grouped, *train)
        add(Setup(**{**grouped.__dict__, "optimizer": "adam"}), *train[:3], OptimRoundTrip("full"), *train[3:])
    # Tied weights: block 1 shares block 0's weight (the whole model one unit), SGD steps, so a
    # tie broken by sharding shows in the parameters and the next loss.
    one_unit = first(lambda s: s.unit_plan == "none")
    if one_unit is not None:
        add(one_unit, *train, shape=dataclasses.replace(SHAPE, tied=True))
    # Uneven data: data rank d feeds LOCAL_BATCH + d samples; the gradients are still averaged over
    # the ranks (a backend weighting them by samples is off by each rank's share), then an eval
    # forward at the same sizes.
    if world_size >= 2:
        add(plain, *train, SetMode(False), EvalForward(), uneven_data=True)
    # Eval mode: its forwards differ from training ones.
    add(plain, ZeroGrad(), Backward(), Step(), SetMode(False), EvalForward())
    # The forward-order check: a later change of order warns; a first iteration whose order
    # differs between ranks is refused.
    ordered = first(lambda s: s.unit_plan in ("leaves", "auto"), check_exec_order=True)
    if ordered is not None:
        add(ordered, Backward(), SwapRoute(), Backward(), SetMode(False), EvalForward())
        if world_size >= 2:
            add(ordered, SwapRoute(odd_ranks_only=True), Backward())
    # State dicts: sharded, full and native round trips, the optimizer's, then more training.
    for kind in ("sharded", "full", "native"):
        add(plain, ZeroGrad(), Backward(), Step(), SaveLoad(kind), ZeroGrad(), Backward(), Step())
    adam = Setup(**{**plain.__dict__, "optimizer": "adam"})
    for kind in ("full", "sharded"):
        add(adam, ZeroGrad(), Backward(), Step(), OptimRoundTrip(kind), ZeroGrad(), Backward(), Step())
    return programs
