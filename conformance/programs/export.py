"""``--export-repro DIR``: a failing generated program as a standalone torchrun script.

A finding is only useful upstream if the maintainers can run it without this suite. For the
torch backends (FSDP1, FSDP2, DDP / ZeroRedundancyOptimizer) :func:`export_repro` writes the
program as one script that imports only torch and the standard library: the generated model, the
per-rank batches and the single-process oracle written out inline (the same values as
``conformance.programs.model``, ``fixtures.data`` and ``conformance.programs.shadow``), the
sharding done with the native calls the suite's adapter makes for the program's setup, every
operation as native calls, and after each operation the checks ``conformance.programs.run``
makes, with the bounds of ``conformance.programs.tolerances``. It prints each mismatch as
``rank R, op I (<operation>): <what differs>`` and exits 1, or prints ``OK: ...`` and exits 0; an
operation that raises prints ``rank R, op I (<operation>): raised <Type>: <message>`` and the
error propagates (a non-zero exit, with its traceback), as a backend error ends the program there.
2-D programs (``Setup.tensor_parallel``) are written for FSDP1 and FSDP2: the (dp, tp) mesh, the
tensor-parallel plan applied before sharding over its dp dimension, and each dp group's ranks
feeding that group's batch, as ``run`` does it.

The script is assembled from one small template per concern (header, imports, constants, model,
data, oracle, sharding, checks, operations, main), and each template emits only what the program
uses, so the script reads like something a user wrote for the bug report. Two checks of the
suite are not exported, as they read backend internals no upstream report should depend on:
the storage claim (what each rank holds of each tensor) and the cross-rank collective trace.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch

from conformance.programs.program import (
    TENSOR_PARALLEL_DEGREE,
    Backward,
    EvalForward,
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
)
from conformance.programs.shadow import ADAM_LR, EVAL_ITERATIONS, FRESH_SEED_OFFSET, LOCAL_BATCH, SGD_LR
from conformance.programs.tolerances import bounds_for
from conformance.protocol import ApiForm, ShardingStrategy
from fixtures.meshes import HYBRID_DIM_NAMES, hybrid_shard_group_size

FSDP1 = "torch-fsdp1"
FSDP2 = "torch-fsdp2"
ZERO = "torch-zero"
EXPORTABLE_BACKENDS = (FSDP1, FSDP2, ZERO)
ORDER_WARNING = "Forward order differs from that of the first iteration"
"""FSDP1's later-iteration warning (``conformance.programs.run`` checks the same text)."""
_TWO_D_MESH_WORDS = "\n    2-D: every unit over `mesh`, the dp dimension of the (dp, tp) mesh."


def script_name(backend_name: str) -> str:
    """The file a backend's repro is written to (one per backend: each export overwrites it, so
    while hypothesis shrinks, the last one written is the minimal program)."""
    return f"{backend_name}-generated-repro.py"


def export_repro(backend_name: str, program: Program, directory: str) -> str:
    """Write ``program`` as a standalone torchrun script for ``backend_name`` into ``directory``
    and return the line a failure report adds; for a backend that is not torch's own, write
    nothing and return a line that says why."""
    if backend_name not in EXPORTABLE_BACKENDS:
        return (
            f"standalone repro: none written for {backend_name}: --export-repro writes native torch scripts "
            f"for {', '.join(EXPORTABLE_BACKENDS)} only, and {backend_name}'s library is not torch's own; "
            "the REPRO line above replays the program through the suite"
        )
    reason = _no_native_form(backend_name, program)
    if reason is not None:
        return f"standalone repro: none written for {backend_name}: {reason}; the REPRO line above replays it"
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    path = target / script_name(backend_name)
    path.write_text(repro_script(backend_name, program))
    world_size = program.world_size
    return (
        f"standalone repro: torchrun --nproc-per-node {world_size} {path} "
        f"(torch only; CPU with gloo, or CUDA with NCCL when {world_size} GPUs are visible)"
    )


def repro_script(backend_name: str, program: Program) -> str:
    """The script's text (see the module docstring)."""
    if backend_name not in EXPORTABLE_BACKENDS:
        raise ValueError(
            f"no standalone script for backend {backend_name!r}: choose one of {', '.join(EXPORTABLE_BACKENDS)}"
        )
    reason = _no_native_form(backend_name, program)
    if reason is not None:
        raise ValueError(f"no standalone script for this program on {backend_name}: {reason}")
    uses = _Uses.of(backend_name, program)
    sections = [
        _header(uses),
        _imports(uses),
        _constants(uses),
        _model(uses),
        _data(uses),
        _oracle(uses),
        _sharding(uses),
        _checks(uses),
        _run_class(uses),
        _main(uses),
    ]
    header, imports, *definitions = (section.strip("\n") for section in sections)
    return header + "\n\n" + imports + "\n\n" + "\n\n\n".join(definitions) + "\n" + _ENTRY_POINT


def _no_native_form(backend_name: str, program: Program) -> str | None:
    """Why ``program`` has no native torch form on ``backend_name`` (None when it has one): the
    setups the suite's adapter itself refuses, where a script would only restate the adapter's
    error, not a torch call."""
    setup = program.setup
    if setup.tensor_parallel and backend_name == ZERO:
        return (
            "torch-zero does not declare TENSOR_PARALLEL (DistributedDataParallel refuses DTensor "
            "parameters), so a 2-D program has no torch-zero form"
        )
    no_shard = ShardingStrategy.NO_SHARD in (setup.strategy, setup.other_strategy)
    if setup.tensor_parallel and backend_name == FSDP2 and no_shard:
        return (
            "the torch-fsdp2 adapter shards NO_SHARD units on a replicate mesh of its own and refuses a "
            "given mesh (ValueError), so a 2-D NO_SHARD program stops in the adapter, before any torch call"
        )
    return None


# -- what the program uses -------------------------------------------------------------------
@dataclass(frozen=True)
class _Uses:
    """Everything the templates branch on, read once from the backend and the program."""

    backend: str
    program: Program
    ops: tuple[Operation, ...]

    @classmethod
    def of(cls, backend: str, program: Program) -> _Uses:
        return cls(backend=backend, program=program, ops=program.operations)

    def has(self, kind: type) -> bool:
        return any(isinstance(op, kind) for op in self.ops)

    def all_of(self, kind: type) -> list:
        return [op for op in self.ops if isinstance(op, kind)]

    @property
    def setup(self) -> Setup:
        return self.program.setup

    @property
    def strategies(self) -> set[ShardingStrategy]:
        return {self.setup.strategy, *([self.setup.other_strategy] if self.setup.other_strategy else [])}

    @property
    def mixed_precision(self) -> bool:
        return self.setup.param_dtype is not None

    @property
    def tensor_parallel(self) -> bool:
        """2-D: blocks 0 and 1 tensor-parallel over the "tp" dimension of a (dp, tp) mesh, the model
        sharded over "dp"; the ranks of one dp group feed the same batch."""
        return self.setup.tensor_parallel

    @property
    def data_ranks(self) -> str:
        """The script's name for the number of distinct batches a pass sees."""
        return "DP_SIZE" if self.tensor_parallel else "WORLD_SIZE"

    @property
    def divergent_route(self) -> bool:
        """The misuse program: only odd ranks swap, and the first iteration must be refused."""
        return any(isinstance(op, SwapRoute) and op.odd_ranks_only for op in self.ops)

    @property
    def swaps(self) -> bool:
        return self.has(SwapRoute)

    @property
    def no_sync(self) -> bool:
        return any(isinstance(op, Backward) and op.no_sync for op in self.ops)

    @property
    def order_checked(self) -> bool:
        """Whether forward-order warnings are checked (FSDP1 with check_exec_order, not the misuse)."""
        return self.setup.check_exec_order and not self.divergent_route

    @property
    def route_can_differ(self) -> bool:
        """Whether a training forward may run in another order than the first (then one warning is
        due), as ``run`` decides it: units below the root, two blocks to swap, and a swap."""
        return self.setup.unit_plan != "none" and self.program.model.depth >= 2 and self.swaps

    @property
    def grads_checked(self) -> bool:
        """Whether the gradients are compared after each backward: where the backend shows them
        (``UNSHARD_WITH_GRADS``) in full precision on the device, and not 2-D, as ``run`` checks
        them. torch-fsdp1 declares {UNSHARD_WITH_GRADS, FLAT_PARAMETERS} unsupported (its
        summon_full_params refuses with_grads with flat parameters), so only with use_orig_params
        there."""
        if self.tensor_parallel:
            return False
        if self.backend == ZERO:
            return True
        if self.backend != FSDP1:
            return False
        return not self.mixed_precision and not self.setup.offload_params and self.setup.use_orig_params

    @property
    def reads_grads(self) -> bool:
        """Whether the script compares gradients anywhere (after backward, or inside an unshard)."""
        return self.grads_checked or self.unshard_reads_grads

    @property
    def unshard_reads_grads(self) -> bool:
        return any(isinstance(op, Unshard) and op.with_grads for op in self.ops)

    @property
    def shows(self) -> bool:
        """Whether the run reads the sharded model's named parameters (unshard, gradient checks)."""
        return self.has(Unshard) or self.grads_checked

    @property
    def save_kinds(self) -> set[str]:
        return {op.kind for op in self.ops if isinstance(op, SaveLoad)}

    @property
    def optim_kinds(self) -> set[str]:
        return {op.kind for op in self.ops if isinstance(op, OptimRoundTrip)}

    @property
    def native(self) -> bool:
        return "native" in self.save_kinds

    @property
    def rebuilds(self) -> bool:
        """Whether the program goes on with a freshly built and sharded model (a load of any kind)."""
        return bool(self.save_kinds or self.optim_kinds)

    @property
    def sharded_state_dicts(self) -> bool:
        """Whether the script needs the sharded model state dict (a sharded save or optimizer round
        trip, a native checkpoint)."""
        return bool((self.save_kinds | self.optim_kinds) & {"sharded", "native"})

    @property
    def sharded_optimizer_state(self) -> bool:
        return "sharded" in self.optim_kinds or self.native

    @property
    def zero_optimizer(self) -> bool:
        return self.backend == ZERO and self.setup.strategy is ShardingStrategy.SHARD_OPTIM_STATE

    @property
    def mesh(self) -> str | None:
        """The mesh the units need besides the default group: "2-D" (a (dp, tp) mesh), "hybrid" or
        "replicate" (FSDP2 NO_SHARD)."""
        if self.tensor_parallel:
            return "2-D"
        if ShardingStrategy.HYBRID_SHARD in self.strategies:
            return "hybrid"
        if self.backend == FSDP2 and ShardingStrategy.NO_SHARD in self.strategies:
            return "replicate"
        return None

    @property
    def mode_changes(self) -> bool:
        return self.has(SetMode)

    @property
    def optimizer_class(self) -> str:
        return "torch.optim.Adam" if self.setup.optimizer == "adam" else "torch.optim.SGD"


