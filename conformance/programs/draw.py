"""Hypothesis strategies for generated programs, drawing only what the backend declares.

Runs in the pytest process, where hypothesis draws, shrinks and keeps its database; the ranks
only run what is drawn. Every axis is drawn from the backend's :class:`Declared` capabilities and
admitted only where ``require_all`` would admit it (no unsupported combination), so a program
never skips. Choices are listed simplest first, which is where hypothesis shrinks to: one rank
pair, a narrow model, FULL_SHARD-like strategies first, fewer operations, plain options.

The operations are drawn as a small state machine (what may follow what): backward only in
training mode, a step only after a backward since the last step, gradients read only while they
exist, an optimizer round trip only once the optimizer has state, and a first iteration whose
order differs between ranks only where the backend checks the order, as the only other
operation (the program ends at the refusal).
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

import fixtures
from conformance.programs.declared import Declared
from conformance.programs.program import (
    TENSOR_PARALLEL_DEGREE,
    UNIT_PLANS,
    Backward,
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
    Unshard,
    ZeroGrad,
    spec_requirements,
)
from conformance.protocol import ApiForm, Capability, Holding, Phase, Requirement, ShardingStrategy, storage_claim

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
    return setup


@st.composite
def model_shapes(draw: st.DrawFn, frozen_allowed: bool, tensor_parallel: bool = False) -> ModelShape:
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
    frozen: tuple[int, ...] = ()
    if frozen_allowed and depth >= 2 and draw(st.booleans()):
        # Never every block: a model that trains nothing but its ends is still a model, but a
        # frozen block between trained ones is the case that matters (gradients flow through).
        frozen = (draw(st.integers(0, depth - 1)),)
    return ModelShape(
        in_width=draw(st.sampled_from(WIDTHS)),
        width=draw(st.sampled_from(WIDTHS)),
        out_width=draw(st.sampled_from(WIDTHS)),
        depth=depth,
        buffers=draw(st.booleans()),
        frozen=frozen,
    )


class _ProgramState:
    """What the operations drawn so far leave behind: what may come next."""

    def __init__(self) -> None:
        self.training = True
        self.backward_since_step = False
        self.grads_exist = False
        self.stepped = False


def _unshard_options(declared: Declared, setup: Setup, base: set[Requirement], world_size: int) -> list[Unshard]:
    if setup.param_dtype is not None:
        return []  # what unshard shows under mixed precision is a backend fact of its own
    # Units whose parameters are whole on every rank at rest: NO_SHARD and ZeRO-1/2, or
    # HYBRID_SHARD with shard groups of one rank (a world of 2 on one host: a (2, 1) mesh).
    strategies = {s for s in (setup.strategy, setup.other_strategy) if s is not None}
    unsharded_units = any(storage_claim(s).parameters[Phase.AT_REST] is Holding.WHOLE for s in strategies) or (
        ShardingStrategy.HYBRID_SHARD in strategies and fixtures.hybrid_shard_group_size(world_size, world_size) == 1
    )
    options = []
    for writeback in (False, True):
        for rank0_only in (False, True):
            for offload_to_cpu in (False, True):
                for with_grads in (False, True):
                    if writeback and rank0_only:
                        continue  # a misuse the backends refuse (Misuse.UNSHARD_RANK0_ONLY_WITH_WRITEBACK)
                    if with_grads and (setup.offload_params or offload_to_cpu):
                        continue  # torch FSDP1 gathers offloaded gradients into device buffers only
                    if offload_to_cpu and unsharded_units:
                        continue  # a misuse the backends refuse (Misuse.UNSHARD_OFFLOAD_TO_CPU_NO_SHARD)
                    for write in (False, True) if writeback else (False,):
                        op = Unshard(writeback, rank0_only, offload_to_cpu, with_grads, write)
                        if declared.admits(base | op.requirements()):
                            options.append(op)
    return options


@st.composite
def operations(
    draw: st.DrawFn, declared: Declared, setup: Setup, shape: ModelShape, world_size: int
) -> tuple[Operation, ...]:
    base = spec_requirements(setup) | {Capability.for_form(setup.form)}
    if setup.tensor_parallel:
        return draw(_two_d_operations(declared, base))
    order_checked = setup.check_exec_order and setup.unit_plan != "none" and shape.depth >= 2 and world_size >= 2
    if order_checked and draw(st.integers(0, 9)) == 0:
        return (SwapRoute(odd_ranks_only=True), Backward())
    unshards = _unshard_options(declared, setup, base, world_size)
    saves = [
        SaveLoad(kind)
        for kind in ("full", "sharded", "native")
        if declared.admits(base | SaveLoad(kind).requirements())
    ]
    optim_trips = [
        OptimRoundTrip(kind)
        for kind in ("full", "sharded")
        if declared.admits(base | OptimRoundTrip(kind).requirements())
    ]
    micro_batches = [1, 2, 3]
    state = _ProgramState()
    ops: list[Operation] = []
    for _ in range(draw(st.integers(1, MAX_OPERATIONS))):
        choices: list[Operation] = []
        if state.training:
            choices += [Backward(k) for k in micro_batches]
            if declared.has(Capability.NO_SYNC) and declared.admits(base | {Capability.NO_SYNC}):
                choices += [Backward(k, no_sync=True) for k in micro_batches[1:]]
        if state.backward_since_step:
            choices.append(Step())
        choices.append(ZeroGrad(True))
        if declared.zero_grad_keeps_zeros:
            choices.append(ZeroGrad(False))
        choices.append(SetMode(not state.training))
        if not state.training:
            choices.append(EvalForward())
        if shape.depth >= 2:
            choices.append(SwapRoute())
        choices += [u for u in unshards if not u.with_grads or state.grads_exist]
        choices += saves
        if state.stepped:
            choices += optim_trips
        op = draw(st.sampled_from(choices))
        ops.append(op)
        if isinstance(op, Backward):
            state.backward_since_step = state.grads_exist = True
        elif isinstance(op, Step):
            state.backward_since_step = False
            state.stepped = True
        elif isinstance(op, ZeroGrad) and op.set_to_none:
            # No gradient left to step with: a step needs a backward first again.
            state.grads_exist = state.backward_since_step = False
        elif isinstance(op, SetMode):
            state.training = op.train
        elif isinstance(op, SaveLoad):
            state.grads_exist = state.backward_since_step = False
            if op.kind != "native":
                state.stepped = False
        elif isinstance(op, OptimRoundTrip):
            state.grads_exist = state.backward_since_step = False
    return tuple(ops)


@st.composite
def _two_d_operations(draw: st.DrawFn, declared: Declared, base: set[Requirement]) -> tuple[Operation, ...]:
    """Training, eval forwards and model state dict round trips of a 2-D program."""
    saves = [SaveLoad(kind) for kind in ("full", "sharded") if declared.admits(base | SaveLoad(kind).requirements())]
    state = _ProgramState()
    ops: list[Operation] = []
    for _ in range(draw(st.integers(1, MAX_OPERATIONS))):
        choices: list[Operation] = [Backward(k) for k in (1, 2)] if state.training else [EvalForward()]
        if state.backward_since_step:
            choices.append(Step())
        choices += [ZeroGrad(True), SetMode(not state.training), *saves]
        op = draw(st.sampled_from(choices))
        ops.append(op)
        if isinstance(op, Backward):
            state.backward_since_step = True
        elif isinstance(op, Step) or (isinstance(op, ZeroGrad) and op.set_to_none) or isinstance(op, SaveLoad):
            state.backward_since_step = False
        elif isinstance(op, SetMode):
            state.training = op.train
    return tuple(ops)


@st.composite
def programs(draw: st.DrawFn, declared: Declared, world_sizes: Sequence[int]) -> Program:
    """A whole program for ``declared`` at one of ``world_sizes``."""
    world_size = draw(st.sampled_from(tuple(world_sizes)))
    setup = draw(setups(declared, world_size))
    shape = draw(model_shapes(frozen_allowed=setup.use_orig_params, tensor_parallel=setup.tensor_parallel))
    ops = draw(operations(declared, setup, shape, world_size))
    seed = draw(st.integers(0, 2**16))
    return Program(world_size=world_size, model=shape, setup=setup, operations=ops, seed=seed)
