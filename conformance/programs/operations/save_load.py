"""A model saved and loaded into a freshly sharded one: ``SaveLoad(kind)``, a full or sharded
state dict (a new optimizer after it) or a native checkpoint (with the optimizer)."""

from __future__ import annotations

import shutil

import torch.distributed as dist

from conformance.programs.export.uses import ZERO
from conformance.programs.operations import handler
from conformance.programs.program import SaveLoad
from conformance.programs.tolerances import dtype_named
from conformance.protocol import StateDictKind

KINDS = ("full", "sharded", "native")
TWO_D_KINDS = ("full", "sharded")


class SaveLoadHandler(handler.OperationHandler):
    kind = SaveLoad

    def examples(self) -> list[SaveLoad]:
        return [SaveLoad(kind) for kind in KINDS]

    def choices(self, context: handler.DrawContext, state: handler.DrawState) -> list[SaveLoad]:
        kinds = TWO_D_KINDS if context.two_d else KINDS
        return [SaveLoad(kind) for kind in kinds if context.admits(SaveLoad(kind).requirements())]

    def advance(self, state: handler.DrawState, op: SaveLoad) -> None:
        state.grads_exist = state.backward_since_step = False
        if op.kind != "native":
            state.stepped = False  # a new optimizer, no state yet

    def facts(self, op: SaveLoad) -> handler.OperationFacts:
        native = op.kind == "native"
        return handler.OperationFacts(
            zeroes_gradients=True,
            drops_gradients=True,
            fresh_optimizer=not native,
            native_checkpoint=native,
            full_model_load=op.kind == "full",
        )

    def oracle(self, shadow: handler.Shadow, op: SaveLoad) -> None:
        shadow.reload(keep_optimizer=op.kind == "native")

    def run(self, run: handler.ProgramRun, op: SaveLoad) -> bool:
        if op.kind == "native":
            directory = run.shared_directory()
            run.adapter.save_checkpoint(run.sharded, run.optimizer, directory)
            with run.fresh_model():
                run.adapter.load_checkpoint(run.sharded, run.optimizer, directory)
                # Only on success: after a rank raised, its peers may be inside a collective of the
                # backend's, and a barrier here would pair with it (the directory is left behind).
                dist.barrier()
                if run.rank == 0:
                    shutil.rmtree(directory, ignore_errors=True)
                self.oracle(run.shadow, op)
        else:
            kind = StateDictKind(op.kind)
            state = run.adapter.state_dict(run.sharded, kind)
            rounded: set[str] = set()
            if kind is StateDictKind.FULL:
                rounded = run.compare_state(state, "the full state dict saved")
            else:
                run.check_sharded_layout(state)
                rounded = run.in_compute_dtype(state)
            with run.fresh_model():
                run.adapter.load_state_dict(run.sharded, state, kind)
                self.oracle(run.shadow, op)
                # What the state dict held in the compute dtype is all a load can restore.
                run.shadow.round_to(rounded, dtype_named(run.setup.param_dtype))
        run.check_params("after loading into a freshly sharded model")
        return False

    def script_lines(self, uses: handler.Uses, op: SaveLoad) -> list[str]:
        if op.kind == "native":
            return ["run.native_checkpoint()"]
        kinds = uses.save_kinds - {"native"}
        if len(kinds) == 2 and uses.backend != ZERO:
            return [f"run.save_load(full={op.kind == 'full'})"]
        return ["run.save_load()"]