def _block(text: str, **values: object) -> str:
    """A dedented template with ``<<name>>`` replaced (no braces to escape in the code)."""
    text = textwrap.dedent(text)
    for name, value in values.items():
        text = text.replace(f"<<{name}>>", str(value))
    return text.strip("\n") + "\n"


def _indent(lines: list[str], levels: int) -> str:
    pad = "    " * levels
    return "\n".join(pad + line if line else "" for line in lines)


# -- header ------------------------------------------------------------------------------------
def _backend_words(uses: _Uses) -> str:
    tensor_parallel = (
        ", after torch.distributed.tensor.parallel.parallelize_module (2-D: blocks 0 and 1 tensor-parallel "
        "over the tp dimension of a dp-by-tp mesh, the model sharded over its dp dimension)"
        if uses.tensor_parallel
        else ""
    )
    if uses.backend == FSDP1:
        return "torch.distributed.fsdp.FullyShardedDataParallel (FSDP1, the wrapper form)" + tensor_parallel
    if uses.backend == FSDP2:
        return "torch.distributed.fsdp.fully_shard (FSDP2)" + tensor_parallel
    replicated = (
        "torch.nn.parallel.DistributedDataParallel"
        if uses.setup.form is ApiForm.WRAPPER
        else "torch.distributed._composable.replicate"
    )
    return replicated + (" with torch.distributed.optim.ZeroRedundancyOptimizer" if uses.zero_optimizer else "")


def _header(uses: _Uses) -> str:
    program = uses.program
    name = script_name(uses.backend)
    checked = ["each forward's loss", "the full parameters and buffers after every step, load and write"]
    if uses.grads_checked:
        checked.append("the full gradients after every backward")
    if uses.has(Unshard):
        checked.append("what unshard shows")
    if uses.setup.check_exec_order:
        checked.append("FSDP1's forward-order check")
    if "sharded" in uses.save_kinds:
        checked.append("the layout of a saved sharded state dict")
    data = [
        "one unsharded float32 model on CPU fed every rank's batch (data parallelism over N ranks",
        "optimises the mean of the N rank losses). After each operation it compares",
    ]
    if uses.tensor_parallel:
        data = [
            "one unsharded float32 model on CPU fed every data rank's batch (the ranks of one dp group",
            "feed the same batch, so data parallelism is over the DP_SIZE dp groups and optimises the mean",
            "of their losses). After each operation it compares",
        ]
    lines = [
        f"Standalone repro of a generated conformance program on {uses.backend}:",
        *textwrap.wrap(f"{_backend_words(uses)}.", width=92),
        "",
        "The program:",
        *(
            wrapped
            for line in program.lines()
            for wrapped in textwrap.wrap(line, 112, initial_indent="  ", subsequent_indent="    ")
        ),
        "",
        f"Generated with torch {torch.__version__} by the conformance suite's --export-repro; it needs",
        "only torch. Run it with:",
        f"  torchrun --nproc-per-node {program.world_size} {name}",
        f"It runs on CPU with gloo, or on CUDA with NCCL (one GPU per rank) when {program.world_size} GPUs",
        "are visible.",
        "",
        "Every rank runs the program on the sharded model and on a single-process oracle beside it:",
        *data,
        *textwrap.wrap(", ".join(checked) + ".", width=92),
        'Each mismatch prints as "rank R, op I (<operation>): <what differs>" and makes the exit',
        'status 1; an operation that raises prints "rank R, op I (<operation>): raised <error>" and',
        'ends the run with the traceback; otherwise rank 0 prints "OK: the program matches the',
        'single-process oracle".',
    ]
    return "\n".join(f"# {line}".rstrip() for line in lines)


# -- imports -----------------------------------------------------------------------------------
def _imports(uses: _Uses) -> str:
    stdlib = {"contextlib", "math", "os", "sys"}  # contextlib: Run.op names the operation that raised
    if uses.mixed_precision or uses.optim_kinds:
        stdlib.add("copy")
    if uses.order_checked and (uses.has(Backward) or uses.has(EvalForward)):
        stdlib.add("warnings")
    if uses.native:
        stdlib |= {"shutil", "tempfile"}
    straight = sorted(stdlib)
    torch_straight = ["torch", "torch.distributed as dist", "torch.nn as nn"]
    if uses.native:
        torch_straight.append("torch.distributed.checkpoint as dcp")
    froms: dict[str, set[str]] = {}

    def need(module: str, *names: str) -> None:
        froms.setdefault(module, set()).update(names)

    if uses.mesh is not None:
        need("torch.distributed.device_mesh", "DeviceMesh", "init_device_mesh")
    if "sharded" in uses.save_kinds:
        need("torch.distributed.tensor", "DTensor", "Shard")
    if uses.tensor_parallel:
        need("torch.distributed.tensor", "DTensor")
        need("torch.distributed.tensor.parallel", "ColwiseParallel", "RowwiseParallel", "parallelize_module")
    if uses.backend == FSDP1:
        need("torch.distributed.fsdp", "FullStateDictConfig", "FullyShardedDataParallel", "ShardingStrategy")
        need("torch.distributed.fsdp", "StateDictType")
        if uses.sharded_state_dicts:
            need("torch.distributed.fsdp", "ShardedStateDictConfig")
        if uses.mixed_precision:
            need("torch.distributed.fsdp", "MixedPrecision")
        if uses.setup.offload_params:
            need("torch.distributed.fsdp", "CPUOffload")
        if uses.setup.unit_plan == "auto":
            need("torch.distributed.fsdp.wrap", "ModuleWrapPolicy")
    if uses.backend == FSDP2:
        need("torch.distributed.fsdp", "fully_shard")
        need("torch.distributed.checkpoint.state_dict", "StateDictOptions", "get_model_state_dict")
        if uses.rebuilds:
            need("torch.distributed.checkpoint.state_dict", "set_model_state_dict")
        if uses.mixed_precision:
            need("torch.distributed.fsdp", "MixedPrecisionPolicy")
        if uses.setup.offload_params:
            need("torch.distributed.fsdp", "CPUOffloadPolicy")
        if uses.has(Unshard):
            need("torch.distributed.fsdp", "FSDPModule")
    if uses.backend in (FSDP1, FSDP2) and (uses.optim_kinds or uses.native):
        need(
            "torch.distributed.checkpoint.state_dict",
            "StateDictOptions",
            "get_optimizer_state_dict",
            "set_optimizer_state_dict",
        )
    if uses.backend == ZERO:
        if uses.setup.form is ApiForm.WRAPPER:
            need("torch.nn.parallel", "DistributedDataParallel")
        else:
            need("torch.distributed._composable", "replicate")
        if uses.zero_optimizer:
            need("torch.distributed.optim", "ZeroRedundancyOptimizer")
    lines = [f"import {module}" for module in straight]
    lines.append("")
    lines += [f"import {module}" for module in sorted(torch_straight, key=lambda m: m.split(" ")[0])]
    for module in sorted(froms):
        names = sorted(froms[module], key=_isort_key)
        line = f"from {module} import {', '.join(names)}"
        if len(line) > 100:
            line = f"from {module} import (\n" + "".join(f"    {name},\n" for name in names) + ")"
        lines.append(line)
    return "\n".join(lines)


def _isort_key(name: str) -> tuple[int, str]:
    """Ruff's isort order of imported names: constants, then classes, then the rest."""
    if name.isupper() and len(name) > 1:
        return (0, name)
    if name[0].isupper():
        return (1, name)
    return (2, name)


def _ddp_wrapper(uses: _Uses) -> bool:
    return uses.backend == ZERO and uses.setup.form is ApiForm.WRAPPER


