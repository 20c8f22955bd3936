"""An optimizer step: ``Step()``."""

from __future__ import annotations

from conformance.programs.operations import handler
from conformance.programs.program import Step
from conformance.protocol import Phase, Stored


class StepHandler(handler.OperationHandler):
    kind = Step

    def examples(self) -> list[Step]:
        return [Step()]

    def choices(self, context: handler.DrawContext, state: handler.DrawState) -> list[Step]:
        return [Step()] if state.backward_since_step else []

    def advance(self, state: handler.DrawState, op: Step) -> None:
        state.backward_since_step = False
        state.stepped = True

    def facts(self, op: Step) -> handler.OperationFacts:
        return handler.OperationFacts(steps=True)

    def oracle(self, shadow: handler.Shadow, op: Step) -> None:
        shadow.step()

    def run(self, run: handler.ProgramRun, op: Step) -> bool:
        run.adapter.step(run.sharded, run.optimizer)
        self.oracle(run.shadow, op)
        run.check_params("after the step")
        for stored in Stored:
            run.check_storage(stored, Phase.AT_REST)
        return False

    def script_lines(self, uses: handler.Uses, op: Step) -> list[str]:
        return ["run.optimizer.step()", "run.oracle.optimizer.step()", 'run.check_params("after the step")']
