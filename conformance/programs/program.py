"""A generated program: a model, how it is sharded, and the operations run on it, as plain data.

Everything here is picklable and backend-neutral: the parent draws a :class:`Program`
(``conformance.programs.draw``), ships it to the ranks, and they run it
(``conformance.programs.run``) against the same program on the single-process oracle
(``conformance.programs.shadow``). :meth:`Program.lines` is the readable form a failure prints,
and :meth:`Program.requirements` what the backend must declare for the program to be drawn.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conformance.protocol import (
    ApiForm,
    Capability,
    Requirement,
    ShardingStrategy,
    SpecCondition,
    StateDictKind,
    unshard_capabilities,
)

UNIT_PLANS = ("none", "auto", "leaves", "nested", "mixed")
"""How the blocks become units: none (the whole model one unit: ZeRO, DDP), auto (every block by
class), leaves (every block by FQN), nested (block 0's linear inside block 0, then the others),
mixed (every block by FQN, block 0 under another strategy)."""

LOW_PRECISION_DTYPES = ("float16", "bfloat16")
TENSOR_PARALLEL_DEGREE = 2


@dataclass(frozen=True)
class ModelShape:
    """``inp`` (in_width -> width), ``depth`` square blocks (width -> width, each a linear, tanh,
    times a buffer when ``buffers``), ``out`` (width -> out_width). Widths are drawn to include
    sizes no world size divides. ``frozen`` lists blocks whose linear does not train. Blocks 0 and
    1 (depth >= 2) may swap places in the forward (:class:`SwapRoute`). ``checkpointed``: the
    model calls each block through ``torch.utils.checkpoint.checkpoint(block, h,
    use_reentrant=False)`` (activation checkpointing as Hugging Face models apply it), so every
    backward runs each block's forward again, its module hooks included. ``tied``: block 1's
    linear shares block 0's weight (depth >= 2; as a language model ties its embedding and output
    projection), whose gradient is then the sum of both uses'; the whole model is one unit
    (the libraries keep a shared parameter inside one unit). ``deferred_init``: every rank
    builds the model on the meta device and the backend materializes it with the program's
    values (``shard_deferred``: FSDP1's ``param_init_fn``, FSDP2's ``to_empty`` after
    ``fully_shard``, else materialized before sharding); never with ``tied`` (``to_empty`` gives
    each module a tensor of its own, untying them) or tensor parallelism."""

    in_width: int
    width: int
    out_width: int
    depth: int
    buffers: bool = False
    frozen: tuple[int, ...] = ()
    checkpointed: bool = False
    tied: bool = False
    deferred_init: bool = False

    def describe(self) -> str:
        text = f"Model(in={self.in_width}, width={self.width}, out={self.out_width}, blocks={self.depth}"
        if self.buffers:
            text += ", buffers"
        if self.frozen:
            text += f", frozen blocks {list(self.frozen)}"
        if self.tied:
            text += ", block 1's weight tied to block 0's"
        if self.checkpointed:
            text += ", blocks activation-checkpointed"
        if self.deferred_init:
            text += ", built on the meta device"
        return text + ")"


@dataclass(frozen=True)
class Setup:
    """How the model is sharded: the ShardingSpec fields, the API form and the optimizer."""

    strategy: ShardingStrategy
    form: ApiForm
    unit_plan: str = "none"
    other_strategy: ShardingStrategy | None = None
    """``mixed`` plan: block 0's strategy."""
    param_dtype: str | None = None
    reduce_fp32: bool = False
    offload_params: bool = False
    use_orig_params: bool = True
    check_exec_order: bool = False
    optimizer: str = "sgd"  # "sgd" or "adam"
    param_groups: bool = False
    """The optimizer in two parameter groups by name (``PARAMETER_GROUPS``): weights with weight
    decay, biases without (``conformance.programs.shadow.PARAMETER_GROUPS``)."""
    tensor_parallel: bool = False
    """2-D: blocks 0 and 1 tensor-parallel (column-wise, then row-wise) over the "tp" dimension of
    a (world size / 2, 2) mesh, the model then sharded over its "dp" dimension; ranks of one dp
    group feed the same batch."""

    def describe(self) -> str:
        parts = [f"{self.strategy.name}", f"{self.form.value} form", f"units: {self.unit_plan}"]
        if self.other_strategy is not None:
            parts.append(f"block 0 {self.other_strategy.name}")
        if self.param_dtype is not None:
            parts.append(f"param_dtype={self.param_dtype}" + (", reduce_dtype=float32" if self.reduce_fp32 else ""))
        if self.offload_params:
            parts.append("offload_params")
        if not self.use_orig_params:
            parts.append("flat parameters")
        if self.check_exec_order:
            parts.append("check_exec_order")
        if self.tensor_parallel:
            parts.append("tensor parallel blocks 0-1 over a (dp, tp=2) mesh")
        parts.append(self.optimizer.upper() if self.optimizer == "sgd" else "Adam")
        if self.param_groups:
            parts.append("parameter groups (weight decay, none for biases)")
        return ", ".join(parts)