# -- constants ---------------------------------------------------------------------------------
def _constants(uses: _Uses) -> str:
    program, shape = uses.program, uses.program.model
    lr = ADAM_LR if uses.setup.optimizer == "adam" else SGD_LR
    lines = [
        f"WORLD_SIZE = {program.world_size}",
        f"SEED = {program.seed}  # the program's seed: the initial values and every batch derive from it",
        f"IN_WIDTH, WIDTH, OUT_WIDTH, DEPTH = {shape.in_width}, {shape.width}, {shape.out_width}, {shape.depth}",
        f"LOCAL_BATCH = {LOCAL_BATCH}  # samples per rank in each forward",
        "# The learning rates of the sharded model's optimizer and of the oracle's, apart: the same value.",
        f"SHARDED_LR = {lr!r}",
        f"ORACLE_LR = {lr!r}",
    ]
    if uses.has(EvalForward):
        lines.append(f"EVAL_ITERATIONS = {EVAL_ITERATIONS:_}  # eval forwards read data from here on, apart")
    if uses.rebuilds:
        lines.append(f"FRESH_SEED_OFFSET = {FRESH_SEED_OFFSET}  # a model built to load into starts from other values")
    if uses.tensor_parallel:
        lines += [
            f'TP_SIZE = {TENSOR_PARALLEL_DEGREE}  # 2-D: the "tp" dimension of the (dp, tp) mesh',
            "DP_SIZE = WORLD_SIZE // TP_SIZE  # the data ranks: the ranks of one dp group feed the same batch",
        ]
    if uses.mixed_precision:
        reduction = "float32" if uses.setup.reduce_fp32 else uses.setup.param_dtype
        lines += [
            f"PARAM_DTYPE = torch.{uses.setup.param_dtype}  # mixed precision: forward and backward in this dtype",
            f"REDUCTION_DTYPE = torch.{reduction}  # the rank gradients are averaged in this dtype",
        ]
    if uses.mesh == "hybrid":
        shard = hybrid_shard_group_size(program.world_size, program.world_size)
        lines.append(
            f"HYBRID_MESH_SHAPE = ({program.world_size // shard}, {shard})  # (replica groups, ranks per shard group)"
        )
    bounds = bounds_for(uses.setup.param_dtype)
    compute = uses.setup.param_dtype or "float32"
    lines += [
        f"# How far the sharded run may be from the oracle (the suite's bounds for {compute} compute):",
        "# |actual - expected| <= atol + rtol * |expected|, where atol grows by scaled_atol * max|expected|.",
        f"LOSS_RTOL, LOSS_ATOL = {bounds.loss_rtol!r}, {bounds.loss_atol!r}",
        f"PARAM_TOLERANCE = {_tolerance(bounds.params)}  # rtol, atol, scaled_atol",
    ]
    if uses.reads_grads:
        lines.append(f"GRAD_TOLERANCE = {_tolerance(bounds.grads)}")
        if uses.program.model.frozen:
            frozen = sorted(
                f"blocks.{index}.linear.{name}" for index in uses.program.model.frozen for name in ("weight", "bias")
            )
            names = ", ".join(f'"{name}"' for name in frozen)
            lines.append(f"FROZEN = {{{names}}}  # requires_grad=False: no gradient")
    if uses.order_checked:
        lines.append(f'ORDER_WARNING = "{ORDER_WARNING}"')
    lines += [
        "",
        "# One GPU per rank where there are enough of them, else CPU.",
        "USE_CUDA = torch.cuda.is_available() and torch.cuda.device_count() >= WORLD_SIZE",
        'DEVICE = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if USE_CUDA else torch.device("cpu")',
    ]
    return "\n".join(lines)


def _tolerance(tolerance: object) -> str:
    return f"({tolerance.rtol!r}, {tolerance.atol!r}, {tolerance.scaled_atol!r})"  # type: ignore[attr-defined]


# -- model -------------------------------------------------------------------------------------
def _model(uses: _Uses) -> str:
    shape = uses.program.model
    if shape.buffers:
        block_init = [
            "self.linear = nn.Linear(WIDTH, WIDTH)",
            'self.register_buffer("scale", torch.ones(WIDTH))',
        ]
        block_forward = ["y = torch.tanh(self.linear(x))", "y = y * self.scale.to(y.dtype)"]
        block_doc = "tanh(linear(x)) times a buffer, halved in eval mode (a backend that ignores eval() shows)."
    else:
        block_init = ["self.linear = nn.Linear(WIDTH, WIDTH)"]
        block_forward = ["y = torch.tanh(self.linear(x))"]
        block_doc = "tanh(linear(x)), halved in eval mode (a backend that ignores eval() shows)."
    model_init = [
        "self.inp = nn.Linear(IN_WIDTH, WIDTH)",
        "self.blocks = nn.ModuleList([Block() for _ in range(DEPTH)])",
        "self.out = nn.Linear(WIDTH, OUT_WIDTH)",
    ]
    if uses.swaps:
        model_init.append("self.swapped = False  # blocks 0 and 1 trade places in the forward")
    for index in shape.frozen:
        model_init.append(f"self.blocks[{index}].linear.requires_grad_(False)  # frozen: block {index} does not train")
    if uses.swaps:
        forward = ["h = self.inp(x)", "for index in self.route():", "    h = self.blocks[index](h)"]
        forward.append("return self.out(h)")
        route = _block(
            '''
                def route(self) -> list[int]:
                    """The order the blocks run in: blocks 0 and 1 trade places while swapped."""
                    order = list(range(DEPTH))
                    if self.swapped:
                        order[0], order[1] = order[1], order[0]
                    return order
            '''
        )
    else:
        forward = ["h = self.inp(x)", "for block in self.blocks:", "    h = block(h)", "return self.out(h)"]
        route = ""
    buffer_init = ""
    if shape.buffers:
        buffer_init = (
            "\n        for buffer in model.buffers():"
            "\n            buffer.copy_(torch.rand(buffer.shape, generator=generator) + 0.5)"
        )
    text = _block(
        '''
        class Block(nn.Module):
            """<<block_doc>>"""

            def __init__(self) -> None:
                super().__init__()
        <<block_init>>

            def forward(self, x: torch.Tensor) -> torch.Tensor:
        <<block_forward>>
                return y if self.training else y * 0.5


        class Model(nn.Module):
            """An input linear, DEPTH square blocks, an output linear."""

            def __init__(self) -> None:
                super().__init__()
        <<model_init>>
        <<route>>
            def forward(self, x: torch.Tensor) -> torch.Tensor:
        <<forward>>


        def build_model(seed: int, device: torch.device) -> Model:
            """The model with values drawn from `seed`<<buffer_words>>."""
            generator = torch.Generator().manual_seed(seed)
            with torch.device("cpu"):
                model = Model()
            with torch.no_grad():
                for param in model.parameters():
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.5)<<buffer_init>>
            return model.to(device)
        ''',
        block_doc=block_doc,
        block_init=_indent(block_init, 2),
        block_forward=_indent(block_forward, 2),
        model_init=_indent(model_init, 2),
        route="\n" + textwrap.indent(route, "    ") if route else "",
        forward=_indent(forward, 2),
        buffer_init=buffer_init,
        buffer_words=" (buffers not all ones, so a lost buffer shows)" if shape.buffers else "",
    )
    return text


# -- data --------------------------------------------------------------------------------------
def _data(uses: _Uses) -> str:
    return _block(
        '''
        def local_batch(iteration: int, rank: int) -> torch.Tensor:
            """What <<data_rank>> `rank` feeds at data iteration `iteration` (on CPU): the generator is seeded
            from (SEED, iteration, rank) alone, so the oracle rebuilds every batch in one process."""
            generator = torch.Generator().manual_seed(hash((SEED, iteration, rank)) & 0x7FFF_FFFF_FFFF_FFFF)
            return torch.randn(LOCAL_BATCH, IN_WIDTH, generator=generator)


        def loss_of(output: torch.Tensor) -> torch.Tensor:
            """The sum of the output, in the output's dtype (the compute dtype under mixed precision)."""
            return output.sum()


        def make_optimizer(params, lr: float) -> torch.optim.Optimizer:
            return <<optimizer>>(params, lr=lr)
        ''',
        optimizer=uses.optimizer_class,
        data_rank="data rank" if uses.tensor_parallel else "rank",
    )


