"""Parent side of generated conformance: options, budgets, campaigns, known findings, progress.

``conformance/test_generated.py`` draws programs with hypothesis in the pytest process and runs
each on a warm pool through the harness's SPMD calls; this module gives it, as the
``generation`` fixture, everything that is the session's rather than the scenario's:

- **the budget.** By default (the README's test command, CI) a fixed, derandomized set of
  :data:`CI_EXAMPLES` programs per backend at world size 2, no example database: the same
  programs every run, in seconds per backend (docs/generated.md, "Budgets and campaigns", has
  the figures). ``--generate-examples N`` or
  ``--generate-seconds S`` make it a campaign: random programs from a seed printed at the start
  (``--generate-seed`` replays one), at the world sizes of ``--world-sizes`` (default 2 and 4),
  with an example database per backend (``--generate-database``, default
  ``.hypothesis/generated/<backend>``) that keeps every failure, so the next campaign tries it
  first. A campaign goes on past each finding: it keeps the shrunk program, sets aside what
  repeats its root cause (:meth:`CampaignFindings.repeats`) and fails at the end with every
  distinct finding;
- **known findings**: the backend's ``[[generated_finding]]`` entries
  (``conformance.suite.expectations``) that apply to this device, torch and world size;
- **the minimal repro**: the ``REPRO:`` command of a failing program (``--generate-replay``
  runs exactly that program) and, with ``--export-repro DIR``, a standalone torchrun script for
  the torch backends (``conformance.programs.export``);
- **progress**: one line per example during a campaign, past pytest's capture.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import torch

import harness
from conformance.programs import codec
from conformance.programs.program import Program
from conformance.suite import expectations

CI_EXAMPLES = 30
"""Drawn programs per backend in the derandomized default run, after the seed programs (9 to 26
per backend): a count, not a time; what it takes per backend is measured in docs/generated.md
("Budgets and campaigns")."""
CI_HYPOTHESIS = "6.170.17"
"""The hypothesis release the derandomized set was recorded against (pinned by the ``draws`` extra
in pyproject.toml, which the ``test`` extra and every CI leg install): derandomized draws are the
same every run of one release but not across releases, so under another one the default set is
other programs, and the summary line says so."""
CAMPAIGN_WORLD_SIZES = (2, 4)
CAMPAIGN_MAX_FINDINGS = 20
"""A campaign stops after this many distinct findings: past that, fixing some and running again
finds the rest faster than shrinking each."""
EXAMPLE_TIMEOUT_S = 180.0
"""One program's deadline on its ranks (a hang is stopped earlier by the one-sided watch)."""


def add_options(group: Any) -> None:
    group.addoption(
        "--generate-examples",
        type=int,
        default=None,
        metavar="N",
        help="generated programs: run a campaign of N random programs per backend (default: a fixed, "
        f"derandomized set of {CI_EXAMPLES})",
    )
    group.addoption(
        "--generate-seconds",
        type=float,
        default=None,
        metavar="S",
        help="generated programs: run random programs per backend for S seconds, a campaign "
        "(default: none, the fixed derandomized set)",
    )
    group.addoption(
        "--generate-seed",
        type=int,
        default=None,
        metavar="SEED",
        help="generated programs: the campaign's seed (default: a new one, printed at the start)",
    )
    group.addoption(
        "--generate-database",
        default=None,
        metavar="DIR",
        help="generated programs: where a campaign keeps the failing examples it found, per backend "
        "(default: <rootdir>/.hypothesis/generated/<backend>)",
    )
    group.addoption(
        "--generate-replay",
        default=None,
        metavar="PROGRAM",
        help="generated programs: run exactly this program (the text of a REPRO: line) and nothing else "
        "(default: none, draw programs)",
    )
    group.addoption(
        "--export-repro",
        default=None,
        metavar="DIR",
        help="generated programs: write each failing program of a torch backend as a standalone torchrun "
        "script (native API calls, no suite) into DIR (default: none, no script)",
    )


def repro_options() -> dict[str, harness.ReproPolicy]:
    """What a failed distributed test's REPRO line does with the options above: none of them
    changes a distributed test (the generated test writes its own REPRO line)."""
    why = "it configures the generated-program test, which prints its own REPRO line"
    return {
        option: harness.NotCarried(why)
        for option in (
            "--generate-examples",
            "--generate-seconds",
            "--generate-seed",
            "--generate-database",
            "--generate-replay",
            "--export-repro",
        )
    }


