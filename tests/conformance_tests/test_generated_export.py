"""``--export-repro``: the standalone torchrun scripts of generated programs run, agree with the
single-process oracle where the backend is right, and fail where it is not.

Each exported script runs as a user would run it: ``python -m torch.distributed.run
--nproc-per-node 2 <script>`` in a subprocess (CPU, gloo), from a directory outside the
repository, so an import of the suite would fail. The programs are fixed and few (one torchrun
costs ten to twenty seconds on two cores) and cover, between them: units auto-wrapped, by FQN
(leaves, mixed strategies) and nested; uneven data (FSDP1, auto-wrapped); tied blocks (DDP);
parameter groups (FSDP2, ZeroRedundancyOptimizer); models built on the meta device and
materialized by the backend (FSDP1's param_init_fn with nested units, FSDP2's to_empty with CPU
offload and a NO_SHARD unit; DDP's linted only);
activation-checkpointed blocks (with FSDP1's mixed precision and with FSDP2's clipping); mixed
precision with float32 reduction; micro-batches
without gradient sync; ``zero_grad(set_to_none=False)``; SGD and Adam; unshard with a
written-back write and with gradients (a frozen block among them); full and sharded state dicts
and torch.distributed.checkpoint; resumed jobs (model and optimizer state dicts into a freshly
sharded model: full, sharded, ZeroRedundancyOptimizer's consolidated one); eval forwards; a swap
of the route, which FSDP1's forward-order check warns about; FSDP1's refusal of a first
iteration whose order differs between ranks; and a 2-D program (tensor parallelism over a
(dp, tp) mesh, world size 4). Two scripts must fail: FSDP1's HYBRID_SHARD on a (2, 1) mesh (a
defect recorded in ``conformance/expectations/torch-fsdp1.toml``), and a script whose sharded
side alone was given another learning rate (the checks are live), into which an error is also
injected (it names its operation). Further scripts are only written and linted
(``LINTED_ONLY``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.programs import export
from conformance.programs.program import (
    Backward,
    ClipStep,
    EvalForward,
    ModelShape,
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
from conformance.programs.shadow import SGD_LR
from conformance.protocol import ApiForm, ShardingStrategy

REPO = Path(__file__).resolve().parents[2]
SCRIPT_TIMEOUT_S = 150
OK_LINE = "OK: the program matches the single-process oracle"
ALLOWED_IMPORTS = {"contextlib", "copy", "math", "os", "shutil", "sys", "tempfile", "torch", "warnings"}

FSDP1_AUTO = Program(
    world_size=2,
    model=ModelShape(in_width=4, width=5, out_width=3, depth=3, buffers=True, frozen=(1,)),
    setup=Setup(ShardingStrategy.FULL_SHARD, ApiForm.WRAPPER, unit_plan="auto", check_exec_order=True),
    operations=(
        Backward(2, no_sync=True),
        Step(),
        ZeroGrad(set_to_none=False),
        SwapRoute(),
        Backward(),
        ClipStep(),
        Unshard(writeback=True, write=True),
        SaveLoad("full"),
        Backward(),
        Step(),
        SetMode(train=False),
        EvalForward(),
    ),
    seed=11,
    uneven_data=True,
)
FSDP1_NESTED_MIXED_PRECISION = Program(
    world_size=2,
    model=ModelShape(in_width=3, width=7, out_width=2, depth=2, checkpointed=True, deferred_init=True),
    setup=Setup(
        ShardingStrategy.SHARD_GRAD_OP,
        ApiForm.WRAPPER,
        unit_plan="nested",
        param_dtype="float16",
        reduce_fp32=True,
        optimizer="adam",
    ),
    operations=(
        Backward(),
        Step(),
        OptimRoundTrip("full"),
        SetMode(train=False),
        EvalForward(),
        SetMode(train=True),
        SaveLoad("sharded"),
        Backward(),
        Step(),
    ),
    seed=5,
)
FSDP1_DIVERGENT_FIRST_ORDER = Program(
    world_size=2,
    model=ModelShape(in_width=4, width=4, out_width=4, depth=2),
    setup=Setup(ShardingStrategy.FULL_SHARD, ApiForm.WRAPPER, unit_plan="leaves", check_exec_order=True),
    operations=(SwapRoute(odd_ranks_only=True), Backward()),
    seed=1,
)
FSDP2_MIXED_OFFLOAD = Program(
    world_size=2,
    model=ModelShape(in_width=3, width=7, out_width=2, depth=2, buffers=True, deferred_init=True),
    setup=Setup(
        ShardingStrategy.FULL_SHARD,
        ApiForm.COMPOSABLE,
        unit_plan="mixed",
        other_strategy=ShardingStrategy.NO_SHARD,
        offload_params=True,
        optimizer="adam",
    ),
    operations=(
        Backward(2, no_sync=True),
        Step(),
        Unshard(),
        SaveLoad("native"),
        Backward(),
        Step(),
        OptimRoundTrip("sharded"),
        SwapRoute(),
        SetMode(train=False),
        EvalForward(),
    ),
    seed=4,
)
# DistributedDataParallel with ZeroRedundancyOptimizer (ZeRO-1), one program for both (one
# torchrun less); the composable replicate() form is linted only (LINTED_ONLY).
ZERO_DDP_ZERO1 = Program(
    world_size=2,
    model=ModelShape(in_width=4, width=5, out_width=3, depth=3, buffers=True, frozen=(2,), tied=True),
    setup=Setup(ShardingStrategy.SHARD_OPTIM_STATE, ApiForm.WRAPPER, optimizer="adam", param_groups=True),
    operations=(
        Backward(3, no_sync=True),
        Step(),
        ZeroGrad(set_to_none=False),
        Backward(),
        Step(),
        Unshard(writeback=True, with_grads=True, write=True),
        OptimRoundTrip("full"),
        SetMode(train=False),
        EvalForward(),
        SetMode(train=True),
        SaveLoad("full"),
        SwapRoute(),
        Backward(),
        ClipStep(),
    ),
    seed=2,
)
ZERO_REPLICATE = Program(
    world_size=2,
    model=ModelShape(in_width=3, width=7, out_width=2, depth=2, deferred_init=True),
    setup=Setup(ShardingStrategy.NO_SHARD, ApiForm.COMPOSABLE),
    operations=(Backward(2, no_sync=True), Step(), OptimRoundTrip("full"), SetMode(train=False), EvalForward()),
    seed=6,
)
# 2-D at world size 4: blocks 0 and 1 tensor-parallel over "tp", the model sharded over "dp"; the
# ranks of one dp group feed one batch. Sharded (layout checked) and full state dict round trips.
TWO_D = Program(
    world_size=4,
    model=ModelShape(in_width=3, width=4, out_width=3, depth=3),
    setup=Setup(
        ShardingStrategy.FULL_SHARD, ApiForm.COMPOSABLE, unit_plan="leaves", optimizer="adam", tensor_parallel=True
    ),
    operations=(
        Backward(2),
        Step(),
        SaveLoad("sharded"),
        SetMode(train=False),
        EvalForward(),
        SetMode(train=True),
        ZeroGrad(),
        Backward(),
        Step(),
        SaveLoad("full"),
        Backward(),
        Step(),
    ),
    seed=13,
)
# Clipping over DTensor gradients (torch's clip_grad_norm_ returns a DTensor norm), a frozen block,
# activation-checkpointed blocks and both optimizer round trips.
FSDP2_CLIPPED = Program(
    world_size=2,
    model=ModelShape(in_width=3, width=5, out_width=2, depth=2, frozen=(0,), checkpointed=True),
    setup=Setup(
        ShardingStrategy.SHARD_GRAD_OP, ApiForm.COMPOSABLE, unit_plan="auto", optimizer="adam", param_groups=True
    ),
    operations=(Backward(), ClipStep(), OptimRoundTrip("full"), Backward(), Step(), OptimRoundTrip("sharded")),
    seed=8,
)
PASSING = [
    pytest.param("torch-fsdp1", FSDP1_AUTO, id="fsdp1-auto-uneven-order-swap-no_sync-writeback-full-eval"),
    pytest.param(
        "torch-fsdp1", FSDP1_NESTED_MIXED_PRECISION, id="fsdp1-nested-fp16-checkpointed-deferred-adam-eval-sharded"
    ),
    pytest.param("torch-fsdp1", FSDP1_DIVERGENT_FIRST_ORDER, id="fsdp1-divergent-first-order-refused"),
    pytest.param("torch-fsdp2", FSDP2_MIXED_OFFLOAD, id="fsdp2-mixed-offload-deferred-native-swap-eval"),
    pytest.param("torch-zero", ZERO_DDP_ZERO1, id="zero-ddp-zero1-tied-no_sync-unshard-grads-optim-eval-full"),
    pytest.param("torch-fsdp2", TWO_D, id="fsdp2-2d-tp-sharded-full-eval"),
    pytest.param("torch-fsdp2", FSDP2_CLIPPED, id="fsdp2-clip-checkpointed-both-optim-round-trips"),
]
# Written and linted, not run (each run costs ten seconds or more): FSDP1's form of the 2-D program
# (the 2-D mesh's dp dimension as device_mesh) and the composable replicate() form.
LINTED_ONLY = [
    pytest.param("torch-fsdp1", TWO_D, id="fsdp1-2d"),
    pytest.param("torch-zero", ZERO_REPLICATE, id="zero-replicate"),
]


def run_script(path: Path, world_size: int) -> subprocess.CompletedProcess[str]:
    """Run an exported script as a user would: torchrun on CPU, outside the repository."""
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    environment.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world_size), str(path)]
    try:
        return subprocess.run(
            command,
            cwd=path.parent,
            env=environment,
            capture_output=True,
            text=True,
            timeout=SCRIPT_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as expired:
        raise AssertionError(
            f"{path.name} ran past {SCRIPT_TIMEOUT_S} s (a hang between its ranks?); output so far:\n"
            f"{expired.stdout}\n{expired.stderr}"
        ) from None


def exported(backend: str, program: Program, directory: Path) -> Path:
    line = export.export_repro(backend, program, str(directory))
    path = directory / export.script_name(backend)
    assert line == (
        f"standalone repro: torchrun --nproc-per-node {program.world_size} {path} "
        f"(torch only; CPU with gloo, or CUDA with NCCL when {program.world_size} GPUs are visible)"
    )
    return path


@pytest.mark.parametrize(("backend_name", "program"), PASSING)
def test_exported_script_matches_the_oracle(backend_name: str, program: Program, tmp_path: Path) -> None:
    """A program the backend runs right: the script prints OK and exits 0."""
    path = exported(backend_name, program, tmp_path)
    result = run_script(path, program.world_size)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and OK_LINE in result.stdout, (
        f"{path.name} exited {result.returncode}:\n{output[-6000:]}\n--- the script ---\n{path.read_text()}"
    )
    if program is FSDP1_DIVERGENT_FIRST_ORDER:
        assert result.stdout.count("refused, as it should be") == 2, result.stdout
    if program is TWO_D:
        text = path.read_text()
        assert 'init_device_mesh(DEVICE.type, (DP_SIZE, TP_SIZE), mesh_dim_names=("dp", "tp"))' in text
        assert 'self.sharded = shard(self.model, self.mesh["dp"])' in text
        assert "self.check_sharded_layout(state)" in text


def test_recorded_defect_fails_the_script(tmp_path: Path) -> None:
    """FSDP1's HYBRID_SHARD on a (2, 1) mesh never all-reduces gradients across the replicas (the
    defect torch-fsdp1.toml records): the script names the parameters that differ and exits 1."""
    program = Program(
        world_size=2,
        model=ModelShape(in_width=2, width=6, out_width=5, depth=2),
        setup=Setup(ShardingStrategy.HYBRID_SHARD, ApiForm.WRAPPER, unit_plan="none"),
        operations=(Backward(), Step()),
        seed=9,
    )
    path = exported("torch-fsdp1", program, tmp_path)
    assert "HYBRID_MESH_SHAPE = (2, 1)" in path.read_text()
    result = run_script(path, program.world_size)
    assert result.returncode != 0, result.stdout
    assert OK_LINE not in result.stdout
    for rank in (0, 1):
        assert f"rank {rank}, op 0 (forward + backward): the full gradients after backward differ" in result.stdout
        assert f"rank {rank}, op 1 (optimizer step): the full state dict after the step differ" in result.stdout
    assert "inp.weight: max abs difference" in result.stdout, result.stdout


def test_a_different_sharded_learning_rate_fails_the_script(tmp_path: Path) -> None:
    """The checks are live: with the sharded optimizer's learning rate alone changed, every
    trained parameter differs after the step, and the script says which. And an operation that
    raises (one injected into the next backward) ends the run: the error names the operation, and
    the exit status is not 0."""
    program = Program(
        world_size=2,
        model=ModelShape(in_width=3, width=4, out_width=2, depth=2, frozen=(1,)),
        setup=Setup(ShardingStrategy.FULL_SHARD, ApiForm.COMPOSABLE, unit_plan="leaves"),
        operations=(Backward(), Step(), Backward()),
        seed=3,
    )
    path = exported("torch-fsdp2", program, tmp_path)
    text = path.read_text()
    sharded, oracle = f"SHARDED_LR = {SGD_LR!r}\n", f"ORACLE_LR = {SGD_LR!r}\n"
    assert text.count(sharded) == 1 and text.count(oracle) == 1, "the rates come from conformance.programs.shadow"
    text = text.replace(sharded, f"SHARDED_LR = {2 * SGD_LR!r}\n")
    call = "run.forward_backward(micro_batches=1)"
    backward = f'with run.op(2, "forward + backward"):\n        {call}\n'
    assert text.count(backward) == 1, text
    path.write_text(text.replace(backward, backward.replace(call, 'raise ValueError("injected")')))
    result = run_script(path, program.world_size)
    assert result.returncode != 0, result.stdout
    assert OK_LINE not in result.stdout
    for rank in (0, 1):
        assert f"rank {rank}, op 2 (forward + backward): raised ValueError: injected" in result.stdout, result.stdout
    assert "rank 0, op 0" not in result.stdout, "the losses of the first pass do not depend on the rate"
    trained = ["inp.weight", "inp.bias", "blocks.0.linear.weight", "blocks.0.linear.bias", "out.weight", "out.bias"]
    for rank in (0, 1):
        report = result.stdout.split(f"rank {rank}, op 1 (optimizer step): the full state dict after the step")[1]
        shown = report.split("\nrank ")[0]
        assert "6 of 8" in shown, shown
        for name in trained:
            assert f"  {name}: max abs difference" in shown, shown
        assert "blocks.1.linear" not in shown, "a frozen block does not train: the rates cannot differ there"


@pytest.mark.parametrize(
    ("backend_name", "why"),
    [
        ("torch-zero", "torch-zero does not declare TENSOR_PARALLEL"),
        ("torch-fsdp2", "refuses a given mesh (ValueError)"),
    ],
)
def test_two_d_programs_without_a_native_form_get_no_script(backend_name: str, why: str, tmp_path: Path) -> None:
    """A 2-D NO_SHARD program, which the suite's adapter itself refuses: one line that says why,
    nothing written."""
    setup = Setup(ShardingStrategy.NO_SHARD, ApiForm.COMPOSABLE, tensor_parallel=True)
    program = Program(world_size=4, model=TWO_D.model, setup=setup, operations=(Backward(),), seed=1)
    line = export.export_repro(backend_name, program, str(tmp_path / "out"))
    assert line.startswith(f"standalone repro: none written for {backend_name}: ") and why in line, line
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="no standalone script for this program"):
        export.repro_script(backend_name, program)


@pytest.mark.parametrize("backend_name", ["reference", "deepspeed"])
def test_other_backends_get_no_script(backend_name: str, tmp_path: Path) -> None:
    """A backend whose library is not torch's own: one line that says why, and nothing written."""
    line = export.export_repro(backend_name, FSDP1_AUTO, str(tmp_path / "out"))
    assert line.startswith(f"standalone repro: none written for {backend_name}: ")
    assert "is not torch's own" in line and "REPRO line" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(
    importlib.util.find_spec("ruff") is None,
    reason="ruff is not installed (pip install -e '.[test]' installs the pinned version)",
)
def test_exported_scripts_import_only_torch_and_pass_ruff(tmp_path: Path) -> None:
    """Every script above passes ``ruff check`` (the repository's rules) and imports nothing of the suite."""
    paths = []
    for index, parameters in enumerate(PASSING + LINTED_ONLY):
        backend, program = parameters.values
        path = tmp_path / f"{index}-{export.script_name(backend)}"
        path.write_text(export.repro_script(backend, program))
        imported = {
            line.split()[1].split(".")[0]
            for line in path.read_text().splitlines()
            if line.startswith(("import ", "from "))
        }
        assert imported <= ALLOWED_IMPORTS, f"{path.name} imports {sorted(imported - ALLOWED_IMPORTS)}"
        paths.append(str(path))
    config = REPO / "pyproject.toml"
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--config", str(config), *paths],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