# -- oracle ------------------------------------------------------------------------------------
def _oracle(uses: _Uses) -> str:
    if uses.mixed_precision:
        backward = _block(
            '''
            def backward(self, iteration: int) -> list[float]:
                """Every rank's forward + backward of data iteration `iteration`, as mixed precision
                computes them: each rank's batch on a PARAM_DTYPE copy of the float32 parameters, the
                rank gradients summed rank by rank in REDUCTION_DTYPE and divided by WORLD_SIZE, then
                added to the float32 gradients. Returns the rank losses."""
                compute = self.low_precision_copy()
                losses, rank_grads = [], []
                for rank in range(WORLD_SIZE):
                    compute.zero_grad(set_to_none=True)
                    loss = loss_of(compute(local_batch(iteration, rank).to(PARAM_DTYPE)))
                    loss.backward()
                    losses.append(loss.item())
                    rank_grads.append({name: p.grad for name, p in compute.named_parameters() if p.grad is not None})
                with torch.no_grad():
                    for name, master in self.model.named_parameters():
                        if name not in rank_grads[0]:
                            continue
                        total = rank_grads[0][name].to(REDUCTION_DTYPE)
                        for grads in rank_grads[1:]:
                            total = total + grads[name].to(REDUCTION_DTYPE)
                        average = (total / WORLD_SIZE).float()
                        master.grad = average if master.grad is None else master.grad + average
                return losses

            def low_precision_copy(self) -> Model:
                """The model with its parameters in PARAM_DTYPE (buffers stay float32, as the backends keep them)."""
                compute = copy.deepcopy(self.model)
                with torch.no_grad():
                    for param in compute.parameters():
                        param.data = param.data.to(PARAM_DTYPE)
                        param.grad = None
                return compute
            '''
        )
    else:
        backward = _block(
            '''
            def backward(self, iteration: int) -> list[float]:
                """One forward over every rank's batch of data iteration `iteration` and a backward of the
                mean rank loss (adds the rank-averaged gradients). Returns the rank losses."""
                x = torch.cat([local_batch(iteration, rank) for rank in range(WORLD_SIZE)])
                losses = torch.stack([loss_of(chunk) for chunk in self.model(x).chunk(WORLD_SIZE)])
                losses.mean().backward()
                return losses.tolist()
            '''
        )
    methods = [backward]
    if uses.has(EvalForward):
        compute = "self.low_precision_copy()" if uses.mixed_precision else "self.model"
        cast = ".to(PARAM_DTYPE)" if uses.mixed_precision else ""
        methods.append(
            _block(
                '''
                def eval_losses(self, evals: int) -> list[float]:
                    """Every rank's loss of one forward under no_grad (eval forward number `evals`), in the
                    model's current mode."""
                    compute = <<compute>>
                    with torch.no_grad():
                        batches = [local_batch(EVAL_ITERATIONS + evals, rank)<<cast>> for rank in range(WORLD_SIZE)]
                        return [loss_of(compute(x)).item() for x in batches]
                ''',
                compute=compute,
                cast=cast,
            )
        )
    methods.append(
        _block(
            """
            def state(self) -> dict[str, torch.Tensor]:
                return {name: value.detach().clone() for name, value in self.model.state_dict().items()}
            """
        )
    )
    if uses.has(Unshard):
        methods.append(
            _block(
                """
                def params(self) -> dict[str, torch.Tensor]:
                    return {name: p.detach().clone() for name, p in self.model.named_parameters()}
                """
            )
        )
    if uses.reads_grads:
        methods.append(
            _block(
                """
                def grads(self) -> dict[str, torch.Tensor]:
                    return {name: p.grad.clone() for name, p in self.model.named_parameters() if p.grad is not None}
                """
            )
        )
    if any(op.write for op in uses.all_of(Unshard)):
        methods.append(
            _block(
                """
                def add_to_parameters(self, value: float) -> None:
                    with torch.no_grad():
                        for param in self.model.parameters():
                            param.add_(value)
                """
            )
        )
    if uses.rebuilds:
        methods.append(
            _block(
                '''
                def reload(self, keep_optimizer: bool) -> None:
                    """What a save and a load into a fresh model leave: the values, no gradients, and the
                    optimizer's state only where the checkpoint holds it."""
                    for param in self.model.parameters():
                        param.grad = None
                    if not keep_optimizer:
                        self.optimizer = make_optimizer(self.model.parameters(), ORACLE_LR)
                '''
            )
        )
    head = _block(
        '''
        class Oracle:
            """The program on one unsharded float32 model on CPU, in this process: data parallelism over
            WORLD_SIZE ranks optimises the mean of the rank losses, so each backward takes every rank's
            batch and adds the rank-averaged gradient."""

            def __init__(self) -> None:
                self.model = build_model(SEED, torch.device("cpu"))
                self.optimizer = make_optimizer(self.model.parameters(), ORACLE_LR)
        '''
    )
    text = head.rstrip("\n") + "\n\n" + "\n".join(textwrap.indent(m.strip("\n") + "\n", "    ") for m in methods)
    # 2-D: the ranks of one dp group feed one batch, so a pass sees DP_SIZE batches, not WORLD_SIZE.
    return text.replace("WORLD_SIZE", uses.data_ranks)


# -- sharding ----------------------------------------------------------------------------------
def _attribute(fqn: str) -> str:
    """``blocks.0.linear`` as the Python expression ``model.blocks[0].linear``."""
    text = "model"
    for part in fqn.split("."):
        text += f"[{part}]" if part.isdigit() else f".{part}"
    return text


def _units(uses: _Uses) -> list[str]:
    """The unit FQNs below the root, innermost first (FSDP2's auto plan: every Block by class)."""
    if uses.setup.unit_plan == "auto":
        return [f"blocks.{index}" for index in range(uses.program.model.depth)]
    fqns = uses.program.unit_fqns()
    return sorted(dict.fromkeys(fqns), key=lambda fqn: -(fqn.count(".") + 1))


def _strategy_for(uses: _Uses, fqn: str) -> ShardingStrategy:
    if uses.setup.unit_plan == "mixed" and fqn == "blocks.0" and uses.setup.other_strategy is not None:
        return uses.setup.other_strategy
    return uses.setup.strategy


def _plan_words(uses: _Uses) -> str:
    plan = uses.setup.unit_plan
    return {
        "none": "the whole model one unit",
        "auto": "every Block its own unit",
        "leaves": "every block its own unit, innermost first, then the root",
        "nested": "block 0's linear, then every block, then the root (innermost first)",
        "mixed": "every block its own unit (block 0 with a strategy of its own), then the root",
    }[plan]


def _sharding(uses: _Uses) -> str:
    if uses.backend == FSDP1:
        return _fsdp1_sharding(uses)
    if uses.backend == FSDP2:
        return _fsdp2_sharding(uses)
    return _zero_sharding(uses)


def _mesh_parameter(uses: _Uses) -> tuple[str, str]:
    """The shard function's mesh parameter and the call's argument."""
    return (", mesh: DeviceMesh", ", mesh") if uses.mesh is not None else ("", "")


def _fsdp1_sharding(uses: _Uses) -> str:
    setup = uses.setup
    options = [f'"use_orig_params": {setup.use_orig_params},', '"device_id": DEVICE,']
    if uses.mixed_precision:
        reduce = "torch.float32" if setup.reduce_fp32 else "None"
        options.append(f'"mixed_precision": MixedPrecision(param_dtype=PARAM_DTYPE, reduce_dtype={reduce}),')
    if setup.offload_params:
        options.append('"cpu_offload": CPUOffload(offload_params=True),')
    if uses.mesh in ("hybrid", "2-D"):
        options.append('"device_mesh": mesh,')
    body = ["options = {", *("    " + line for line in options), "}"]
    for fqn in _units(uses) if setup.unit_plan != "auto" else []:
        target = _attribute(fqn)
        strategy = _strategy_for(uses, fqn).name
        body += _wrapped_call(f"{target} = FullyShardedDataParallel(", [target, _fsdp1_strategy(strategy), "**options"])
    root = ["model", _fsdp1_strategy(setup.strategy.name)]
    if setup.unit_plan == "auto":
        root.append("auto_wrap_policy=ModuleWrapPolicy({Block})")
    body += _wrapped_call("return FullyShardedDataParallel(", [*root, "**options"])
    parameter, _ = _mesh_parameter(uses)
    return _block(
        '''
        def shard(model: Model<<parameter>>) -> FullyShardedDataParallel:
            """FSDP1 as the suite's torch-fsdp1 adapter applies it:
            <<plan>>.<<mesh_words>>"""
        <<body>>


        def make_sharded_optimizer(sharded: nn.Module) -> torch.optim.Optimizer:
            return make_optimizer(sharded.parameters(), SHARDED_LR)
        ''',
        parameter=parameter,
        plan=_plan_words(uses),
        mesh_words=_TWO_D_MESH_WORDS if uses.tensor_parallel else "",
        body=_indent(body, 1),
    )


def _fsdp1_strategy(name: str) -> str:
    return f"sharding_strategy=ShardingStrategy.{name}"


def _wrapped_call(opening: str, arguments: list[str], indent: int = 4) -> list[str]:
    """A call on one line where it fits the 120 columns, else one argument a line (the formatter's way)."""
    line = opening + ", ".join(arguments) + ")"
    if indent + len(line) <= 120:
        return [line]
    return [opening, *(f"    {argument}," for argument in arguments), ")"]


