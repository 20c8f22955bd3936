"""The checklist of a generated operation: every kind has one handler, and every handler has
every part (``conformance.programs.operations``).

A kind forgotten in one part used to fail only when a draw first reached it; here it fails at
once, naming the kind and the part. What needs ranks (a handler's ``run``) is exercised by every
generated program (``conformance/test_generated.py``); everything else is asked here of every
variant a handler lists, in this process.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
import torch

from conformance.programs import codec
from conformance.programs.declared import Declared
from conformance.programs.export.uses import EXPORTABLE_BACKENDS, Uses
from conformance.programs.operations import (
    DRAW_ORDER,
    HANDLERS,
    OPERATION_TYPES,
    TWO_D_DRAW_ORDER,
    DrawContext,
    DrawState,
    OperationFacts,
    OperationHandler,
    missing_parts,
    register,
)
from conformance.programs.operations.step import StepHandler
from conformance.programs.program import (
    Backward,
    ModelShape,
    Program,
    SaveLoad,
    Setup,
    Step,
    Unshard,
    ZeroGrad,
    spec_requirements,
)
from conformance.programs.shadow import Shadow
from conformance.protocol import ApiForm, Capability, ShardingStrategy

SHAPE = ModelShape(in_width=3, width=4, out_width=3, depth=2, buffers=True)
SETUP = Setup(strategy=ShardingStrategy.FULL_SHARD, form=ApiForm.WRAPPER, unit_plan="leaves")
# A backend that declares everything: every choice a handler has is offered.
EVERYTHING = Declared(
    name="everything",
    capabilities=frozenset(Capability),
    unsupported_combinations=(),
    low_precision_dtypes=(),
    zero_grad_keeps_zeros=True,
    backend_modules=(),
)


def _states() -> list[DrawState]:
    return [DrawState(*values) for values in itertools.product((False, True), repeat=4)]


def _contexts() -> list[DrawContext]:
    contexts = []
    for two_d in (False, True):
        setup = dataclasses.replace(SETUP, tensor_parallel=two_d, unit_plan="none" if two_d else "leaves")
        base = frozenset(spec_requirements(setup) | {Capability.for_form(setup.form)})
        contexts.append(DrawContext(EVERYTHING, setup, SHAPE, 4 if two_d else 2, base, two_d=two_d))
    return contexts


def checklist(handlers: dict[type, OperationHandler]) -> list[str]:
    """What is missing or inconsistent in ``handlers``, as lines naming the kind and the part."""
    problems = [
        f"{kind.__name__}: no handler (add its module to conformance/programs/operations/)"
        for kind in OPERATION_TYPES
        if kind not in handlers
    ]
    problems += [f"{kind.__name__}: not in DRAW_ORDER" for kind in handlers if kind not in DRAW_ORDER]
    problems += [
        f"{kind.__name__}: in TWO_D_DRAW_ORDER, not in DRAW_ORDER"
        for kind in TWO_D_DRAW_ORDER
        if kind not in DRAW_ORDER
    ]
    for kind, handler in handlers.items():
        name = kind.__name__
        lacks = [f"{name}: lacks {part}" for part in missing_parts(type(handler))]
        problems += lacks or _check_handler(name, kind, handler)
    return problems


def _check_handler(name: str, kind: type, handler: OperationHandler) -> list[str]:
    problems: list[str] = []
    examples = handler.examples()
    if not examples:
        return [f"{name}: examples() lists no variant"]
    for op in examples:
        if type(op) is not kind:
            problems.append(f"{name}: examples() lists {op!r}, not a {name}")
            continue
        program = Program(2, SHAPE, SETUP, (op,), seed=3)
        if codec.decode(codec.encode(program)) != program:
            problems.append(f"{name}: {op!r} does not come back from the codec")
        if not (isinstance(op.describe(), str) and op.describe()):
            problems.append(f"{name}: {op!r}.describe() says nothing")
        if not isinstance(op.requirements(), set):
            problems.append(f"{name}: {op!r}.requirements() is not a set")
        if not isinstance(handler.facts(op), OperationFacts):
            problems.append(f"{name}: facts({op!r}) is not an OperationFacts")
        handler.advance(DrawState(), op)
        for backend in EXPORTABLE_BACKENDS:
            lines = handler.script_lines(Uses.of(backend, program), op)
            if not lines or not all(isinstance(line, str) and line for line in lines):
                problems.append(f"{name}: script_lines({op!r}) for {backend} gives no lines")
        problems += _check_oracle(name, handler, program, op)
    offered = [
        (choice, context.two_d)
        for context in _contexts()
        for state in _states()
        for choice in handler.choices(context, state)
    ]
    problems += [
        f"{name}: choices() offers {choice!r}, which examples() does not list"
        for choice, _ in offered
        if choice not in examples
    ]
    if not any(not two_d for _, two_d in offered):
        problems.append(f"{name}: choices() offers nothing in any state (a kind that is never drawn)")
    if any(two_d for _, two_d in offered) and kind not in TWO_D_DRAW_ORDER:
        problems.append(f"{name}: choices() offers 2-D operations, but {name} is not in TWO_D_DRAW_ORDER")
    return problems


def _check_oracle(name: str, handler: OperationHandler, program: Program, op: Any) -> list[str]:
    """The oracle step runs on a single-process oracle that has trained a step (so gradients and
    optimizer state exist for whatever the operation reads or drops)."""
    shadow = Shadow(program)
    shadow.backward()
    shadow.step()
    shadow.backward()
    try:
        handler.oracle(shadow, op)
    except Exception as error:  # noqa: BLE001 - a finding of this checklist, named with the operation
        return [f"{name}: oracle({op!r}) raised {type(error).__name__}: {error}"]
    return []


def test_every_operation_has_a_handler_with_every_part() -> None:
    assert set(HANDLERS) == set(OPERATION_TYPES)
    assert checklist(HANDLERS) == []


def test_the_checklist_names_a_kind_without_a_handler() -> None:
    without_step = {kind: handler for kind, handler in HANDLERS.items() if kind is not Step}
    assert checklist(without_step) == ["Step: no handler (add its module to conformance/programs/operations/)"]


# Step's handler with every part but its oracle step.
_NoOracle = type(
    "_NoOracle",
    (OperationHandler,),
    {"kind": Step, **{part: getattr(StepHandler, part) for part in OperationHandler.PARTS if part != "oracle"}},
)


class _UnlistedChoice(StepHandler):
    def examples(self) -> list[Any]:
        return []


class _BadOracle(StepHandler):
    def oracle(self, shadow: Shadow, op: Any) -> None:
        raise KeyError("the oracle step forgot a kind")


def test_a_handler_lacking_a_part_is_refused_and_named() -> None:
    assert missing_parts(_NoOracle) == ["oracle"]
    with pytest.raises(TypeError, match=r"_NoOracle lacks oracle: every generated operation defines each of"):
        register(_NoOracle)
    assert HANDLERS[Step].__class__ is StepHandler  # the refused one replaced nothing
    assert checklist({**HANDLERS, Step: _NoOracle()}) == ["Step: lacks oracle"]


def test_the_checklist_names_a_part_that_is_there_but_wrong() -> None:
    assert checklist({**HANDLERS, Step: _UnlistedChoice()}) == ["Step: examples() lists no variant"]
    broken = checklist({**HANDLERS, Step: _BadOracle()})
    assert broken == ["Step: oracle(Step()) raised KeyError: 'the oracle step forgot a kind'"]


def test_a_handler_for_a_kind_outside_operation_is_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Unknown:
        pass

    class UnknownHandler(StepHandler):
        kind = Unknown

    with pytest.raises(TypeError, match=r"not a member of conformance\.programs\.program\.Operation"):
        register(UnknownHandler)
    assert Unknown not in HANDLERS


def test_oracle_steps_change_the_oracle_as_their_kind_says() -> None:
    """Spot checks that the oracle parts do what their operations mean (the generated programs
    compare the backend with them)."""
    program = Program(2, SHAPE, SETUP, (), seed=3)
    shadow = Shadow(program)
    passes = HANDLERS[Backward].oracle(shadow, Backward(micro_batches=2))
    assert len(passes) == 2 and all(len(ranks) == 2 for ranks in passes)
    before = shadow.params()
    HANDLERS[Unshard].oracle(shadow, Unshard(writeback=True, write=True))
    assert all(torch.allclose(shadow.params()[name], value + 0.01) for name, value in before.items())
    HANDLERS[ZeroGrad].oracle(shadow, ZeroGrad(set_to_none=True))
    assert shadow.grads() == {}
    HANDLERS[Backward].oracle(shadow, Backward())
    HANDLERS[Step].oracle(shadow, Step())
    optimizer = shadow.optimizer
    HANDLERS[SaveLoad].oracle(shadow, SaveLoad("native"))
    assert shadow.optimizer is optimizer and shadow.grads() == {}
    HANDLERS[SaveLoad].oracle(shadow, SaveLoad("full"))
    assert shadow.optimizer is not optimizer
