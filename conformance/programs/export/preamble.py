"""The script's opening: the header comment (the program, how to run it, what it checks), the imports
and the constants.
"""

from __future__ import annotations

import textwrap

import torch

from conformance.programs.export.uses import FSDP1, FSDP2, ORDER_WARNING, ZERO, Uses, script_name, tolerance_literal
from conformance.programs.model import build_model
from conformance.programs.program import LOCAL_BATCH, TENSOR_PARALLEL_DEGREE, Backward, ClipStep, EvalForward, Unshard
from conformance.programs.shadow import ADAM_LR, EVAL_ITERATIONS, FRESH_SEED_OFFSET, SGD_LR, WEIGHT_DECAY
from conformance.programs.tolerances import bounds_for
from conformance.protocol import ApiForm
from fixtures.meshes import hybrid_shard_group_size


# -- header ------------------------------------------------------------------------------------
def _backend_words(uses: Uses) -> str:
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


def header_part(uses: Uses) -> str:
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
def imports_part(uses: Uses) -> str:
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

    if uses.program.model.checkpointed:
        need("torch.utils.checkpoint", "checkpoint")
    if uses.program.model.deferred_init and uses.backend == FSDP2:
        need("torch.distributed.tensor", "DTensor", "distribute_tensor")
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


# -- constants ---------------------------------------------------------------------------------
def constants_part(uses: Uses) -> str:
    program, shape = uses.program, uses.program.model
    lr = ADAM_LR if uses.setup.optimizer == "adam" else SGD_LR
    lines = [
        f"WORLD_SIZE = {program.world_size}",
        f"SEED = {program.seed}  # the program's seed: the initial values and every batch derive from it",
        f"IN_WIDTH, WIDTH, OUT_WIDTH, DEPTH = {shape.in_width}, {shape.width}, {shape.out_width}, {shape.depth}",
        (
            f"LOCAL_BATCH = {LOCAL_BATCH}  # rank r feeds LOCAL_BATCH + r samples in each forward (uneven data)"
            if program.uneven_data
            else f"LOCAL_BATCH = {LOCAL_BATCH}  # samples per rank in each forward"
        ),
        "# The learning rates of the sharded model's optimizer and of the oracle's, apart: the same value.",
        f"SHARDED_LR = {lr!r}",
        f"ORACLE_LR = {lr!r}",
    ]
    if uses.setup.param_groups:
        lines.append(f"WEIGHT_DECAY = {WEIGHT_DECAY}  # the weights' group (biases: none)")
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
        f"PARAM_TOLERANCE = {tolerance_literal(bounds.params)}  # rtol, atol, scaled_atol",
    ]
    if uses.has(ClipStep):
        model = build_model(shape, program.seed, torch.device("cpu"))
        trained = sum(param.numel() for param in model.parameters() if param.requires_grad)
        lines.append(
            f"GRAD_NORM_RTOL = {bounds.norm_rtol(trained)!r}  # a returned gradient norm, relative to the oracle's"
        )
    if uses.reads_grads:
        lines.append(f"GRAD_TOLERANCE = {tolerance_literal(bounds.grads)}")
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
