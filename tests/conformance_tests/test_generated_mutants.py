"""With the fixed scenarios deselected, the generated tests alone catch every family mutant.

One inner session runs only ``conformance/test_generated.py`` at its CI budget (the seed programs,
then the derandomized draws) against every mutant: each mutation of ``family_mutants`` on every
built-in backend it applies to (the defects of the exec-order, eval, ZeRO-1, divergence, mixed
precision and gradient accumulation families), and the replicating twin of every shipped backend
(``storage_mutants``: plain DDP declaring the backend's sharding strategies). Each mutant's
expectations are its base backend's, so its known generated findings are set aside as the base's
are and only the mutation can fail it. Every mutant must fail, and its report must name the
check the mutation breaks. The unmutated backends pass the same generated test in the suite
itself (the README's test command), which makes these failures the mutations'.

The 2-D mutant (``two_d``) is caught by the sharded state dict of a 2-D program (blocks tensor
parallel over a (dp, tp) mesh, world size 4), whose DTensors must shard dimension 0 over dp: FSDP1
gives DTensors only for tensor-parallel models.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import family_mutants  # tests/conformance_tests/family_mutants.py
import pytest
import storage_mutants  # tests/conformance_tests/storage_mutants.py
from adapter_testing import run_inner_session

from conformance.suite import expectations, registry

INNER_TESTS = """
from conformance.test_generated import test_generated_programs  # noqa: F401 - collected here
"""

# What each mutation's failure must name: the check that sees the defect (one of these texts).
CAUGHT_BY = {
    "exec_order": ("issued no forward-order warning",),
    "eval_ignored": ("in eval mode",),
    "two_d": ("laid out",),
    "zero1": ("the oracle's",),
    # The order check switched off: the later-iteration warning is missing, or a rank-divergent
    # first iteration runs on instead of being refused.
    "divergence": ("did not refuse", "issued no forward-order warning"),
    "lowp_double": ("the oracle's",),
    "accumulation_overwrite": ("the oracle's",),
    "replicating": ("claims",),
    # A clipped step (ClipStep): the norm clip_grad_norm returns, or the parameters after the step.
    "clip_local_norm": ("clip_grad_norm returned the total norm", "the oracle's"),
    # A checkpointed model's backward (its seed programs): the gradients or the parameters after the step.
    "checkpoint_reduced_twice": ("the oracle's",),
    # An uneven-data program's backward (its seed program): the losses, gradients or parameters.
    "sample_weighted": ("the oracle's",),
    # A tied seed program's step: the parameters (both names of the tied weight) or the next loss.
    "untied": ("the oracle's",),
    # A parameter-group seed program's step: the parameters (weights stepped without their decay).
    "groups_ignored": ("the oracle's",),
    # A deferred-init seed program's first forward: the loss, or the parameters after the step.
    "init_skipped": ("the oracle's",),
}
SHIPPED = ("reference", "torch-fsdp1", "torch-fsdp2", "deepspeed", "torch-zero")
NOT_YET_GENERATED: dict[str, str] = {}
"""Family mutants the generated programs cannot meet yet, each with why: listed here, not hidden."""


def _mutants() -> list[tuple[str, str, str]]:
    """(mutation, base backend, --backend selection) of every mutant installed here."""
    found = []
    for mutation, backends in family_mutants.APPLIES_TO.items():
        if mutation in NOT_YET_GENERATED:
            continue
        for backend in backends:
            if family_mutants.installed(backend):
                found.append((mutation, backend, family_mutants.selection(backend, mutation)))
    for backend in SHIPPED:
        if family_mutants.installed(backend):
            found.append(("replicating", backend, storage_mutants.selection(backend)))
    return found


def test_every_mutation_has_the_text_of_its_check() -> None:
    assert set(CAUGHT_BY) | set(NOT_YET_GENERATED) == {*family_mutants.MUTATIONS, "replicating"}
    assert not set(CAUGHT_BY) & set(NOT_YET_GENERATED)


def test_generated_programs_alone_catch_every_family_mutant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    here = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    mutants = _mutants()
    (tmp_path / "expectations").mkdir()
    for _, backend, selection in mutants:
        name = registry.name_of(selection)
        base_file = expectations.path_for(backend)
        if base_file.exists():
            shutil.copy(base_file, tmp_path / "expectations" / f"{name}.toml")
    result = run_inner_session(
        tmp_path, INNER_TESTS, [selection for _, _, selection in mutants], "--collective-timeout=20", timeout_s=900
    )
    output = result.stdout + result.stderr
    (tmp_path / "inner-output.txt").write_text(output)
    missed = []
    for mutation, _, selection in mutants:
        name = registry.name_of(selection)
        section = re.search(
            rf"_+ test_generated_programs\[{re.escape(name)}\] _+\n(?P<body>.*?)(?=\n_{{5,}} |\n=+ )", output, re.S
        )
        if section is None or not any(text in section["body"] for text in CAUGHT_BY[mutation]):
            missed.append(
                f"{name} ({mutation}): " + ("passed" if section is None else "failed without the check's text")
            )
    assert not missed, (
        "generated programs missed mutants:\n  "
        + "\n  ".join(missed)
        + f"\n(the inner session's output: {tmp_path}/inner-output.txt)"
    )


def test_a_campaign_goes_on_past_each_finding_and_reports_each_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A backend with two defects (eval() ignored; no forward-order warning after the first
    # iteration), a campaign of one drawn program past the seeds: hypothesis stops at the first
    # failing seed; the campaign keeps it, runs the seeds again with that finding set aside, finds
    # the other, and ends with both in one failure, each once, each with its REPRO line.
    here = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    result = run_inner_session(
        tmp_path,
        INNER_TESTS,
        [family_mutants.TWO_DEFECTS],
        "--generate-examples=1",
        "--generate-seed=1",
        "--world-sizes=2",
        f"--generate-database={tmp_path / 'examples'}",
        "--collective-timeout=20",
        timeout_s=600,
    )
    output = result.stdout + result.stderr
    (tmp_path / "inner-output.txt").write_text(output)
    assert result.returncode == 1, output[-3000:]
    failure = re.search(r"GeneratedProgramFailed: this campaign found \d+ distinct finding", output)
    assert failure is not None, output[-3000:]
    # Only the failure's own section: on CI (the CI or BUILD_NUMBER variable set) pytest prints the
    # whole message again, untruncated, in its short test summary, which would count each twice.
    report = output[failure.start() :].split("short test summary info", 1)[0]
    findings = re.split(r"=== finding \d+ of \d+ ===", report)[1:]
    assert len(findings) == 2, report[:3000]
    # The order check's seed ends with an eval forward, so its finding shows the eval defect too,
    # after its root cause: one finding is the eval defect alone, the other starts with the order.
    order_findings = [text for text in findings if "issued no forward-order warning" in text]
    eval_findings = [text for text in findings if "in eval mode" in text and text not in order_findings]
    assert len(eval_findings) == len(order_findings) == 1, report[:3000]
    assert all("REPRO: " in text for text in findings)
    summary = re.search(r"\] \d+ programs in .*?(\d+) distinct findings, (\d+) repeats set aside", output)
    assert summary is not None and int(summary[1]) == len(findings) and int(summary[2]) >= 1, output[-3000:]