def _fsdp2_sharding(uses: _Uses) -> str:
    setup = uses.setup
    common = []
    if uses.mixed_precision:
        reduce = "torch.float32" if setup.reduce_fp32 else "None"
        common.append(f'"mp_policy": MixedPrecisionPolicy(param_dtype=PARAM_DTYPE, reduce_dtype={reduce}),')
    if setup.offload_params:
        common.append('"offload_policy": CPUOffloadPolicy(pin_memory=USE_CUDA),  # pinned memory needs a GPU')
    body = ["options = {", *("    " + line for line in common), "}"] if common else []

    def call(target: str, strategy: ShardingStrategy) -> str:
        arguments = [target]
        if (
            uses.tensor_parallel
            or strategy is ShardingStrategy.HYBRID_SHARD
            or (strategy is ShardingStrategy.NO_SHARD and uses.mesh == "replicate")
        ):
            arguments.append("mesh=mesh")
        if strategy is ShardingStrategy.SHARD_GRAD_OP:
            arguments.append("reshard_after_forward=False")
        if common:
            arguments.append("**options")
        return f"fully_shard({', '.join(arguments)})"

    for fqn in _units(uses):
        body.append(call(_attribute(fqn), _strategy_for(uses, fqn)))
    body += [call("model", setup.strategy), "return model"]
    parameter, _ = _mesh_parameter(uses)
    mesh_words = {
        "hybrid": "\n    HYBRID_SHARD is a 2-D (replicate, shard) mesh.",
        "replicate": "\n    NO_SHARD units are on a (WORLD_SIZE, 1) mesh: every rank a replica of its own.",
        "2-D": _TWO_D_MESH_WORDS,
        None: "",
    }[uses.mesh]
    return _block(
        '''
        def shard(model: Model<<parameter>>) -> Model:
            """fully_shard as the suite's torch-fsdp2 adapter applies it:
            <<plan>>.<<mesh_words>>"""
        <<body>>


        def make_sharded_optimizer(sharded: nn.Module) -> torch.optim.Optimizer:
            return make_optimizer(sharded.parameters(), SHARDED_LR)
        ''',
        parameter=parameter,
        plan=_plan_words(uses).replace("the whole model one unit", "the root alone"),
        mesh_words=mesh_words,
        body=_indent(body, 1),
    )


def _zero_sharding(uses: _Uses) -> str:
    if uses.setup.form is ApiForm.WRAPPER:
        shard = _block(
            '''
            def shard(model: Model) -> DistributedDataParallel:
                """DistributedDataParallel, as the suite's torch-zero adapter wraps the model."""
                return DistributedDataParallel(model, device_ids=None if DEVICE.type == "cpu" else [DEVICE])
            '''
        )
    else:
        shard = _block(
            '''
            def shard(model: Model) -> Model:
                """replicate(), the composable DistributedDataParallel, as the suite's torch-zero adapter applies it."""
                return replicate(model, device_id=DEVICE)
            '''
        )
    if uses.zero_optimizer:
        optimizer = _block(
            '''
            def make_sharded_optimizer(sharded: nn.Module) -> torch.optim.Optimizer:
                """ZeRO-1: each rank keeps and steps the optimizer state of the parameters assigned to it."""
                return ZeroRedundancyOptimizer(sharded.parameters(), optimizer_class=<<optimizer>>, lr=SHARDED_LR)
            ''',
            optimizer=uses.optimizer_class,
        )
    else:
        optimizer = _block(
            """
            def make_sharded_optimizer(sharded: nn.Module) -> torch.optim.Optimizer:
                return make_optimizer(sharded.parameters(), SHARDED_LR)
            """
        )
    return shard.strip("\n") + "\n\n\n" + optimizer.strip("\n")


# -- checks ------------------------------------------------------------------------------------
def _checks(uses: _Uses) -> str:
    gather = ""
    if uses.tensor_parallel:
        gather = (
            "\n        if isinstance(got, DTensor):"
            "\n            got = got.full_tensor()  # a collective: every rank compares the same names in order"
        )
    text = _block(
        '''
        def differences(
            actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tolerance: tuple[float, float, float]
        ) -> list[str]:
            """One line per name missing, unexpected or outside `tolerance`, the largest difference first."""
            rtol, atol, scaled_atol = tolerance
            problems = [(math.inf, f"{name}: missing") for name in sorted(expected.keys() - actual.keys())]
            problems += [(math.inf, f"{name}: unexpected") for name in sorted(actual.keys() - expected.keys())]
            for name in sorted(expected.keys() & actual.keys()):
                got = actual[name]<<gather>>
                got, want = got.detach().float().cpu(), expected[name]
                if got.shape != want.shape:
                    problems.append((math.inf, f"{name}: shape {tuple(got.shape)}, the oracle's {tuple(want.shape)}"))
                    continue
                if got.numel() == 0:
                    continue
                bound = atol + scaled_atol * want.abs().max().item()
                if torch.allclose(got, want, rtol=rtol, atol=bound):
                    continue
                difference = (got.double() - want.double()).abs().nan_to_num(nan=math.inf)
                index = tuple(int(i) for i in torch.unravel_index(difference.argmax(), difference.shape))
                largest = difference[index].item()
                problems.append(
                    (
                        largest,
                        f"{name}: max abs difference {largest:.3g} at index {index} "
                        f"({got[index].item():.9g}, the oracle's {want[index].item():.9g})",
                    )
                )
            return [line for _, line in sorted(problems, key=lambda problem: -problem[0])]
        ''',
        gather=gather,
    )
    if uses.backend == FSDP1 and uses.shows:
        text += "\n\n" + _block(
            '''
            def original_name(name: str) -> str:
                """A parameter's name in the unwrapped model (FSDP1 wrappers add _fsdp_wrapped_module)."""
                return name.replace("_fsdp_wrapped_module.", "")
            '''
        )
    if _ddp_wrapper(uses) and uses.shows:
        text += "\n\n" + _block(
            '''
            def original_name(name: str) -> str:
                """A parameter's name in the unwrapped model (DistributedDataParallel holds it as .module)."""
                return name.removeprefix("module.")
            '''
        )
    if uses.no_sync and (uses.backend == FSDP2 or (uses.backend == ZERO and not _ddp_wrapper(uses))):
        text += "\n\n" + _block(
            '''
            @contextlib.contextmanager
            def gradient_sync_off(sharded: nn.Module):
                """Backward passes inside accumulate local gradients without reducing them."""
                sharded.set_requires_gradient_sync(False)
                try:
                    yield
                finally:
                    sharded.set_requires_gradient_sync(True)
            '''
        )
    return text


# -- the run: state and one method per kind of operation ----------------------------------------
def _run_class(uses: _Uses) -> str:
    parameter, _ = _mesh_parameter(uses)
    mesh_argument = ", self.mesh" if uses.mesh is not None else ""
    build = ["self.model = build_model(seed, DEVICE)"]
    if uses.tensor_parallel:
        mesh_argument = ', self.mesh["dp"]'
        build += [
            "# 2-D: tensor parallelism over the tp dimension first (block 0's linear column-wise, block 1's",
            "# row-wise), then the model sharded over the dp dimension.",
            'plan = {"blocks.0.linear": ColwiseParallel(), "blocks.1.linear": RowwiseParallel()}',
            'parallelize_module(self.model, self.mesh["tp"], plan)',
        ]
    build += [
        f"self.sharded = shard(self.model{mesh_argument})",
        "self.optimizer = make_sharded_optimizer(self.sharded)",
    ]
    if uses.order_checked and uses.route_can_differ:
        build += [
            "self.first_route: list[int] | None = None  # the order of the first training forward",
            "self.order_warned = False",
        ]
    init = ["self.rank = rank"]
    if uses.tensor_parallel:
        init.append("self.data_rank = rank // TP_SIZE  # whose batch this rank feeds: its dp group's")
    if uses.mesh is not None:
        init.append("self.mesh = mesh  # built once: every model the program shards (a fresh one per load) shares it")
    init += [
        "self.oracle = Oracle()",
        "self.iteration = 0  # data iterations fed so far (the oracle feeds the same)",
    ]
    if uses.has(EvalForward):
        init.append("self.evals = 0")
    init += ['self.where = "before op 0"', "self.mismatches = 0", "self.build(SEED)"]
    methods = [
        _block(
            '''
            def __init__(self, rank: int<<parameter>>) -> None:
            <<init>>

            def build(self, seed: int) -> None:
                """Build the model (values from `seed`), shard it and make its optimizer."""
            <<build>>

            @contextlib.contextmanager
            def op(self, index: int, operation: str):
                """Run operation `index`: its mismatches name it, and so does an error it raises."""
                self.where = f"op {index} ({operation})"
                try:
                    yield
                except Exception as error:
                    print(f"rank {self.rank}, {self.where}: raised {type(error).__name__}: {error}", flush=True)
                    raise

            def mismatch(self, text: str) -> None:
                print(f"rank {self.rank}, {self.where}: {text}", flush=True)
                self.mismatches += 1

            def compare(self, actual: dict, expected: dict[str, torch.Tensor], tolerance: tuple, what: str) -> None:
                found = differences(actual, expected, tolerance)
                if found:
                    rtol, atol, scaled_atol = tolerance
                    bound = f"rtol {rtol:g}, atol {atol:g} + {scaled_atol:g} x max|oracle|"
                    lines = "".join(f"\\n  {line}" for line in found)
                    self.mismatch(f"{what} differ from the oracle's: {len(found)} of {len(expected)} ({bound}):{lines}")

            def check_loss(self, what: str, loss: float, expected: float) -> None:
                if abs(loss - expected) > LOSS_ATOL + LOSS_RTOL * abs(expected):
                    self.mismatch(
                        f"{what} {loss:.9g}, the oracle's {expected:.9g} (difference {abs(loss - expected):.3g}; "
                        f"bound {LOSS_ATOL:g} + {LOSS_RTOL:g} x |oracle|)"
                    )

            def check_params(self, when: str) -> None:
                """The full parameters and buffers (the full state dict) against the oracle's."""
                state = <<full_state>>
                self.compare(state, self.oracle.state(), PARAM_TOLERANCE, f"the full state dict {when}")
            ''',
            parameter=parameter,
            init=_indent(init, 1),
            build=_indent(build, 1),
            full_state=_full_state_call(uses),
        )
    ]
    methods += _state_dict_methods(uses)
    if uses.shows:
        methods.append(_shown_method(uses))
    if uses.divergent_route:
        methods.append(_refusal_method(uses))
    if uses.has(Backward) and not uses.divergent_route:
        methods.append(_backward_method(uses))
    if uses.grads_checked:
        methods.append(_grads_method(uses))
    if uses.reads_grads:
        methods.append(_compare_grads_method(uses))
    if uses.has(EvalForward):
        methods.append(_eval_method(uses))
    if uses.order_checked:
        methods.append(_order_method(uses))
    if uses.has(Unshard):
        methods.append(_unshard_method(uses))
    if uses.save_kinds - {"native"}:
        methods.append(_save_load_method(uses))
    if uses.native:
        methods.append(_native_method(uses))
    if uses.optim_kinds:
        methods.append(_optim_method(uses))
    head = _block(
        '''
        class Run:
            """The sharded model and its optimizer beside the oracle, and the count of mismatches found."""
        '''
    )
    return head.rstrip("\n") + "\n\n" + "\n".join(textwrap.indent(m.strip("\n") + "\n", "    ") for m in methods)


