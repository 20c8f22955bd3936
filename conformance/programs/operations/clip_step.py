"""Gradient clipping, then an optimizer step: ``ClipStep(fraction)``."""

from __future__ import annotations

from conformance.programs.operations import handler
from conformance.programs.program import ClipStep
from conformance.protocol import Capability, Phase, Stored

FRACTIONS = (0.5,)
"""Clip to half the oracle's total norm: the clip always acts, so a wrongly computed norm shows in
the parameters after the step as well as in the norm returned."""


class ClipStepHandler(handler.OperationHandler):
    kind = ClipStep

    def examples(self) -> list[ClipStep]:
        return [ClipStep(fraction) for fraction in FRACTIONS]

    def choices(self, context: handler.DrawContext, state: handler.DrawState) -> list[ClipStep]:
        # Not in 2-D programs: test_gradient_clipping, the fixed scenario, has no 2-D case yet.
        if context.two_d or not state.backward_since_step:
            return []
        if not (context.declared.has(Capability.GRADIENT_CLIPPING) and context.admits({Capability.GRADIENT_CLIPPING})):
            return []
        return [ClipStep(fraction) for fraction in FRACTIONS]

    def advance(self, state: handler.DrawState, op: ClipStep) -> None:
        state.backward_since_step = False
        state.stepped = True

    def facts(self, op: ClipStep) -> handler.OperationFacts:
        return handler.OperationFacts(steps=True)

    def oracle(self, shadow: handler.Shadow, op: ClipStep) -> float:
        """Clip the oracle's gradients to ``fraction`` x their norm and step; the norm before."""
        norm = shadow.clip(op.fraction * shadow.grad_norm())
        shadow.step()
        return norm

    def run(self, run: handler.ProgramRun, op: ClipStep) -> bool:
        wanted = run.shadow.grad_norm()
        elements = sum(grad.numel() for grad in run.shadow.grads().values())
        norm = run.adapter.clip_grad_norm(run.sharded, run.optimizer, op.fraction * wanted)
        if norm is not None:  # None: the backend clips inside its step; the parameters after it show it
            full = getattr(norm, "full_tensor", None)  # a DTensor norm (torch's clip over DTensor gradients)
            value = float(full() if callable(full) else norm)
            allowed = run.bounds.norm_rtol(elements)
            if not abs(value - wanted) <= allowed * wanted:
                run.find(
                    f"clip_grad_norm returned the total norm {value:.7g}; the oracle's averaged gradient has norm "
                    f"{wanted:.7g} (relative difference {abs(value - wanted) / max(wanted, 1e-30):.3g}, allowed "
                    f"{allowed:.3g}); a norm over this rank's pieces only is smaller, by up to the square root of "
                    "the number of ranks sharing them",
                    "the gradient norm clip_grad_norm returned",
                )
        run.adapter.step(run.sharded, run.optimizer)
        self.oracle(run.shadow, op)
        run.check_params("after the clipped step")
        for stored in Stored:
            run.check_storage(stored, Phase.AT_REST)
        return False

    def script_lines(self, uses: handler.Uses, op: ClipStep) -> list[str]:
        return [f"run.clip_and_step({op.fraction!r})"]
