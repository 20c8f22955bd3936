"""A forward under ``torch.no_grad()`` in whatever mode the model is in: ``EvalForward()``."""

from __future__ import annotations

import warnings

import torch

import fixtures
from conformance.programs.operations import handler
from conformance.programs.program import EvalForward
from conformance.programs.shadow import EVAL_ITERATIONS


class EvalForwardHandler(handler.OperationHandler):
    kind = EvalForward

    def examples(self) -> list[EvalForward]:
        return [EvalForward()]

    def choices(self, context: handler.DrawContext, state: handler.DrawState) -> list[EvalForward]:
        return [] if state.training else [EvalForward()]

    def advance(self, state: handler.DrawState, op: EvalForward) -> None:
        pass  # reads the model, changes nothing a later operation depends on

    def facts(self, op: EvalForward) -> handler.OperationFacts:
        return handler.OperationFacts()

    def oracle(self, shadow: handler.Shadow, op: EvalForward) -> list[float]:
        """Every data rank's loss of the forward."""
        return shadow.eval_losses()

    def run(self, run: handler.ProgramRun, op: EvalForward) -> bool:
        (x,) = fixtures.local_batch(
            run.model,
            seed=run.program.seed,
            iteration=EVAL_ITERATIONS + run.evals,
            rank=run.data_rank,
            batch_size=run.program.batch_size(run.data_rank),
            device=run.device,
        )
        run.evals += 1
        expected = self.oracle(run.shadow, op)[run.data_rank]
        route = run.model.route()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                loss = run.model.loss(run.sharded(x)).item()
        run.check_order_warnings(caught, route, training=False)
        if not run.bounds.losses_close(loss, expected):
            mode = "training" if run.shadow.model.training else "eval"
            run.find(
                f"loss {loss:.9g} under no_grad in {mode} mode, the oracle's {expected:.9g} "
                f"(difference {abs(loss - expected):.3g})",
                f"the loss under no_grad in {mode} mode",
            )
        return False

    def script_lines(self, uses: handler.Uses, op: EvalForward) -> list[str]:
        return ["run.eval_forward()"]