# -- operations --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Backward:
    """``micro_batches`` forward + backward passes in training mode, each on a batch of its own;
    with ``no_sync`` the first ``micro_batches - 1`` inside the backend's no_gradient_sync."""

    micro_batches: int = 1
    no_sync: bool = False

    def describe(self) -> str:
        if self.micro_batches == 1:
            return "forward + backward"
        first = "the first" if self.micro_batches == 2 else f"the first {self.micro_batches - 1}"
        inside = f", {first} inside no_gradient_sync" if self.no_sync else ""
        return f"{self.micro_batches} micro-batches of forward + backward{inside}"

    def requirements(self) -> set[Requirement]:
        return {Capability.NO_SYNC} if self.no_sync else set()


@dataclass(frozen=True)
class ZeroGrad:
    set_to_none: bool = True

    def describe(self) -> str:
        return f"zero_grad(set_to_none={self.set_to_none})"

    def requirements(self) -> set[Requirement]:
        return set()


@dataclass(frozen=True)
class Step:
    def describe(self) -> str:
        return "optimizer step"

    def requirements(self) -> set[Requirement]:
        return set()


@dataclass(frozen=True)
class ClipStep:
    """Clip the gradients through the backend's ``clip_grad_norm`` to ``fraction`` times the
    oracle's total norm (below 1, so the clip always acts, whatever the gradients are), then an
    optimizer step. One operation, because a backend may clip inside its step (DeepSpeed): a clip
    means the step right after it."""

    fraction: float = 0.5

    def describe(self) -> str:
        return f"clip the gradients to {self.fraction:g} x their total norm (clip_grad_norm), then an optimizer step"

    def requirements(self) -> set[Requirement]:
        return {Capability.GRADIENT_CLIPPING}


@dataclass(frozen=True)
class SetMode:
    train: bool

    def describe(self) -> str:
        return "model.train()" if self.train else "model.eval()"

    def requirements(self) -> set[Requirement]:
        return set()


@dataclass(frozen=True)
class EvalForward:
    """A forward under ``torch.no_grad()`` (in whatever mode the model is in); its loss is checked."""

    def describe(self) -> str:
        return "forward under no_grad"

    def requirements(self) -> set[Requirement]:
        return set()


@dataclass(frozen=True)
class SwapRoute:
    """Blocks 0 and 1 swap places in the forward. ``odd_ranks_only``: only odd ranks swap, so the
    ranks disagree on the order (a misuse a backend with an execution-order check must refuse
    in the first iteration)."""

    odd_ranks_only: bool = False

    def describe(self) -> str:
        return "blocks 0 and 1 swap places in the forward" + (" on odd ranks only" if self.odd_ranks_only else "")

    def requirements(self) -> set[Requirement]:
        return set()


@dataclass(frozen=True)
class Unshard:
    """Enter ``unshard`` on the root with these options; inside, read the full parameters (and
    gradients with ``with_grads``), and with ``write`` (writeback only) add 0.01 to each."""

    writeback: bool = False
    rank0_only: bool = False
    offload_to_cpu: bool = False
    with_grads: bool = False
    write: bool = False

    def describe(self) -> str:
        options = ", ".join(
            f"{name}=True"
            for name in ("writeback", "rank0_only", "offload_to_cpu", "with_grads")
            if getattr(self, name)
        )
        action = "add 0.01 to every parameter" if self.write else "read the parameters"
        return f"unshard({options}): {action}"

    def requirements(self) -> set[Requirement]:
        return set(
            unshard_capabilities(
                writeback=self.writeback,
                rank0_only=self.rank0_only,
                offload_to_cpu=self.offload_to_cpu,
                with_grads=self.with_grads,
            )
        )


@dataclass(frozen=True)
class SaveLoad:
    """Save the model's state (``full`` / ``sharded`` state dict, or ``native`` checkpoint with
    the optimizer), shard a freshly built model (other values) the same way, load it there, and
    go on with the new model (a new optimizer unless native: optimizer state starts anew)."""

    kind: str  # "full", "sharded", "native"

    def describe(self) -> str:
        if self.kind == "native":
            return "save a native checkpoint, load it into a freshly sharded model and optimizer"
        return f"save the {self.kind} state dict, load it into a freshly sharded model (new optimizer)"

    def requirements(self) -> set[Requirement]:
        if self.kind == "native":
            return {Capability.NATIVE_CHECKPOINT}
        return {Capability.for_state_dict(StateDictKind(self.kind))}


@dataclass(frozen=True)
class OptimRoundTrip:
    """Save the model's and the optimizer's state dicts (``full`` / ``sharded``), load both into
    a freshly sharded model and its new optimizer, and go on with those (a resumed job)."""

    kind: str  # "full", "sharded"

    def describe(self) -> str:
        return f"model and optimizer state dicts ({self.kind}) into a freshly sharded model and optimizer"

    def requirements(self) -> set[Requirement]:
        return {Capability.OPTIM_STATE_DICT, Capability.for_state_dict(StateDictKind(self.kind))}