@dataclass
class Progress:
    """A campaign's running count, shown one line per example."""

    started: float = field(default_factory=time.monotonic)
    examples: int = 0
    passed: int = 0
    known: int = 0
    repeats: int = 0
    failing: int = 0
    sharded: int = 0
    drawn: int = 0
    """Programs a campaign drew beyond the seeds, shrinking not counted (``--generate-examples``)."""

    def rate(self) -> float:
        return self.examples / max(1e-9, time.monotonic() - self.started)


class Generation:
    """One backend's generated-program run, as the ``generation`` fixture gives it."""

    def __init__(self, request: pytest.FixtureRequest, selection: str, name: str, expected: expectations.Expectations):
        config = request.config
        self.config = config
        self.nodeid = request.node.nodeid
        self.selection = selection
        self.name = name
        self.expected = expected
        options = config.option
        self.examples: int | None = options.generate_examples
        self.seconds: float | None = options.generate_seconds
        self.campaign = self.examples is not None or self.seconds is not None
        for flag, value in (("--generate-examples", self.examples), ("--generate-seconds", self.seconds)):
            if value is not None and value <= 0:
                raise pytest.UsageError(f"{flag} {value}: give a positive number")
        self.seed: int | None = options.generate_seed
        if self.campaign and self.seed is None:
            self.seed = int.from_bytes(os.urandom(4), "little")
        replay = options.generate_replay
        self.replay: Program | None = codec.decode(replay) if replay else None
        self.export_dir = options.export_repro
        database = options.generate_database
        self.database_dir = Path(database) / name if database else config.rootpath / ".hypothesis" / "generated" / name
        self.progress = Progress()
        self.findings = CampaignFindings()
        self.world_sizes = self._world_sizes()
        self.ci_examples = CI_EXAMPLES
        self.timeout_s = EXAMPLE_TIMEOUT_S

    def _world_sizes(self) -> tuple[int, ...]:
        if not self.campaign:
            return (2,)
        given = self.config.option.world_sizes
        if not given:
            return CAMPAIGN_WORLD_SIZES
        sizes = tuple(int(part) for part in str(given).split(",") if part.strip())
        usable = tuple(size for size in sizes if size >= 2)
        if not usable:
            raise pytest.UsageError(f"--world-sizes {given}: generated programs need a world size of 2 or more")
        return usable

    def known(self, world_size: int) -> list[expectations.GeneratedFinding]:
        """The recorded generated findings that apply to a program at ``world_size`` here."""
        device = harness.world_device(self.config, world_size)
        context = expectations.RunContext(device=device, torch_version=torch.__version__, world_size=world_size)
        return [entry for entry in self.expected.generated if entry.when.matches(context)]

    def repro(self, program: Program) -> str:
        """The command that replays exactly ``program`` on this backend."""
        args = [
            sys.executable,
            "-m",
            "pytest",
            self.nodeid,
            "--backend",
            self.selection,
            "--generate-replay",
            codec.encode(program),
            "-p",
            "no:cacheprovider",
        ]
        explicit = self.config.option.expectations_dir
        if explicit:
            args += ["--expectations-dir", explicit]
        return f"cd {shlex.quote(str(self.config.rootpath))} && {shlex.join(args)}"

    def announce(self) -> None:
        if not self.campaign:
            return
        budget = f"{self.examples} programs" if self.examples is not None else f"{self.seconds:g} s"
        self.say(
            f"[generated {self.name}] campaign of {budget} at world sizes {list(self.world_sizes)}, "
            f"seed {self.seed} (replay the campaign with --generate-seed {self.seed}); "
            f"example database {self.database_dir}"
        )

    def note(self, program: Program, kind: str, sharded: bool) -> None:
        """Count one example (and show it, in a campaign)."""
        progress = self.progress
        progress.examples += 1
        progress.sharded += int(sharded)
        if kind == "passed":
            progress.passed += 1
        elif kind == "known":
            progress.known += 1
        elif kind == "repeat":
            progress.repeats += 1
        else:
            progress.failing += 1
        if self.campaign:
            first = program.lines()[2] if len(program.lines()) > 2 else ""
            self.say(
                f"[generated {self.name}] {progress.examples} programs ({progress.rate():.2f}/s): "
                f"{progress.passed} passed, {progress.known} known findings set aside, "
                f"{len(self.findings)} findings ({progress.repeats} repeats set aside), "
                f"{progress.failing} failing (shrinking) | last: {kind}, {len(program.operations)} ops, {first}"
            )

    def summary(self) -> str:
        """One line for the end of a run: how many programs, how fast, what became of them."""
        progress = self.progress
        elapsed = time.monotonic() - progress.started
        return (
            f"[generated {self.name}] {progress.examples} programs in {elapsed:.1f} s ({progress.rate():.2f}/s): "
            f"{progress.passed} passed, {progress.known} showed known findings, {progress.failing} failed"
            + (
                f"; {len(self.findings)} distinct findings, {progress.repeats} repeats set aside; "
                f"campaign seed {self.seed}"
                if self.campaign
                else f"; {derandomized_set()}"
            )
        )

    def budget_spent(self) -> bool:
        """Whether the campaign is over: its programs drawn or its time up, or too many findings."""
        if len(self.findings) >= CAMPAIGN_MAX_FINDINGS:
            return True
        if self.examples is not None:
            return self.progress.drawn >= self.examples
        return self.seconds is not None and time.monotonic() - self.progress.started >= self.seconds

    def examples_left(self) -> int:
        """How many more programs a ``--generate-examples`` campaign draws (at least one)."""
        return max(1, (self.examples or 0) - self.progress.drawn)

    def record(self, report: str, root_cause: frozenset[str]) -> None:
        """Keep one shrunk finding of the campaign, and show it now."""
        number = self.findings.add(report, root_cause)
        self.say(
            f"[generated {self.name}] finding {number} of this campaign, shrunk (the campaign goes on; "
            f"programs that show only this again are set aside):\n{report}"
        )
        if number >= CAMPAIGN_MAX_FINDINGS:
            self.say(
                f"[generated {self.name}] {number} distinct findings: the campaign stops here; fix some, "
                f"then run it again (--generate-seed {self.seed} replays it)"
            )

    def findings_report(self) -> str:
        """Every finding of the campaign, each with its minimal program and REPRO line."""
        count = len(self.findings)
        parts = [
            f"this campaign found {count} distinct finding{'s' if count != 1 else ''} on {self.name} "
            f"(seed {self.seed}); each is shrunk to its minimal program, with the command that replays it:"
        ]
        for number, finding in enumerate(self.findings.found, 1):
            parts.append(f"=== finding {number} of {count} ===\n{finding.report}")
        return "\n\n".join(parts)

    def say(self, line: str) -> None:
        """Write ``line`` to the terminal now, past pytest's output capture."""
        capture = self.config.pluginmanager.getplugin("capturemanager")
        reporter = self.config.pluginmanager.getplugin("terminalreporter")
        if reporter is None:
            return
        with capture.global_and_fixture_disabled() if capture is not None else _nothing():
            reporter.write_line(line)


