"""Generated conformance: programs drawn over every axis the backend declares, run on its ranks
next to the single-process oracle, checked after every operation, shrunk to a minimal repro.

Hypothesis runs here, in the pytest process: it draws each program
(``conformance.programs.draw``: a model, a sharding setup, a sequence of operations), and the
harness runs it on a warm pool's ranks in one SPMD call (``spmd_world``), with the collective
trace on. Each rank runs the program through the adapter beside its oracle and checks losses,
parameters, gradients, the storage claim and forward-order warnings after every operation
(``conformance.programs.run``); the parent judges the ranks' reports and the trace diff
(``conformance.programs.example_verdict``). A failing program (a finding, a rank that raised, hung or
died, divergent collectives) fails the example; hypothesis shrinks it to the smallest program
that still fails, and the report prints it operation by operation with a ``REPRO:`` command
that replays exactly that program. A program whose every finding is a known one of the backend
(``[[generated_finding]]`` in its expectations) is set aside and the search goes on.

The budget is the session's (``conformance.suite.generation``): a fixed derandomized set per
backend by default, which stops at its first failing program; campaigns with
``--generate-examples`` / ``--generate-seconds``, which go on past each finding and fail at the end
with every distinct one, each shrunk.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, reject, settings
from hypothesis import Phase as HypothesisPhase
from hypothesis import seed as hypothesis_seed
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.errors import Flaky

from conformance.programs.declared import Declared, declared_axes
from conformance.programs.draw import programs
from conformance.programs.example_verdict import ExampleVerdict, GeneratedProgramFailed, failure_text, judge
from conformance.programs.program import Program
from conformance.programs.run import run_program
from conformance.programs.seeds import seed_programs

CAMPAIGN_BATCH = 10
"""A timed campaign runs hypothesis in batches of this many programs until its time is up."""


def test_generated_programs(backend: str, generation, spmd_world) -> None:
    """Programs drawn from what the backend declares pass every check after every operation
    (see the module docstring); at least one of them shows the backend sharding something."""
    declared: Declared = spmd_world(2).call(declared_axes, backend)[0]

    def run_one(program: Program) -> ExampleVerdict:
        result = spmd_world(program.world_size).run(
            run_program, args=(backend, program), trace=True, isolate=True, timeout_s=generation.timeout_s
        )
        verdict = judge(program, result, generation.known(program.world_size))
        if verdict.kind == "failed" and generation.findings.repeats(verdict.root_cause):
            verdict.kind = "repeat"  # what this campaign already found: look for others
        generation.note(program, verdict.kind, verdict.sharded)
        if verdict.kind == "failed":
            text = failure_text(generation.name, program, verdict, generation.repro(program))
            if generation.export_dir:
                from conformance.programs.export import export_repro  # only with --export-repro

                text += "\n" + export_repro(generation.name, program, generation.export_dir)
            raise GeneratedProgramFailed(text, verdict.root_cause)
        return verdict

    if generation.replay is not None:
        verdict = run_one(generation.replay)
        if verdict.kind == "known":
            pytest.xfail(
                reason="the replayed program shows a known finding of the backend: "
                + "; ".join(entry.reason for entry in verdict.known)
            )
        return

    strategy = programs(declared, generation.world_sizes)
    seeds = [program for size in generation.world_sizes for program in seed_programs(declared, size)]
    if not any(size >= 4 for size in generation.world_sizes):
        # The 2-D family needs a (dp, tp) mesh: its seeds run at world size 4 in every budget.
        seeds += seed_programs(declared, 4, two_d_only=True)
    batch_failed = False  # whether this hypothesis run has failed: what it runs next is shrinking

    def run_example(program: Program) -> None:
        nonlocal batch_failed
        if not batch_failed and program not in seeds:
            generation.progress.drawn += 1
        try:
            kind = run_one(program).kind
        except GeneratedProgramFailed:
            batch_failed = True
            raise
        if kind in ("known", "repeat"):
            reject()  # a recorded finding, or one this campaign found: look for others

    def with_seeds(test):
        for program in reversed(seeds):  # decorators apply inside out: the first seed runs first
            test = example(program)(test)
        return test

    common = {
        "deadline": None,
        "suppress_health_check": list(HealthCheck),
        "print_blob": False,
        # The first failing program, shrunk: what a user fixes first (and half the time of two).
        "report_multiple_bugs": False,
        "phases": (HypothesisPhase.explicit, HypothesisPhase.reuse, HypothesisPhase.generate, HypothesisPhase.shrink),
    }
    if not generation.campaign:
        settings(max_examples=generation.ci_examples, derandomize=True, database=None, **common)(
            with_seeds(given(strategy)(run_example))
        )()
    else:
        # A campaign goes on past each finding: hypothesis stops a run at its first failing
        # program and shrinks it; the campaign keeps that finding, sets aside the programs that
        # show it again, and starts the next run (a batch), until its budget is spent.
        database = DirectoryBasedExampleDatabase(str(generation.database_dir))
        # The database's failures are replayed once per campaign, first: a later replay that is
        # set aside (this campaign found it already) would delete it for the next campaign.
        later_phases = tuple(phase for phase in common["phases"] if phase != HypothesisPhase.reuse)
        batch = 0
        seeds_pending = True  # until one batch has run every seed program without a finding
        while True:
            size = generation.examples_left() if generation.examples is not None else CAMPAIGN_BATCH
            phases = common["phases"] if batch == 0 else later_phases
            test = settings(max_examples=size, database=database, **{**common, "phases": phases})(
                given(strategy)(run_example)
            )
            if seeds_pending:
                test = with_seeds(test)
            batch_failed = completed = False
            try:
                hypothesis_seed(generation.seed + batch)(test)()
                seeds_pending = False
                completed = True
            except GeneratedProgramFailed as finding:
                generation.record(str(finding), finding.root_cause)
            except Flaky as flaky:  # the program did not fail again when replayed: nondeterminism, a finding
                inner = getattr(flaky, "exceptions", ())  # FlakyFailure is an exception group
                first = next((e for e in inner if isinstance(e, GeneratedProgramFailed)), None)
                generation.record(
                    f"this program failed once, then passed when hypothesis replayed it ({type(flaky).__name__}): "
                    f"the backend or the program is nondeterministic\n{first if first is not None else flaky}",
                    first.root_cause if first is not None else frozenset({"a failure that did not repeat"}),
                )
            batch += 1
            # A --generate-examples batch that ran to its end drew what was left of the budget.
            if generation.budget_spent() or (completed and generation.examples is not None):
                break
    progress = generation.progress
    generation.say(generation.summary())
    if generation.findings:
        raise GeneratedProgramFailed(generation.findings_report())
    assert progress.sharded, (
        f"{progress.examples} generated programs ran ({progress.passed} passed, {progress.known} showed known "
        f"findings) and none showed {generation.name} sharding anything: the run checked nothing of the backend"
    )
