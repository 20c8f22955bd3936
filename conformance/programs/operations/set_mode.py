"""Training or eval mode: ``SetMode(train)``."""

from __future__ import annotations

from conformance.programs.operations import handler
from conformance.programs.program import SetMode


class SetModeHandler(handler.OperationHandler):
    kind = SetMode

    def examples(self) -> list[SetMode]:
        return [SetMode(False), SetMode(True)]

    def choices(self, context: handler.DrawContext, state: handler.DrawState) -> list[SetMode]:
        return [SetMode(not state.training)]

    def advance(self, state: handler.DrawState, op: SetMode) -> None:
        state.training = op.train

    def facts(self, op: SetMode) -> handler.OperationFacts:
        return handler.OperationFacts()

    def oracle(self, shadow: handler.Shadow, op: SetMode) -> None:
        shadow.set_mode(op.train)

    def run(self, run: handler.ProgramRun, op: SetMode) -> bool:
        run.sharded.train(op.train)
        self.oracle(run.shadow, op)
        return False

    def script_lines(self, uses: handler.Uses, op: SetMode) -> list[str]:
        return [f"run.sharded.train({op.train})", f"run.oracle.model.train({op.train})"]
