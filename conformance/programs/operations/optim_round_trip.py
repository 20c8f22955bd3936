"""A resumed job: the model's and the optimizer's state dicts into a freshly sharded model and
its new optimizer, ``OptimRoundTrip(kind)``."""

from __future__ import annotations

import copy

from conformance.programs.export.uses import ZERO
from conformance.programs.operations import handler
from conformance.programs.program import OptimRoundTrip
from conformance.protocol import StateDictKind

KINDS = ("full", "sharded")


class OptimRoundTripHandler(handler.OperationHandler):
    kind = OptimRoundTrip

    def examples(self) -> list[OptimRoundTrip]:
        return [OptimRoundTrip(kind) for kind in KINDS]

    def choices(self, context: handler.DrawContext, state: handler.DrawState) -> list[OptimRoundTrip]:
        if context.two_d or not state.stepped:
            return []  # an optimizer with no state has nothing to carry over
        return [OptimRoundTrip(kind) for kind in KINDS if context.admits(OptimRoundTrip(kind).requirements())]

    def advance(self, state: handler.DrawState, op: OptimRoundTrip) -> None:
        state.grads_exist = state.backward_since_step = False

    def facts(self, op: OptimRoundTrip) -> handler.OperationFacts:
        return handler.OperationFacts(zeroes_gradients=True, drops_gradients=True, optimizer_state_loaded=True)

    def oracle(self, shadow: handler.Shadow, op: OptimRoundTrip) -> None:
        # Gradients do not travel in state dicts: the oracle drops its own, keeps its optimizer.
        shadow.reload(keep_optimizer=True)

    def run(self, run: handler.ProgramRun, op: OptimRoundTrip) -> bool:
        """As a resumed job does (and ``test_optim_state_dict_round_trip``): copies of both state
        dicts, loaded into a freshly sharded model and its new optimizer."""
        kind = StateDictKind(op.kind)
        model_state = copy.deepcopy(run.adapter.state_dict(run.sharded, kind))
        optim_state = copy.deepcopy(run.adapter.optim_state_dict(run.sharded, run.optimizer, kind))
        with run.fresh_model():
            run.adapter.load_state_dict(run.sharded, model_state, kind)
            run.adapter.load_optim_state_dict(run.sharded, run.optimizer, optim_state, kind)
        self.oracle(run.shadow, op)
        run.check_params("after loading model and optimizer state into a freshly sharded model")
        return False

    def script_lines(self, uses: handler.Uses, op: OptimRoundTrip) -> list[str]:
        if len(uses.optim_kinds) == 2 and uses.backend != ZERO:
            return [f"run.optimizer_round_trip(full={op.kind == 'full'})"]
        return ["run.optimizer_round_trip()"]
