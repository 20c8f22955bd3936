"""One home per generated operation: a handler per kind, found by the operation's type.

Each module holds one kind's handler (``handler``: the parts every kind must have). The draw
(``conformance.programs.draw``), the rank step (``conformance.programs.run``), the patterns
(``conformance.programs.patterns``) and the exported script's ``main``
(``conformance.programs.export.operations``) ask :func:`handler_for` and never test an
operation's type themselves. A new operation: its dataclass in ``conformance.programs.program``
(added to ``Operation``), its handler module here, and its place in :data:`DRAW_ORDER` (and
:data:`TWO_D_DRAW_ORDER` if 2-D programs may draw it); ``tests/conformance_tests/test_operation_handlers.py``
says what is missing.
"""

from __future__ import annotations

import typing

from conformance.programs.operations.backward import BackwardHandler
from conformance.programs.operations.clip_step import ClipStepHandler
from conformance.programs.operations.eval_forward import EvalForwardHandler
from conformance.programs.operations.handler import (
    DrawContext,
    DrawState,
    OperationFacts,
    OperationHandler,
    missing_parts,
)
from conformance.programs.operations.optim_round_trip import OptimRoundTripHandler
from conformance.programs.operations.save_load import SaveLoadHandler
from conformance.programs.operations.set_mode import SetModeHandler
from conformance.programs.operations.step import StepHandler
from conformance.programs.operations.swap_route import SwapRouteHandler
from conformance.programs.operations.unshard import UnshardHandler
from conformance.programs.operations.zero_grad import ZeroGradHandler
from conformance.programs.program import (
    Backward,
    ClipStep,
    EvalForward,
    Operation,
    OptimRoundTrip,
    SaveLoad,
    SetMode,
    Step,
    SwapRoute,
    Unshard,
    ZeroGrad,
)

OPERATION_TYPES: tuple[type, ...] = typing.get_args(Operation)
"""Every kind of generated operation (the members of ``conformance.programs.program.Operation``)."""

HANDLERS: dict[type, OperationHandler] = {}


def register(handler: type[OperationHandler]) -> OperationHandler:
    """Register ``handler`` for its kind; a handler that lacks a part is refused, naming it."""
    missing = missing_parts(handler)
    if missing:
        raise TypeError(
            f"operation handler {handler.__qualname__} lacks {', '.join(missing)}: every generated operation "
            f"defines each of {', '.join(OperationHandler.PARTS)} and its kind "
            "(conformance/programs/operations/handler.py says what each part is)"
        )
    if handler.kind not in OPERATION_TYPES:
        raise TypeError(
            f"operation handler {handler.__qualname__} handles {handler.kind.__name__}, which is not a member of "
            "conformance.programs.program.Operation: add it there"
        )
    instance = handler()
    HANDLERS[handler.kind] = instance
    return instance


for _handler in (
    BackwardHandler,
    ZeroGradHandler,
    StepHandler,
    ClipStepHandler,
    SetModeHandler,
    EvalForwardHandler,
    SwapRouteHandler,
    UnshardHandler,
    SaveLoadHandler,
    OptimRoundTripHandler,
):
    register(_handler)

DRAW_ORDER: tuple[type, ...] = (
    Backward,
    Step,
    ClipStep,
    ZeroGrad,
    SetMode,
    EvalForward,
    SwapRoute,
    Unshard,
    SaveLoad,
    OptimRoundTrip,
)
"""The order the kinds' choices are offered in, simplest first (where hypothesis shrinks to).
The draw's sequence depends on it: a change redraws the derandomized CI set."""
TWO_D_DRAW_ORDER: tuple[type, ...] = (Backward, EvalForward, Step, ZeroGrad, SetMode, SaveLoad)
"""The kinds a 2-D program may draw, in their order."""


def handler_for(op: Operation) -> OperationHandler:
    """The handler of ``op``'s kind."""
    try:
        return HANDLERS[type(op)]
    except KeyError:
        raise TypeError(
            f"no handler for the generated operation {op!r}: add its module to conformance/programs/operations/"
        ) from None


def facts(op: Operation) -> OperationFacts:
    """What ``op`` does, as a program pattern asks it."""
    return handler_for(op).facts(op)


__all__ = [
    "DRAW_ORDER",
    "HANDLERS",
    "OPERATION_TYPES",
    "TWO_D_DRAW_ORDER",
    "DrawContext",
    "DrawState",
    "OperationFacts",
    "OperationHandler",
    "facts",
    "handler_for",
    "missing_parts",
    "register",
]
