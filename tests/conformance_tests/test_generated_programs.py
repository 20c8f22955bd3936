"""The generated-program machinery without ranks: drawing only what a backend admits, the replay
text, the program patterns, the verdict of one example, and the known-finding entries."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from conformance.programs import codec, patterns
from conformance.programs.declared import Declared
from conformance.programs.draw import programs
from conformance.programs.example_verdict import judge
from conformance.programs.program import (
    Backward,
    ModelShape,
    OptimRoundTrip,
    Program,
    SaveLoad,
    Setup,
    Step,
    SwapRoute,
    Unshard,
    ZeroGrad,
    spec_requirements,
)
from conformance.programs.run import ProgramReport
from conformance.programs.seeds import seed_programs
from conformance.protocol import ApiForm, Capability, ShardingStrategy, SpecCondition
from conformance.suite import expectations, generation
from tests.conformance_tests.adapter_testing import REPO

SHAPE = ModelShape(in_width=3, width=5, out_width=3, depth=2, buffers=True)

# A backend that declares little: FULL_SHARD and NO_SHARD in the composable form, units, the
# full state dict, unshard without options, no mixed precision; and refuses units under NO_SHARD.
NARROW = Declared(
    name="narrow",
    capabilities=frozenset(
        {
            Capability.COMPOSABLE,
            Capability.FULL_SHARD,
            Capability.NO_SHARD,
            Capability.UNITS,
            Capability.FULL_STATE_DICT,
            Capability.UNSHARD,
        }
    ),
    unsupported_combinations=(frozenset({Capability.NO_SHARD, Capability.UNITS}),),
    low_precision_dtypes=(),
    zero_grad_keeps_zeros=False,
    backend_modules=(),
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
@given(programs(NARROW, [2, 4]))
def test_programs_are_drawn_only_from_what_the_backend_admits(program: Program) -> None:
    needed = spec_requirements(program.setup) | program.requirements()
    assert NARROW.admits(needed), program.describe()
    assert program.setup.strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD)
    assert not (program.setup.strategy is ShardingStrategy.NO_SHARD and program.setup.unit_plan != "none")
    assert program.setup.param_dtype is None and not program.setup.tensor_parallel
    assert not any(isinstance(op, ZeroGrad) and not op.set_to_none for op in program.operations)
    assert not any(
        isinstance(op, Unshard) and (op.writeback or op.rank0_only or op.with_grads) for op in program.operations
    )
    # What the state machine promises: a step only after a backward since the last step.
    pending = False
    for op in program.operations:
        if isinstance(op, Backward):
            pending = True
        elif isinstance(op, Step):
            assert pending, program.describe()
            pending = False
        elif isinstance(op, (SaveLoad, OptimRoundTrip)) or (isinstance(op, ZeroGrad) and op.set_to_none):
            pending = False


def test_seed_programs_are_admitted_and_cover_the_families() -> None:
    seeds = seed_programs(NARROW, 2)
    assert seeds
    for program in seeds:
        assert NARROW.admits(spec_requirements(program.setup) | program.requirements()), program.describe()
    assert {program.setup.strategy for program in seeds} == {ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD}
    assert any(isinstance(op, SaveLoad) and op.kind == "full" for program in seeds for op in program.operations)


def test_a_program_survives_its_replay_text() -> None:
    program = Program(
        4,
        SHAPE,
        Setup(ShardingStrategy.HYBRID_SHARD, ApiForm.WRAPPER, "mixed", other_strategy=ShardingStrategy.NO_SHARD),
        (Backward(3, no_sync=True), Step(), Unshard(writeback=True, write=True), SaveLoad("native")),
        seed=11,
    )
    text = codec.encode(program)
    assert codec.decode(text) == program
    assert text.isascii() and " " not in text and "'" not in text


def test_a_damaged_replay_text_is_refused_with_the_fix() -> None:
    with pytest.raises(codec.ProgramCodeError, match="copy the whole text of the REPRO: line"):
        codec.decode("not-a-program")


def _program(*ops: object, strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD, world_size: int = 2) -> Program:
    return Program(world_size, SHAPE, Setup(strategy, ApiForm.WRAPPER), tuple(ops))  # type: ignore[arg-type]


def test_patterns_name_program_shapes() -> None:
    kept = _program(Backward(), Step(), Backward(), Step())
    dropped = _program(Backward(), Step(), ZeroGrad(), Backward(), Step())
    assert patterns.gradients_kept_across_steps(kept)
    assert not patterns.gradients_kept_across_steps(dropped)
    zero2 = ShardingStrategy.SHARD_GRAD_AND_OPTIM_STATE
    assert patterns.zero12_several_synced_backwards_per_step(_program(Backward(2), Step(), strategy=zero2))
    assert not patterns.zero12_several_synced_backwards_per_step(
        _program(Backward(2, no_sync=True), Step(), strategy=zero2)
    )
    assert not patterns.zero12_several_synced_backwards_per_step(_program(Backward(2), Step()))
    assert patterns.hybrid_shard_groups_of_one(_program(Backward(), strategy=ShardingStrategy.HYBRID_SHARD))
    assert not patterns.hybrid_shard_groups_of_one(
        _program(Backward(), strategy=ShardingStrategy.HYBRID_SHARD, world_size=4)
    )
    assert patterns.native_checkpoint_before_first_step(_program(SaveLoad("native")))
    assert not patterns.native_checkpoint_before_first_step(_program(Backward(), Step(), SaveLoad("native")))


@dataclass
class _Result:
    """What harness.SpmdResult gives the verdict."""

    values: dict[int, Any]
    failures: dict[int, str] = field(default_factory=dict)
    results: dict[int, Any] = field(default_factory=dict)
    divergence: str | None = None

    @property
    def ok(self) -> bool:
        return not self.failures

    def describe(self) -> str:
        return "\n".join(self.failures.values())


@dataclass(frozen=True)
class _Known:
    pattern: str
    reason: str
    text: str

    def explains(self, finding: str) -> bool:
        return self.text in finding


def _reports(*findings: list[str], refused: str = "") -> dict[int, ProgramReport]:
    return {
        rank: ProgramReport(rank, list(found), refused=refused, sharded=True) for rank, found in enumerate(findings)
    }


def test_verdict_passes_fails_and_sets_known_findings_aside() -> None:
    program = _program(Backward(), Step(), Backward(), Step())
    assert judge(program, _Result(_reports([], [])), []).kind == "passed"
    oracle = "rank 0, op 3 (optimizer step): the full state dict after the step differ from the oracle's"
    known = _Known("gradients_kept_across_steps", "steps drop gradients", "the oracle's")
    assert judge(program, _Result(_reports([oracle], [])), [known]).kind == "known"
    # A known finding of another program shape does not apply.
    other = _Known("hybrid_shard_groups_of_one", "hybrid", "the oracle's")
    assert judge(program, _Result(_reports([oracle], [])), [other]).kind == "failed"
    # A finding the entry does not explain keeps the example failing, with that finding.
    verdict = judge(program, _Result(_reports([oracle, "rank 0: storage ... claims"], [])), [known])
    assert verdict.kind == "failed" and "claims" in verdict.text and "oracle" not in verdict.text
    # Divergent collectives fail, whatever the reports say.
    assert judge(program, _Result(_reports([], []), divergence="collective #3 differs"), [known]).kind == "failed"


def test_verdict_of_ranks_that_raised() -> None:
    program = _program(Backward(), Step(), OptimRoundTrip("full"))
    known = _Known("adam_state_loaded", "no state before a step", "'exp_avg'")
    adam = Program(2, SHAPE, Setup(ShardingStrategy.FULL_SHARD, ApiForm.WRAPPER, optimizer="adam"), program.operations)

    @dataclass
    class _Lost:
        after_peer_failed: bool

    raised = _Result({0: ProgramReport(0, ["rank 0, op 2: raised KeyError: 'exp_avg'"])}, {1: "rank 1 waited alone"})
    raised.results = {1: _Lost(after_peer_failed=True)}
    assert judge(adam, raised, [known]).kind == "known"
    raised.results = {1: _Lost(after_peer_failed=False)}  # rank 1 failed on its own: not explained
    assert judge(adam, raised, [known]).kind == "failed"


def test_a_refused_rank_divergent_first_iteration_is_not_a_divergence() -> None:
    program = _program(SwapRoute(odd_ranks_only=True), Backward())
    refused = _Result(_reports([], [], refused="RuntimeError: order differs"), divergence="check collectives differ")
    assert judge(program, refused, []).kind == "passed"
    not_refused = _Result(_reports(["did not refuse"], ["did not refuse"]), divergence="all-gathers differ")
    assert judge(program, not_refused, []).kind == "failed"


def test_unsupported_programs_fail_with_the_declaration_to_fix() -> None:
    reports = {0: ProgramReport(0, unsupported="unsupported: strategy NO_SHARD"), 1: ProgramReport(1)}
    verdict = judge(_program(Backward()), _Result(reports), [])
    assert verdict.kind == "failed" and "declare it there" in verdict.text


def test_generated_findings_are_read_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text(
        '[[generated_finding]]\npattern = "gradients_kept_across_steps"\nfailure = ["a", "b"]\n'
        'reason = "why"\nprogram = """\nop 0: forward + backward\n"""\nwhen = { device = "cpu" }\n'
    )
    loaded = expectations.load_file("mine", path)
    (entry,) = loaded.generated
    assert entry.failure == ("a", "b") and entry.program == "op 0: forward + backward"
    assert entry.explains("... b ...") and not entry.explains("c")
    path.write_text('[[generated_finding]]\npattern = "no_such_shape"\nfailure = "a"\nreason = "why"\n')
    with pytest.raises(expectations.ExpectationsError, match="is not one of"):
        expectations.load_file("mine", path)
    path.write_text('[[generated_finding]]\npattern = "zero1_backward"\nreason = "why"\n')
    with pytest.raises(expectations.ExpectationsError, match="missing \\['failure'\\]"):
        expectations.load_file("mine", path)


def test_requirements_name_what_a_program_uses() -> None:
    setup = Setup(ShardingStrategy.FULL_SHARD, ApiForm.WRAPPER, "mixed", other_strategy=ShardingStrategy.NO_SHARD)
    needed = spec_requirements(setup)
    assert {Capability.MIXED_STRATEGIES, Capability.UNITS, Capability.NO_SHARD, SpecCondition.FULL_PRECISION} <= needed
    program = Program(2, SHAPE, setup, (Backward(2, no_sync=True), SaveLoad("native"), OptimRoundTrip("sharded")))
    assert {Capability.NO_SYNC, Capability.NATIVE_CHECKPOINT, Capability.OPTIM_STATE_DICT} <= program.requirements()


def test_a_divergence_after_a_known_raise_is_its_consequence() -> None:
    program = Program(
        2, SHAPE, Setup(ShardingStrategy.FULL_SHARD, ApiForm.WRAPPER, check_exec_order=True), (SaveLoad("native"),)
    )
    known = _Known("optimizer_state_with_exec_order_check", "CPU has no memory_summary", "memory_summary")
    first = ProgramReport(0, ["rank 0, op 0: raised AttributeError: ... memory_summary"], raised_at=10.0)
    then = ProgramReport(1, ["rank 1, op 0: raised RuntimeError: connection closed by peer"], raised_at=11.0)
    result = _Result({0: first, 1: then}, divergence="rank 0 stopped early")
    assert judge(program, result, [known]).kind == "known"
    # The same, but the rank that raised first found something else: it fails.
    first.raised_at, then.raised_at = 12.0, 11.0
    assert judge(program, result, [known]).kind == "failed"


def test_the_ci_set_is_drawn_by_the_pinned_hypothesis_and_says_which_set_ran() -> None:
    # The `draws` extra pins the release the derandomized set was recorded against; the constant
    # the summary line compares with must be that pin, and the `test` extra and the CI legs must
    # install it (an unpinned hypothesis changes CI's programs under an unchanged tree).
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    assert extras["draws"] == [f"hypothesis=={generation.CI_HYPOTHESIS}"]
    assert "fsdp-conformance[draws,runner]" in extras["test"]
    assert "'.[draws,runner]'" in (REPO / ".ci" / "torch-leg").read_text()
    assert "the one CI runs" in generation.derandomized_set(generation.CI_HYPOTHESIS)
    other = generation.derandomized_set("6.0.0")
    assert "not CI's" in other and "pip install -e '.[draws]'" in other


def test_a_campaign_tells_findings_apart_by_their_root_cause() -> None:
    # The verdict carries each rank's root cause as data (the findings at its first failing
    # operation, by operation kind and check); a campaign sets aside a failure whose causes it
    # has all found: the same defect at another operation, on another rank, with other numbers.
    program = _program(Backward(), Step(), Backward(), Step())

    def failed(*root_causes: list[str]) -> frozenset[str]:
        reports = {
            rank: ProgramReport(rank, [f"rank {rank}: something differs"], root_cause=list(causes), sharded=True)
            for rank, causes in enumerate(root_causes)
        }
        verdict = judge(program, _Result(reports), [])
        assert verdict.kind == "failed"
        return verdict.root_cause

    step = "the full state dict after the step"
    found = generation.CampaignFindings()
    first = failed([step], [step])
    assert first == {step} and not found.repeats(first)
    assert found.add("report 1", first) == 1
    assert found.repeats(failed([step], []))  # the same cause, on one rank only
    eval_alone = failed(["the loss under no_grad in eval mode"], [])
    assert not found.repeats(eval_alone)  # a new cause
    assert not found.repeats(failed([step], ["SaveLoad raised KeyError"]))  # one new cause among known ones
    # A rank lost (not stopped because of a peer) is a cause of its own; so are divergent collectives.
    lost = _Result({0: ProgramReport(0, root_cause=[step])}, {1: "rank 1 died"})

    @dataclass
    class _Lost:
        after_peer_failed: bool
        status: str = "failed"

    lost.results = {1: _Lost(after_peer_failed=False)}
    assert judge(program, lost, []).root_cause == {step, "a rank did not finish: _Lost"}
    diverged = judge(program, _Result(_reports([], []), divergence="collective #3 differs"), [])
    assert diverged.root_cause == {"divergent collectives"}
    assert not found.repeats(frozenset())  # a failure without a cause is never set aside