Operation = (
    Backward | ZeroGrad | Step | ClipStep | SetMode | EvalForward | SwapRoute | Unshard | SaveLoad | OptimRoundTrip
)


LOCAL_BATCH = 2
"""Samples each data rank feeds per forward (even data)."""


@dataclass(frozen=True)
class Program:
    """One generated example: run on ``world_size`` ranks with data seeded by ``seed``.
    ``uneven_data``: data rank d feeds ``LOCAL_BATCH + d`` samples per forward, not
    ``LOCAL_BATCH`` (the rank gradients are still averaged over the data ranks: the objective
    stays the mean of their losses)."""

    world_size: int
    model: ModelShape
    setup: Setup
    operations: tuple[Operation, ...] = field(default_factory=tuple)
    seed: int = 0
    uneven_data: bool = False

    def lines(self) -> list[str]:
        """The program as a user reads it (what a failure prints, numbered as findings cite ops)."""
        data = ", uneven data (data rank d feeds LOCAL_BATCH + d samples)" if self.uneven_data else ""
        lines = [
            f"world size {self.world_size}, data seed {self.seed}{data}",
            self.model.describe(),
            f"shard: {self.setup.describe()}",
        ]
        lines += [f"op {index}: {op.describe()}" for index, op in enumerate(self.operations)]
        return lines

    def describe(self) -> str:
        return "\n".join(self.lines())

    @property
    def data_parallel_size(self) -> int:
        """How many distinct batches a step sees: the world size, or its dp dimension under 2-D."""
        return self.world_size // TENSOR_PARALLEL_DEGREE if self.setup.tensor_parallel else self.world_size

    def data_rank(self, rank: int) -> int:
        """Whose batch ``rank`` feeds: its own, or its dp group's under 2-D (mesh ranks row-major)."""
        return rank // TENSOR_PARALLEL_DEGREE if self.setup.tensor_parallel else rank

    @property
    def extra_rows_per_rank(self) -> int:
        """How many more samples each data rank feeds than the one before it."""
        return 1 if self.uneven_data else 0

    def batch_size(self, data_rank: int) -> int:
        """The samples data rank ``data_rank`` feeds per forward."""
        return LOCAL_BATCH + data_rank * self.extra_rows_per_rank

    @property
    def divergent_order(self) -> bool:
        """The first iteration's misuse program: only odd ranks swap blocks 0 and 1, so the ranks
        disagree on the forward order (a backend that checks the order must refuse it)."""
        return any(isinstance(op, SwapRoute) and op.odd_ranks_only for op in self.operations)

    def unit_fqns(self) -> tuple[str, ...]:
        """The manual units of the plan, innermost first."""
        blocks = tuple(f"blocks.{index}" for index in range(self.model.depth))
        if self.setup.unit_plan in ("leaves", "mixed"):
            return blocks
        if self.setup.unit_plan == "nested":
            return ("blocks.0.linear", *blocks)
        return ()

    def requirements(self) -> set[Requirement]:
        """What the backend must support for this program, besides the spec's own (see
        :func:`spec_requirements`)."""
        needed: set[Requirement] = {Capability.for_form(self.setup.form)}
        for op in self.operations:
            needed |= op.requirements()
        return needed


def spec_requirements(setup: Setup) -> set[Requirement]:
    """The capabilities and spec conditions a ShardingSpec built from ``setup`` needs (what
    ``ShardingSpec.feature_capabilities`` and ``conditions`` give, without building a mesh)."""
    strategies = {setup.strategy, *([setup.other_strategy] if setup.other_strategy else [])}
    needed: set[Requirement] = {Capability.for_strategy(s) for s in strategies}
    if setup.unit_plan == "auto":
        needed.add(Capability.AUTO_WRAP)
    if setup.unit_plan != "none":
        needed.add(Capability.UNITS)
    if len(strategies) > 1:
        needed.add(Capability.MIXED_STRATEGIES)
    if setup.param_dtype is not None:
        needed.add(Capability.MIXED_PRECISION)
        if setup.reduce_fp32:
            needed.add(Capability.REDUCE_DTYPE)
    else:
        needed.add(SpecCondition.FULL_PRECISION)
    if setup.offload_params:
        needed.add(Capability.CPU_OFFLOAD)
    else:
        needed.add(SpecCondition.PARAMETERS_ON_DEVICE)
    if setup.use_orig_params:
        needed.add(SpecCondition.ORIGINAL_PARAMETERS)
    else:
        needed.add(Capability.FLAT_PARAMETERS)
    if setup.check_exec_order:
        needed.add(Capability.EXEC_ORDER_CHECK)
    if setup.tensor_parallel:
        needed.add(Capability.TENSOR_PARALLEL)
    if setup.param_groups:
        needed.add(Capability.PARAMETER_GROUPS)
    needed.add(SpecCondition.SHARDED_ROOT)
    return needed