def _full_state_call(uses: _Uses) -> str:
    return "self.full_state_dict()" if uses.backend == ZERO else "self.model_state_dict(full=True)"


def _state_dict_methods(uses: _Uses) -> list[str]:
    if uses.backend == ZERO:
        methods = [
            _block(
                '''
                def full_state_dict(self) -> dict[str, torch.Tensor]:
                    """The whole model's state: every rank holds it whole (copies, as a gathered one would be)."""
                    return {name: value.detach().clone() for name, value in self.model.state_dict().items()}
                '''
            )
        ]
        if uses.rebuilds:
            methods.append(
                _block(
                    """
                    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
                        self.model.load_state_dict(state, strict=True)
                    """
                )
            )
        return methods
    if uses.backend == FSDP1:
        if uses.sharded_state_dicts:
            kind = _block(
                """
                if full:
                    return StateDictType.FULL_STATE_DICT, FullStateDictConfig()
                return StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig()
                """
            )
        else:
            kind = "return StateDictType.FULL_STATE_DICT, FullStateDictConfig()\n"
        methods = [
            _block(
                '''
                def model_state_dict(self, full: bool) -> dict:
                    with FullyShardedDataParallel.state_dict_type(self.sharded, *self.state_dict_type(full)):
                        return self.sharded.state_dict()

                @staticmethod
                def state_dict_type(full: bool) -> tuple:
                    """A fresh config per call (FSDP1 may change the one it is given)."""
                <<kind>>
                ''',
                kind=textwrap.indent(kind.strip("\n"), "    "),
            )
        ]
        if uses.rebuilds:
            methods.append(
                _block(
                    """
                    def load_model_state(self, state: dict, full: bool) -> None:
                        with FullyShardedDataParallel.state_dict_type(self.sharded, *self.state_dict_type(full)):
                            self.sharded.load_state_dict(state)
                    """
                )
            )
    else:
        methods = [
            _block(
                """
                def model_state_dict(self, full: bool) -> dict:
                    return get_model_state_dict(self.sharded, options=StateDictOptions(full_state_dict=full))
                """
            )
        ]
        if uses.rebuilds:
            methods.append(
                _block(
                    """
                    def load_model_state(self, state: dict, full: bool) -> None:
                        set_model_state_dict(self.sharded, state, options=StateDictOptions(full_state_dict=full))
                    """
                )
            )
    if uses.optim_kinds or uses.native:
        methods.append(
            _block(
                """
                def optimizer_state_dict(self, full: bool) -> dict:
                    options = StateDictOptions(full_state_dict=full)
                    return get_optimizer_state_dict(self.sharded, self.optimizer, options=options)

                def load_optimizer_state(self, state: dict, full: bool) -> None:
                    options = StateDictOptions(full_state_dict=full)
                    set_optimizer_state_dict(self.sharded, self.optimizer, state, options=options)
                """
            )
        )
    return methods


def _shown_method(uses: _Uses) -> str:
    reads_grads = uses.grads_checked or uses.unshard_reads_grads
    rename = "name" if uses.backend == FSDP2 or (uses.backend == ZERO and not _ddp_wrapper(uses)) else None
    key = rename or "original_name(name)"
    if reads_grads:
        return _block(
            '''
            def shown(self, grads: bool) -> dict[str, torch.Tensor]:
                """What the sharded model's parameters (or their gradients) show now, float32 on CPU."""
                shown = {}
                for name, param in self.sharded.named_parameters():
                    value = param.grad if grads else param
                    if value is not None:
                        shown[<<key>>] = value.detach().float().cpu().clone()
                return shown
            ''',
            key=key,
        )
    return _block(
        '''
        def shown(self) -> dict[str, torch.Tensor]:
            """What the sharded model's parameters show now, float32 on CPU."""
            return {<<key>>: p.detach().float().cpu().clone() for name, p in self.sharded.named_parameters()}
        ''',
        key=key,
    )


def _sync_off(uses: _Uses) -> str:
    if uses.backend == FSDP1 or _ddp_wrapper(uses):
        return "self.sharded.no_sync()"
    return "gradient_sync_off(self.sharded)"


def _refusal_method(uses: _Uses) -> str:
    return _block(
        '''
        def first_pass_in_divergent_orders(self) -> None:
            """The ranks run their first forward in different block orders: FSDP1, asked to check the
            order (check_exec_order, TORCH_DISTRIBUTED_DEBUG=DETAIL), must refuse it."""
            x = local_batch(self.iteration, self.rank).to(DEVICE)
            try:
                loss_of(self.sharded(x)).backward()
            except Exception as error:  # noqa: BLE001 - any error refuses (with use_orig_params FSDP1 raises KeyError)
                print(f"rank {self.rank}: refused, as it should be: {type(error).__name__}: {error}", flush=True)
                return
            self.mismatch(
                "the ranks ran the first iteration in different forward orders (blocks 0 and 1 swapped on odd "
                "ranks) and FSDP1, asked to check the order (check_exec_order=True), did not refuse it"
            )
        '''
    )


def _data_rank(uses: _Uses) -> str:
    """Whose batch this rank feeds: its own, or its dp group's under 2-D."""
    return "self.data_rank" if uses.tensor_parallel else "self.rank"


def _backward_method(uses: _Uses) -> str:
    order = uses.order_checked
    if uses.no_sync:
        doc = [
            '"""`micro_batches` forward + backward passes, each on a batch of its own (with `no_sync`, the',
            'first `micro_batches - 1` without gradient sync); each loss against the oracle\'s."""',
        ]
    else:
        doc = [
            '"""`micro_batches` forward + backward passes, each on a batch of its own; each loss against',
            'the oracle\'s."""',
        ]
    lines = [
        *doc,
        "expected = [self.oracle.backward(self.iteration + index) for index in range(micro_batches)]",
        "for micro_batch in range(micro_batches):",
        f"    x = local_batch(self.iteration, {_data_rank(uses)}).to(DEVICE)",
        "    self.iteration += 1",
    ]
    inner = ["loss = loss_of(self.sharded(x))", "loss.backward()"]
    if uses.no_sync:
        inner = [
            "unsynced = no_sync and micro_batch < micro_batches - 1",
            f"with {_sync_off(uses)} if unsynced else contextlib.nullcontext():",
            *("    " + line for line in inner),
        ]
    if order:
        route = ["route = self.model.route()"] if uses.route_can_differ else []
        inner = [
            *route,
            "with warnings.catch_warnings(record=True) as caught:",
            '    warnings.simplefilter("always")',
            *("    " + line for line in inner),
        ]
        if uses.route_can_differ:
            inner += [
                "self.check_order_warnings(caught, route, training=True)",
                "if self.first_route is None:",
                "    self.first_route = route",
            ]
        else:
            inner.append("self.check_no_order_warning(caught)")
    lines += ["    " + line for line in inner]
    lines.append('    what = f"micro-batch {micro_batch}: loss"')
    lines.append(f"    self.check_loss(what, loss.item(), expected[micro_batch][{_data_rank(uses)}])")
    if uses.grads_checked:
        lines.append("self.check_grads()")
    signature = (
        "def forward_backward(self, micro_batches: int, no_sync: bool = False) -> None:"
        if uses.no_sync
        else "def forward_backward(self, micro_batches: int) -> None:"
    )
    return signature + "\n" + _indent(lines, 1) + "\n"


def _grads_method(uses: _Uses) -> str:
    if uses.backend == ZERO:
        return _block(
            '''
            def check_grads(self) -> None:
                """The gradients after a backward (DistributedDataParallel leaves them whole, all-reduced, on
                every rank) against the oracle's."""
                self.compare_grads(self.shown(grads=True), "the full gradients after backward")
            '''
        )
    return _block(
        '''
        def check_grads(self) -> None:
            """The full gradients after a backward (gathered by summon_full_params) against the oracle's."""
            with FullyShardedDataParallel.summon_full_params(self.sharded, writeback=False, with_grads=True):
                shown = self.shown(grads=True)
            self.compare_grads(shown, "the full gradients after backward")
        '''
    )


