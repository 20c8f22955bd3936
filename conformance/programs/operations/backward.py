"""Forward and backward passes in training mode: ``Backward(micro_batches, no_sync)``."""

from __future__ import annotations

import contextlib
import warnings

import fixtures
from conformance.programs.operations import handler
from conformance.programs.program import Backward
from conformance.protocol import Capability, Phase, Stored

MICRO_BATCHES = (1, 2, 3)
TWO_D_MICRO_BATCHES = (1, 2)


class BackwardHandler(handler.OperationHandler):
    kind = Backward

    def examples(self) -> list[Backward]:
        return [Backward(k) for k in MICRO_BATCHES] + [Backward(k, no_sync=True) for k in MICRO_BATCHES[1:]]

    def choices(self, context: handler.DrawContext, state: handler.DrawState) -> list[Backward]:
        if not state.training:
            return []
        if context.two_d:
            return [Backward(k) for k in TWO_D_MICRO_BATCHES]
        choices = [Backward(k) for k in MICRO_BATCHES]
        if context.declared.has(Capability.NO_SYNC) and context.admits({Capability.NO_SYNC}):
            choices += [Backward(k, no_sync=True) for k in MICRO_BATCHES[1:]]
        return choices

    def advance(self, state: handler.DrawState, op: Backward) -> None:
        state.backward_since_step = state.grads_exist = True

    def facts(self, op: Backward) -> handler.OperationFacts:
        return handler.OperationFacts(
            backward=True, training_forwards=op.micro_batches, reductions=1 if op.no_sync else op.micro_batches
        )

    def oracle(self, shadow: handler.Shadow, op: Backward) -> list[list[float]]:
        """Every micro-batch's pass of every data rank: the losses, by micro-batch then rank."""
        return [shadow.backward() for _ in range(op.micro_batches)]

    def run(self, run: handler.ProgramRun, op: Backward) -> bool:
        # Ranks that disagree on the order run no oracle: the backend must refuse the first pass.
        expected = self.oracle(run.shadow, op) if not run.divergent_route else []
        for micro_batch in range(op.micro_batches):
            inputs = fixtures.local_batch(
                run.model,
                seed=run.program.seed,
                iteration=run.iteration,
                rank=run.data_rank,
                batch_size=run.program.batch_size(run.data_rank),
                device=run.device,
            )
            run.iteration += 1
            unsynced = op.no_sync and micro_batch < op.micro_batches - 1
            route = run.model.route()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    with run.adapter.no_gradient_sync(run.sharded) if unsynced else contextlib.nullcontext():
                        loss = run.model.loss(run.sharded(*inputs))
                        run.adapter.backward(run.sharded, loss)
                except Exception as error:
                    if run.divergent_route and run.first_route is None:
                        run.report.refused = f"{type(error).__name__}: {error}"
                        return True
                    raise
            if run.divergent_route:
                run.find(
                    "the ranks ran the first iteration in different forward orders (blocks 0 and 1 swapped on "
                    "odd ranks) and the backend, which declares EXEC_ORDER_CHECK and was asked to check "
                    "(check_exec_order=True), did not refuse it",
                    "a rank-divergent first iteration not refused",
                )
                return True
            run.check_order_warnings(caught, route, training=True)
            if run.first_route is None:
                run.first_route = route
            want = expected[micro_batch][run.data_rank]
            if not run.bounds.losses_close(loss.item(), want):
                run.find(
                    f"micro-batch {micro_batch}: loss {loss.item():.9g}, the oracle's {want:.9g} "
                    f"(difference {abs(loss.item() - want):.3g}; bound {run.bounds.loss_atol:g} + "
                    f"{run.bounds.loss_rtol:g} x |oracle|)",
                    "the loss",
                )
        run.check_grads()
        run.check_storage(Stored.PARAMETERS, Phase.AFTER_BACKWARD)
        run.check_storage(Stored.GRADIENTS, Phase.AFTER_BACKWARD)
        return False

    def script_lines(self, uses: handler.Uses, op: Backward) -> list[str]:
        if uses.divergent_route:
            return ["run.first_pass_in_divergent_orders()"]
        if op.no_sync:
            return [f"run.forward_backward(micro_batches={op.micro_batches}, no_sync=True)"]
        return [f"run.forward_backward(micro_batches={op.micro_batches})"]