@dataclass(frozen=True)
class CampaignFinding:
    """One distinct finding of a campaign: the whole report of its shrunk program, and its root
    cause (``conformance.programs.example_verdict.ExampleVerdict.root_cause``), by which later examples
    that repeat it are known."""

    report: str
    root_cause: frozenset[str]


class CampaignFindings:
    """The distinct findings of one campaign, in the order found, and which failures repeat them."""

    def __init__(self) -> None:
        self.found: list[CampaignFinding] = []
        self._causes: set[str] = set()

    def __len__(self) -> int:
        return len(self.found)

    def repeats(self, root_cause: frozenset[str]) -> bool:
        """Whether a failure with ``root_cause`` shows only what was found already: each of its
        causes (a rank's findings at its first failing operation, by check)
        is an earlier finding's. Such a failure is set aside, so that the campaign goes on looking
        for others, as a recorded known finding is. What follows from a root cause is not another
        finding; a defect that shows only after an earlier one is masked until that is fixed."""
        return bool(root_cause) and root_cause <= self._causes

    def add(self, report: str, root_cause: frozenset[str]) -> int:
        """Keep one finding; returns its number (1 for the first)."""
        self.found.append(CampaignFinding(report, root_cause))
        self._causes |= root_cause
        return len(self.found)


def derandomized_set(installed: str | None = None) -> str:
    """Which derandomized set ran: the one CI runs, or another one under another hypothesis."""
    installed = installed or hypothesis.__version__
    if installed == CI_HYPOTHESIS:
        return f"the derandomized set of hypothesis {installed}, the one CI runs"
    return (
        f"the derandomized set of hypothesis {installed}, not CI's ({CI_HYPOTHESIS}): other programs; "
        f"pip install -e '.[draws]' runs CI's"
    )


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


def backend_generation(
    request: pytest.FixtureRequest, selection: str, name: str, expected: expectations.Expectations
) -> Iterator[Generation]:
    generation = Generation(request, selection, name, expected)
    generation.announce()
    yield generation