def _compare_grads_method(uses: _Uses) -> str:
    if not uses.program.model.frozen:
        return _block(
            """
            def compare_grads(self, shown: dict[str, torch.Tensor], what: str) -> None:
                self.compare(shown, self.oracle.grads(), GRAD_TOLERANCE, what)
            """
        )
    return _block(
        '''
        def compare_grads(self, shown: dict[str, torch.Tensor], what: str) -> None:
            """The trained parameters' gradients against the oracle's; a frozen one must show none."""
            frozen_shown = sorted(name for name in shown if name in FROZEN)
            if frozen_shown:
                self.mismatch(
                    "frozen parameters (requires_grad=False) show a gradient inside unshard(with_grads=True): "
                    f"{frozen_shown}; torch leaves their .grad None"
                )
            trained = {name: grad for name, grad in shown.items() if name not in FROZEN}
            self.compare(trained, self.oracle.grads(), GRAD_TOLERANCE, what)
        '''
    )


def _eval_method(uses: _Uses) -> str:
    lines = [
        '"""One forward under no_grad in the current mode; its loss against the oracle\'s."""',
        f"x = local_batch(EVAL_ITERATIONS + self.evals, {_data_rank(uses)}).to(DEVICE)",
        f"expected = self.oracle.eval_losses(self.evals)[{_data_rank(uses)}]",
        "self.evals += 1",
    ]
    forward = ["with torch.no_grad():", "    loss = loss_of(self.sharded(x)).item()"]
    if uses.order_checked:
        route = ["route = self.model.route()"] if uses.route_can_differ else []
        check = (
            "self.check_order_warnings(caught, route, training=False)"
            if uses.route_can_differ
            else "self.check_no_order_warning(caught)"
        )
        forward = [
            *route,
            "with warnings.catch_warnings(record=True) as caught:",
            '    warnings.simplefilter("always")',
            *("    " + line for line in forward),
            check,
        ]
    lines += forward
    lines += [
        'mode = "training" if self.oracle.model.training else "eval"',
        'self.check_loss(f"loss under no_grad in {mode} mode:", loss, expected)',
    ]
    return "def eval_forward(self) -> None:\n" + _indent(lines, 1) + "\n"


def _order_method(uses: _Uses) -> str:
    if not uses.route_can_differ:
        return _block(
            '''
            def check_no_order_warning(self, caught: list) -> None:
                """The forward order never changes in this program: FSDP1 must not warn about it."""
                issued = [str(w.message) for w in caught if ORDER_WARNING in str(w.message)]
                if issued:
                    self.mismatch(f"a forward issued forward-order warnings it should not: {issued}")
            '''
        )
    return _block(
        '''
        def check_order_warnings(self, caught: list, route: list[int], training: bool) -> None:
            """FSDP1 (check_exec_order) warns in the first training pass whose block order differs from
            the first iteration's (once per unit out of order), and in no other pass, eval forwards included."""
            issued = [str(w.message) for w in caught if ORDER_WARNING in str(w.message)]
            due = training and self.first_route is not None and not self.order_warned and route != self.first_route
            if due:
                self.order_warned = True
            if due and not issued:
                self.mismatch(
                    f"a training forward whose order differs from the first iteration's ({route} after "
                    f"{self.first_route}) issued no forward-order warning"
                )
            elif issued and not due:
                what = "a training" if training else "an eval"
                self.mismatch(f"{what} forward issued forward-order warnings it should not: {issued}")
        '''
    )


def _unshard_parameters(uses: _Uses) -> list[str]:
    """The options the script's unshard takes: those the program's unshards use, and FSDP1's
    writeback always (summon_full_params defaults it to True, the suite's unshard to False)."""
    ops = uses.all_of(Unshard)

    def used(name: str) -> bool:
        return any(getattr(op, name) for op in ops)

    if uses.backend == FSDP1:
        return ["writeback", *(name for name in ("rank0_only", "offload_to_cpu", "with_grads", "write") if used(name))]
    if uses.backend == ZERO:
        return [name for name in ("with_grads", "write") if used(name)]
    return []


def _unshard_method(uses: _Uses) -> str:
    ops = uses.all_of(Unshard)
    writes = any(op.write for op in ops)
    rank0 = any(op.rank0_only for op in ops)
    with_grads = uses.unshard_reads_grads
    reads_grads = uses.grads_checked or with_grads
    shown = "self.shown(grads=False)" if reads_grads else "self.shown()"
    parameters = _unshard_parameters(uses)
    if uses.backend == FSDP1:
        options = "".join(f", {name}={name}" for name in parameters if name != "write")
        enter = [f"with FullyShardedDataParallel.summon_full_params(self.sharded{options}):"]
        if len(enter[0]) > 120 - 8:  # the formatter's way: the arguments on a line of their own
            enter = ["with FullyShardedDataParallel.summon_full_params(", f"    self.sharded{options}", "):"]
        doc = '"""Inside FSDP1\'s summon_full_params with these options, the full parameters against the oracle\'s."""'
    elif uses.backend == FSDP2:
        enter = [
            "units = [module for module in self.sharded.modules() if isinstance(module, FSDPModule)]",
            "for unit in units:",
            "    unit.unshard()",
            "try:",
        ]
        doc = '"""FSDPModule.unshard() on every unit, the full parameters against the oracle\'s, reshard()."""'
    else:
        enter = []
        doc = (
            '"""DistributedDataParallel keeps every parameter whole on every rank: unshard is reading them as\n'
            'they are (and a write to them persists, as writeback=True asks)."""'
        )
    inside = []
    compare = [f'self.compare({shown}, expected, PARAM_TOLERANCE, "full parameters inside unshard")']
    if with_grads:
        compare += [
            "if with_grads and expected_grads:",
            '    self.compare_grads(self.shown(grads=True), "gradients inside unshard")',
        ]
    if rank0:
        inside += ["if not rank0_only or self.rank == 0:", *("    " + line for line in compare)]
    else:
        inside += compare
    if writes:
        inside += [
            "if write:",
            "    with torch.no_grad():",
            "        for param in self.sharded.parameters():",
            "            param.add_(0.01)",
        ]
    lines = [*doc.split("\n"), "expected = self.oracle.params()"]
    if with_grads:
        lines.append("expected_grads = self.oracle.grads()")
    if uses.backend == FSDP2:
        lines += enter + ["    " + line for line in inside]
        lines += ["finally:", "    for unit in reversed(units):", "        unit.reshard()"]
    elif enter:
        lines += enter + ["    " + line for line in inside]
    else:
        lines += inside
    if writes and not enter:  # the same block as the write itself
        lines[-4:] = [*lines[-4:], "    self.oracle.add_to_parameters(0.01)"]
        lines.append('    self.check_params("after the write inside unshard(writeback=True)")')
    elif writes:
        lines += [
            "if write:",
            "    self.oracle.add_to_parameters(0.01)",
            '    self.check_params("after the write inside unshard(writeback=True)")',
        ]
    signature = "def unshard(self" + "".join(f", {name}: bool = False" for name in parameters) + ") -> None:"
    if parameters:
        signature = "def unshard(self, *" + "".join(f", {name}: bool = False" for name in parameters) + ") -> None:"
    return signature + "\n" + _indent(lines, 1) + "\n"


def _save_load_method(uses: _Uses) -> str:
    kinds = uses.save_kinds - {"native"}
    zero = uses.backend == ZERO
    check_full = 'self.compare(state, self.oracle.state(), PARAM_TOLERANCE, "the full state dict saved")'
    if zero:
        lines = ["state = self.full_state_dict()", check_full]
    elif kinds == {"full"}:
        lines = ["state = self.model_state_dict(full=True)", check_full]
    elif kinds == {"sharded"}:
        lines = ["state = self.model_state_dict(full=False)", "self.check_sharded_layout(state)"]
    else:
        lines = [
            "state = self.model_state_dict(full)",
            "if full:",
            "    " + check_full,
            "else:",
            "    self.check_sharded_layout(state)",
        ]
    if zero:
        load = "self.load_model_state(state)"
    elif len(kinds) == 2:
        load = "self.load_model_state(state, full)"
    else:
        load = f"self.load_model_state(state, full={kinds == {'full'}})"
    keep, build, restore = _rebuild_lines(uses)
    lines += [*keep, build, load, *restore]
    lines += ["self.oracle.reload(keep_optimizer=False)"]
    lines.append('self.check_params("after loading into a freshly sharded model")')
    parameter = ", full: bool" if len(kinds) == 2 and not zero else ""
    doc = (
        '"""Save the model\'s state dict, load it into a freshly built and sharded model (other initial\n'
        'values) with a new optimizer, and go on with those."""'
    )
    method = f"def save_load(self{parameter}) -> None:\n" + _indent([*doc.split("\n"), *lines], 1) + "\n"
    if "sharded" in kinds:
        method += "\n" + _block(
            '''
            def check_sharded_layout(self, state: dict) -> None:
                """A sharded state dict's DTensors shard rows (dimension 0) over data parallelism."""
                for name, value in state.items():
                    if isinstance(value, DTensor) and value.dim() >= 1:
                        first = value.placements[0]
                        if isinstance(first, Shard) and first.dim != 0:
                            self.mismatch(
                                f"sharded state dict entry {name!r} is laid out {value.placements} over its mesh: "
                                f"dimension {first.dim} sharded over data parallelism, not rows (Shard(0))"
                            )
            '''
        )
    return method


