"""What one kind of generated operation must say for every part of the suite that meets it.

A generated operation is data (its dataclass in ``conformance.programs.program``: what the codec
encodes, the ranks receive and a REPRO line carries). Everything the suite does with it lives in
its handler, one module per kind in this package, found by the operation's type:

- ``examples``: every variant it has (the checklist test round-trips each through the codec and
  asks every other part about it);
- ``choices`` and ``advance``: its draw (what may be drawn now, from what the program so far
  left behind, and what drawing it leaves for the next operation);
- ``facts``: its pattern form (what a recorded finding's program pattern may ask of it);
- ``run``: its rank step (the backend through the adapter protocol, and the checks after it);
- ``oracle``: its step on the single-process oracle (``conformance.programs.shadow``);
- ``script_lines``: its lines in an exported script's ``main``.

A handler lacking a part is refused when it is registered (:func:`missing_parts`), and
``tests/conformance_tests/test_operation_handlers.py`` holds every registered kind to it, so a new
operation forgotten in one part fails at import, not when a draw first reaches it.
"""

from __future__ import annotations

import inspect
import warnings
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

# What every handler's parts take, named here once for the handler modules.
from conformance.programs.export.uses import Uses
from conformance.programs.shadow import Shadow
from conformance.protocol import Phase, Requirement, Stored

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from conformance.programs.declared import Declared
    from conformance.programs.program import ModelShape, Operation, Program, Setup
    from conformance.programs.tolerances import Bounds
    from conformance.protocol import BackendAdapter
    from fixtures.compare import Tolerance


@dataclass
class DrawState:
    """What the operations drawn so far leave behind: what may come next."""

    training: bool = True
    backward_since_step: bool = False
    grads_exist: bool = False
    stepped: bool = False


@dataclass(frozen=True)
class DrawContext:
    """What a draw of one program knows besides its state: the backend's declarations, the
    program's setup and model, its world size, and the requirements every operation adds to."""

    declared: Declared
    setup: Setup
    shape: ModelShape
    world_size: int
    base: frozenset[Requirement]
    two_d: bool = False
    """A 2-D program (tensor-parallel blocks): training, eval forwards and model state dict round
    trips only, the 2-D scenarios' ground."""

    def admits(self, requirements: set[Requirement]) -> bool:
        return self.declared.admits(set(self.base) | requirements)


@dataclass(frozen=True)
class OperationFacts:
    """What an operation does, as far as a program pattern (``conformance.programs.patterns``)
    asks: patterns read these, never an operation's type."""

    backward: bool = False
    """Forward and backward passes in training mode."""
    training_forwards: int = 0
    """How many forward passes in training mode it runs (each with its backward)."""
    reductions: int = 0
    """How many of its backward passes reduce gradients (outside the no-sync switch)."""
    steps: bool = False
    """An optimizer step."""
    zeroes_gradients: bool = False
    """The gradients are zero-filled or dropped after it (nothing left to sum into)."""
    drops_gradients: bool = False
    """The gradients are gone after it (``set_to_none``, or a fresh model)."""
    fresh_optimizer: bool = False
    """A new optimizer with no state goes on after it."""
    native_checkpoint: bool = False
    """A native checkpoint (model and optimizer) saved and loaded."""
    full_model_load: bool = False
    """A full model state dict loaded into a freshly sharded model."""
    optimizer_state_loaded: bool = False
    """An optimizer state dict loaded into a freshly sharded model's new optimizer."""
    writes_parameters: bool = False
    """Parameters written inside ``unshard(writeback=True)``."""


class ProgramRun(Protocol):
    """What a rank step may use of the program running on its rank
    (``conformance.programs.run.ProgramRun``, which runs the steps): the sharded model and its
    oracle, the counters and route state a step moves on, and the checks. Written here so that
    the handlers depend on this contract, not on the runner."""

    adapter: BackendAdapter
    program: Program
    setup: Setup
    report: Any
    rank: int
    data_rank: int
    device: torch.device
    bounds: Bounds
    shadow: Shadow
    model: Any
    """The generated model as built (``GeneratedModel``: ``route()``, ``swapped``, ``loss``)."""
    sharded: nn.Module
    optimizer: Any
    iteration: int
    evals: int
    divergent_route: bool
    first_route: list[int] | None

    def find(self, text: str, check: str) -> None: ...
    def fresh_model(self) -> AbstractContextManager[None]: ...
    def shared_directory(self) -> str: ...
    def shown(self, grads: bool) -> dict[str, torch.Tensor]: ...
    def compare(
        self, actual: dict[str, Any], expected: dict[str, torch.Tensor], tolerance: Tolerance, what: str
    ) -> None: ...
    def compare_grads(self, shown: dict[str, torch.Tensor], what: str) -> None: ...
    def compare_state(self, state: dict[str, Any], what: str) -> set[str]: ...
    def in_compute_dtype(self, state: dict[str, Any]) -> set[str]: ...
    def check_params(self, when: str) -> None: ...
    def check_grads(self) -> None: ...
    def check_storage(self, stored: Stored, phase: Phase) -> None: ...
    def check_sharded_layout(self, state: dict[str, Any]) -> None: ...
    def check_order_warnings(self, caught: list[warnings.WarningMessage], route: list[int], training: bool) -> None: ...


class OperationHandler:
    """The base of a kind's handler: every method below is a part the kind must have."""

    kind: ClassVar[type]
    """The operation's dataclass (``conformance.programs.program``)."""

    PARTS: ClassVar[tuple[str, ...]] = ("examples", "choices", "advance", "facts", "run", "oracle", "script_lines")

    def examples(self) -> list[Operation]:
        """Every variant of the operation (each value its fields can take together)."""
        raise NotImplementedError

    def choices(self, context: DrawContext, state: DrawState) -> list[Operation]:
        """What of this kind may be drawn next, simplest first ([] when none may)."""
        raise NotImplementedError

    def advance(self, state: DrawState, op: Operation) -> None:
        """What drawing ``op`` leaves for the operations after it."""
        raise NotImplementedError

    def facts(self, op: Operation) -> OperationFacts:
        raise NotImplementedError

    def run(self, run: ProgramRun, op: Operation) -> bool:
        """Run ``op`` on this rank's backend and its oracle, then check; True when the program
        cannot go on (it ended at a refusal or a finding that leaves nothing to compare)."""
        raise NotImplementedError

    def oracle(self, shadow: Shadow, op: Operation) -> Any:
        """``op`` on the single-process oracle; what it returns is what the rank step compares."""
        raise NotImplementedError

    def script_lines(self, uses: Uses, op: Operation) -> list[str]:
        """``op``'s native calls (or the script's ``Run`` method) in an exported script's ``main``."""
        raise NotImplementedError


def missing_parts(handler: type[OperationHandler]) -> list[str]:
    """The parts ``handler`` does not define itself (left to the base, which has none), and a
    missing or wrong ``kind``."""
    missing = [
        part
        for part in OperationHandler.PARTS
        if getattr(handler, part, None) is getattr(OperationHandler, part)
        or not inspect.isfunction(getattr(handler, part, None))
    ]
    kind = getattr(handler, "kind", None)
    if not isinstance(kind, type):
        missing.append("kind")
    return missing
