"""Blocks 0 and 1 swap places in the forward: ``SwapRoute(odd_ranks_only)``."""

from __future__ import annotations

from conformance.programs.operations import handler
from conformance.programs.program import SwapRoute


class SwapRouteHandler(handler.OperationHandler):
    kind = SwapRoute

    def examples(self) -> list[SwapRoute]:
        return [SwapRoute(), SwapRoute(odd_ranks_only=True)]

    def choices(self, context: handler.DrawContext, state: handler.DrawState) -> list[SwapRoute]:
        # The rank-divergent swap is never a choice: it is a program of its own (draw.operations),
        # the first iteration's misuse, which ends at its refusal.
        return [SwapRoute()] if context.shape.depth >= 2 and not context.two_d else []

    def advance(self, state: handler.DrawState, op: SwapRoute) -> None:
        pass  # the route is the model's; no operation's precondition reads it

    def facts(self, op: SwapRoute) -> handler.OperationFacts:
        return handler.OperationFacts()  # the misuse program is Program.divergent_order

    def oracle(self, shadow: handler.Shadow, op: SwapRoute) -> None:
        if not op.odd_ranks_only:  # ranks that disagree have no single-process equivalent
            shadow.swap_route()

    def run(self, run: handler.ProgramRun, op: SwapRoute) -> bool:
        if op.odd_ranks_only:
            run.divergent_route = True
            if run.rank % 2 == 1:
                run.model.swapped = not run.model.swapped
        else:
            run.model.swapped = not run.model.swapped
        self.oracle(run.shadow, op)
        return False

    def script_lines(self, uses: handler.Uses, op: SwapRoute) -> list[str]:
        if op.odd_ranks_only:
            return ["run.model.swapped = rank % 2 == 1  # only the odd ranks swap: the ranks disagree"]
        return ["run.model.swapped = not run.model.swapped", "run.oracle.model.swapped = not run.oracle.model.swapped"]