def _rebuild_lines(uses: _Uses) -> tuple[list[str], str, list[str]]:
    """What the program set on the model (route, mode) kept, the fresh build, and the restore."""
    keep, restore = [], []
    if uses.swaps:
        keep.append("swapped = self.model.swapped")
        restore.append("self.model.swapped = swapped")
    if uses.mode_changes:
        keep.append("training = self.oracle.model.training")
        restore += ["if not training:", "    self.sharded.train(False)"]
    return keep, "self.build(SEED + FRESH_SEED_OFFSET)", restore


def _native_method(uses: _Uses) -> str:
    keep, build, restore = _rebuild_lines(uses)
    lines = [
        '"""torch.distributed.checkpoint of the sharded model and optimizer state, loaded into a freshly',
        'built and sharded model and a new optimizer (the oracle keeps its optimizer)."""',
        'made = [tempfile.mkdtemp(prefix="generated-checkpoint-") if self.rank == 0 else ""]',
        "dist.broadcast_object_list(made, src=0)  # one directory, the same on every rank",
        "directory = made[0]",
        "try:",
        '    state = {"model": self.model_state_dict(full=False), "optim": self.optimizer_state_dict(full=False)}',
        "    dcp.save(state, checkpoint_id=directory)",
        *("    " + line for line in [*keep, build]),
        '    state = {"model": self.model_state_dict(full=False), "optim": self.optimizer_state_dict(full=False)}',
        "    dcp.load(state, checkpoint_id=directory)",
        '    self.load_model_state(state["model"], full=False)',
        '    self.load_optimizer_state(state["optim"], full=False)',
        "finally:",
        "    dist.barrier()",
        "    if self.rank == 0:",
        "        shutil.rmtree(directory, ignore_errors=True)",
    ]
    lines += [*restore, "self.oracle.reload(keep_optimizer=True)"]
    lines.append('self.check_params("after loading into a freshly sharded model")')
    return "def native_checkpoint(self) -> None:\n" + _indent(lines, 1) + "\n"


def _optim_method(uses: _Uses) -> str:
    """A resumed job: copies of the model's and the optimizer's state dicts, loaded into a freshly
    built and sharded model and its new optimizer, which go on (as ``run`` does it)."""
    doc = [
        '"""A resumed job: copies of the model\'s and the optimizer\'s state dicts, loaded into a freshly',
        'built and sharded model (other initial values) and its new optimizer, which go on."""',
    ]
    parameter = ""
    if uses.backend != ZERO:
        kinds = uses.optim_kinds
        parameter = ", full: bool" if len(kinds) == 2 else ""
        full = "full" if len(kinds) == 2 else f"full={kinds == {'full'}}"
        save = [
            f"model_state = copy.deepcopy(self.model_state_dict({full}))",
            f"optim_state = copy.deepcopy(self.optimizer_state_dict({full}))",
        ]
        load = [f"self.load_model_state(model_state, {full})", f"self.load_optimizer_state(optim_state, {full})"]
    else:
        save = ["model_state = self.full_state_dict()  # copies"]
        if uses.zero_optimizer:
            save += [
                "# ZeroRedundancyOptimizer consolidates the whole state on rank 0, which sends it to the others.",
                "self.optimizer.consolidate_state_dict(to=0)",
                "whole = [self.optimizer.state_dict() if self.rank == 0 else None]",
                "dist.broadcast_object_list(whole, src=0)",
                "optim_state = copy.deepcopy(whole[0])",
            ]
        else:
            save.append("optim_state = copy.deepcopy(self.optimizer.state_dict())")
        load = ["self.load_model_state(model_state)", "self.optimizer.load_state_dict(optim_state)"]
    keep, build, restore = _rebuild_lines(uses)
    lines = [
        *doc,
        *save,
        *keep,
        build,
        *load,
        *restore,
        "# Gradients do not travel in state dicts: the oracle drops its own and keeps its optimizer.",
        "self.oracle.reload(keep_optimizer=True)",
        'self.check_params("after loading model and optimizer state into a freshly sharded model")',
    ]
    return f"def optimizer_round_trip(self{parameter}) -> None:\n" + _indent(lines, 1) + "\n"


# -- main: the operations in order ---------------------------------------------------------------
def _operation_lines(uses: _Uses, op: Operation) -> list[str]:
    """The native calls (or the Run method) of one operation."""
    if isinstance(op, Backward):
        if uses.divergent_route:
            return ["run.first_pass_in_divergent_orders()"]
        if op.no_sync:
            return [f"run.forward_backward(micro_batches={op.micro_batches}, no_sync=True)"]
        return [f"run.forward_backward(micro_batches={op.micro_batches})"]
    if isinstance(op, ZeroGrad):
        return [
            f"run.optimizer.zero_grad(set_to_none={op.set_to_none})",
            f"run.oracle.optimizer.zero_grad(set_to_none={op.set_to_none})",
        ]
    if isinstance(op, Step):
        return ["run.optimizer.step()", "run.oracle.optimizer.step()", 'run.check_params("after the step")']
    if isinstance(op, SetMode):
        return [f"run.sharded.train({op.train})", f"run.oracle.model.train({op.train})"]
    if isinstance(op, EvalForward):
        return ["run.eval_forward()"]
    if isinstance(op, SwapRoute):
        if op.odd_ranks_only:
            return ["run.model.swapped = rank % 2 == 1  # only the odd ranks swap: the ranks disagree"]
        return ["run.model.swapped = not run.model.swapped", "run.oracle.model.swapped = not run.oracle.model.swapped"]
    if isinstance(op, Unshard):
        options = ", ".join(f"{name}=True" for name in _unshard_parameters(uses) if getattr(op, name))
        return [f"run.unshard({options})"]
    if isinstance(op, SaveLoad):
        if op.kind == "native":
            return ["run.native_checkpoint()"]
        kinds = uses.save_kinds - {"native"}
        if len(kinds) == 2 and uses.backend != ZERO:
            return [f"run.save_load(full={op.kind == 'full'})"]
        return ["run.save_load()"]
    if isinstance(op, OptimRoundTrip):
        if len(uses.optim_kinds) == 2 and uses.backend != ZERO:
            return [f"run.optimizer_round_trip(full={op.kind == 'full'})"]
        return ["run.optimizer_round_trip()"]
    raise TypeError(f"export: no script for operation {op!r}; add it to conformance/programs/export.py")


def _main(uses: _Uses) -> str:
    program = uses.program
    lines = [
        "if USE_CUDA:",
        "    torch.cuda.set_device(DEVICE)",
        'dist.init_process_group("nccl" if USE_CUDA else "gloo")',
        "rank = dist.get_rank()",
        "if dist.get_world_size() != WORLD_SIZE:",
        "    dist.destroy_process_group()",
        '    raise SystemExit(f"this program runs on {WORLD_SIZE} ranks: torchrun --nproc-per-node {WORLD_SIZE}")',
    ]
    if uses.setup.check_exec_order:
        lines += [
            "# FSDP1 checks the forward order only at debug level DETAIL, decided when a unit is built.",
            "dist.set_debug_level(dist.DebugLevel.DETAIL)",
        ]
    argument = ""
    if uses.mesh == "hybrid":
        names = ", ".join(f'"{name}"' for name in HYBRID_DIM_NAMES)
        lines.append(f"mesh = init_device_mesh(DEVICE.type, HYBRID_MESH_SHAPE, mesh_dim_names=({names}))")
        argument = ", mesh"
    elif uses.mesh == "replicate":
        names = ", ".join(f'"{name}"' for name in HYBRID_DIM_NAMES)
        lines.append(f"mesh = init_device_mesh(DEVICE.type, (WORLD_SIZE, 1), mesh_dim_names=({names}))")
        argument = ", mesh"
    elif uses.mesh == "2-D":
        lines.append('mesh = init_device_mesh(DEVICE.type, (DP_SIZE, TP_SIZE), mesh_dim_names=("dp", "tp"))')
        argument = ", mesh"
    lines.append(f"run = Run(rank{argument})")
    for index, op in enumerate(program.operations):
        description = op.describe()
        lines += ["", f"with run.op({index}, {json.dumps(description)}):"]
        lines += ["    " + line for line in _operation_lines(uses, op)]
    if not uses.divergent_route:
        lines += ["", 'run.check_params("at the end")']
    lines += [
        "",
        "# Every rank's count of mismatches: the exit status says whether any rank found one.",
        "found = torch.tensor([run.mismatches], device=DEVICE)",
        "dist.all_reduce(found)",
        "dist.destroy_process_group()",
        "if found.item():",
        "    if rank == 0:",
        '        print(f"FAILED: {found.item()} mismatches with the single-process oracle (above)", flush=True)',
        "    return 1",
        "if rank == 0:",
        '    print("OK: the program matches the single-process oracle", flush=True)',
        "return 0",
    ]
    return "def main() -> int:\n" + _indent(lines, 1) + "\n"


_ENTRY_POINT = '\n\nif __name__ == "__main__":\n    sys.exit(main())\n'
