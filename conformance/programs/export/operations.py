"""The script's remaining operation methods (unshard, save and load, native checkpoints, optimizer
round trips), and ``main``: each operation's call lines are its handler's
(``conformance.programs.operations``).
"""

from __future__ import annotations

import json

from conformance.programs.export.uses import FSDP1, FSDP2, ZERO, Uses, block, indented, unshard_parameters
from conformance.programs.program import (
    Unshard,
)
from fixtures.meshes import HYBRID_DIM_NAMES


def unshard_method(uses: Uses) -> str:
    ops = uses.all_of(Unshard)
    writes = any(op.write for op in ops)
    rank0 = any(op.rank0_only for op in ops)
    with_grads = uses.unshard_reads_grads
    reads_grads = uses.grads_checked or with_grads
    shown = "self.shown(grads=False)" if reads_grads else "self.shown()"
    parameters = unshard_parameters(uses)
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
    return signature + "\n" + indented(lines, 1) + "\n"


def save_load_method(uses: Uses) -> str:
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
    method = f"def save_load(self{parameter}) -> None:\n" + indented([*doc.split("\n"), *lines], 1) + "\n"
    if "sharded" in kinds:
        method += "\n" + block(
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


def _rebuild_lines(uses: Uses) -> tuple[list[str], str, list[str]]:
    """What the program set on the model (route, mode) kept, the fresh build, and the restore."""
    keep, restore = [], []
    if uses.swaps:
        keep.append("swapped = self.model.swapped")
        restore.append("self.model.swapped = swapped")
    if uses.mode_changes:
        keep.append("training = self.oracle.model.training")
        restore += ["if not training:", "    self.sharded.train(False)"]
    return keep, "self.build(SEED + FRESH_SEED_OFFSET)", restore


def native_method(uses: Uses) -> str:
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
    return "def native_checkpoint(self) -> None:\n" + indented(lines, 1) + "\n"


def optim_method(uses: Uses) -> str:
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
    return f"def optimizer_round_trip(self{parameter}) -> None:\n" + indented(lines, 1) + "\n"


# -- main: the operations in order ---------------------------------------------------------------
def main_part(uses: Uses) -> str:
    # Imported here: the handlers use this package's names (what a script's uses are).
    from conformance.programs.operations import handler_for

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
        lines += ["    " + line for line in handler_for(op).script_lines(uses, op)]
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
    return "def main() -> int:\n" + indented(lines, 1) + "\n"
