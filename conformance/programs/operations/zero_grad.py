"""The optimizer's gradients cleared: ``ZeroGrad(set_to_none)``."""

from __future__ import annotations

from conformance.programs.operations import handler
from conformance.programs.program import ZeroGrad


class ZeroGradHandler(handler.OperationHandler):
    kind = ZeroGrad

    def examples(self) -> list[ZeroGrad]:
        return [ZeroGrad(True), ZeroGrad(False)]

    def choices(self, context: handler.DrawContext, state: handler.DrawState) -> list[ZeroGrad]:
        # set_to_none=False only where the adapter's zero_grad hook takes the keyword.
        keeps_zeros = context.declared.zero_grad_keeps_zeros and not context.two_d
        return [ZeroGrad(True), ZeroGrad(False)] if keeps_zeros else [ZeroGrad(True)]

    def advance(self, state: handler.DrawState, op: ZeroGrad) -> None:
        if op.set_to_none:
            # No gradient left to step with: a step needs a backward first again.
            state.grads_exist = state.backward_since_step = False

    def facts(self, op: ZeroGrad) -> handler.OperationFacts:
        return handler.OperationFacts(zeroes_gradients=True, drops_gradients=op.set_to_none)

    def oracle(self, shadow: handler.Shadow, op: ZeroGrad) -> None:
        shadow.zero_grad(op.set_to_none)

    def run(self, run: handler.ProgramRun, op: ZeroGrad) -> bool:
        if op.set_to_none:
            run.adapter.zero_grad(run.sharded, run.optimizer)
        else:
            run.adapter.zero_grad(run.sharded, run.optimizer, set_to_none=False)  # type: ignore[call-arg]
        self.oracle(run.shadow, op)
        return False

    def script_lines(self, uses: handler.Uses, op: ZeroGrad) -> list[str]:
        return [
            f"run.optimizer.zero_grad(set_to_none={op.set_to_none})",
            f"run.oracle.optimizer.zero_grad(set_to_none={op.set_to_none})",
        ]
