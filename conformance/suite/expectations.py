"""Known failures of a backend, recorded per scenario, and how they change a test's outcome.

A TOML file lists the scenarios a backend is known to fail. Which file, for the backend named
``<name>`` (the adapter's ``name``): ``<dir>/<name>.toml`` when ``--expectations-dir <dir>`` is
given; else the file the adapter class carries (``EXPECTATIONS``, see :func:`adapter_file`), so
a third-party package ships its own; else ``conformance/expectations/<name>.toml``::

    [[expected_failure]]
    scenario = "conformance/test_runtime.py::test_training[ws2-manual-HYBRID_SHARD-adam]"
    failure = "diverge from the single-process oracle"   # in the failure text, or a rank's stderr
    reason = "HYBRID_SHARD with 1-rank shard groups stops syncing gradients"
    link = "https://github.com/pytorch/pytorch/issues/..."   # optional
    when = { device = "cuda", torch = ">=2.11,<2.14", world_size = 2 }   # optional
    also = ["final parameters differ"]   # optional: later checks the same defect fails

A *scenario id* is the pytest node id with the backend's part removed from the parameter id:
``conformance/test_runtime.py::test_training[torch-fsdp2-ws2-auto-FULL_SHARD-sgd]`` is scenario
``conformance/test_runtime.py::test_training[ws2-auto-FULL_SHARD-sgd]`` of backend
``torch-fsdp2``; a test parametrized by the backend alone has the bare function id.

``when`` limits an entry to runs it describes: ``device`` ("cpu" / "cuda", or a list), ``torch``
(comma-separated PEP 440 comparisons of the torch version: ``==``, ``!=``, ``<``, ``<=``, ``>``,
``>=``, and ``==X.Y.*``; local tags such as ``+cpu`` are ignored) and ``world_size`` (an int or a
list). One scenario may have several entries whose conditions differ (a failure text that
differs between CPU and CUDA); an entry without ``when`` applies everywhere.

A known failure hides nothing behind it. The parent sends the entry's texts (``failure`` and
``also``) to the ranks; a check of the scenario (``harness.check``) whose assertion fails with one
of them is recorded and the scenario goes on, so its later checks still run. A later failure that
no text names fails the test, whatever the entry says (its text carries
``harness.DEFECT_BEHIND_KNOWN_FAILURE``); a consequence of the same defect in a later check is
named in ``also``, and every ``also`` text must be seen (an entry names what is known, and no
more). A library's exception is not gone past: the scenario stops there, as before.

Outcomes: a listed scenario that fails with the recorded text becomes xfail
("expected-fail: <reason>"); one that passes becomes a failure (the entry is out of date: remove
it); one that fails differently stays a failure. The reference backend may list nothing.

*Stale* entries describe nothing the run checked: their scenario matches no collected test
although the entry's file was collected whole, their file is one no run can collect a test from
(it does not exist, as in the matrix's short form ``test_runtime.py::test_training``, or it is
not a test file), or their test was skipped in a run the entry's ``when`` describes.
Deselected tests (``-k``, node ids) and tests skipped because the machine lacks the devices
(``--device cuda`` with too few GPUs) do not make an entry stale. The conformance plugin
reports stale entries, and ``--strict-expectations`` makes them fail the run (its last line
says so).
"""

from __future__ import annotations

import inspect
import operator
import re
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import DEFECT_BEHIND_KNOWN_FAILURE

try:  # torch's own copy (torch >= 2.2), so conditions need no extra package
    from torch._vendor.packaging.version import InvalidVersion, Version
except ImportError:  # pragma: no cover - a torch that stopped vendoring it; pytest requires packaging
    from packaging.version import InvalidVersion, Version

EXPECTATIONS_DIR = Path(__file__).parents[1] / "expectations"  # conformance/expectations/
NO_EXPECTATIONS_ALLOWED = frozenset({"reference"})
DEVICES = ("cpu", "cuda")
_KEYS = {"scenario", "failure", "reason", "link", "when", "also"}
_WHEN_KEYS = {"device", "torch", "world_size"}
_COMPARISONS: dict[str, Callable[[Any, Any], bool]] = {
    "==": operator.eq,
    "!=": operator.ne,
    "<=": operator.le,
    ">=": operator.ge,
    "<": operator.lt,
    ">": operator.gt,
}
_CLAUSE = re.compile(r"^\s*(==|!=|<=|>=|<|>)\s*([0-9][0-9A-Za-z.]*?)(\.\*)?\s*$")


class ExpectationsError(ValueError):
    """An expectations file that cannot be trusted; the message names file and entry."""


@dataclass(frozen=True)
class RunContext:
    """What a test ran on, as far as conditions care. ``device`` is None when the test could not
    run anywhere (too few GPUs); ``world_size`` is None for a test without ranks."""

    device: str | None
    torch_version: str
    world_size: int | None


@dataclass(frozen=True)
class Condition:
    """An entry's ``when``; empty fields match anything."""

    devices: tuple[str, ...] = ()
    torch: str = ""
    world_sizes: tuple[int, ...] = ()

    def matches(self, context: RunContext) -> bool:
        if self.devices and context.device not in self.devices:
            return False
        if self.world_sizes and context.world_size not in self.world_sizes:
            return False
        return not self.torch or torch_matches(self.torch, context.torch_version)

    def __bool__(self) -> bool:
        return bool(self.devices or self.torch or self.world_sizes)

    def __str__(self) -> str:
        parts = []
        if self.devices:
            parts.append(f"device {' or '.join(self.devices)}")
        if self.torch:
            parts.append(f"torch {self.torch}")
        if self.world_sizes:
            parts.append(f"world size {' or '.join(map(str, self.world_sizes))}")
        return ", ".join(parts) or "always"


@dataclass(frozen=True)
class ExpectedFailure:
    scenario: str
    failure: str
    reason: str
    link: str | None = None
    when: Condition = field(default_factory=Condition)
    also: tuple[str, ...] = ()
    """Texts of later checks the same defect fails (the scenario goes on past ``failure``)."""

    @property
    def texts(self) -> tuple[str, ...]:
        """Every text the entry expects: what the ranks' checks may go on past."""
        return (self.failure, *self.also)

    @property
    def file(self) -> str:
        """The scenario's test file, relative to the root directory."""
        return self.scenario.split("::", 1)[0]

    def describe(self) -> str:
        return f"{self.scenario} (when {self.when})" if self.when else self.scenario


@dataclass(frozen=True)
class GeneratedFinding:
    """A known failure of generated programs (``[[generated_finding]]``): a failing example whose
    program has ``pattern`` (``conformance.programs.patterns.PATTERNS``) and whose every finding
    contains one of the ``failure`` texts shows this finding, and is set aside so that a
    campaign goes on looking for others. ``program`` is the minimal program that shows it (the
    readable lines a failure printed), kept for the record."""

    pattern: str
    failure: tuple[str, ...]
    reason: str
    program: str = ""
    link: str | None = None
    when: Condition = field(default_factory=Condition)

    def explains(self, finding: str) -> bool:
        return any(text in finding for text in self.failure)


@dataclass(frozen=True)
class Judgement:
    """What a report becomes: outcome plus the xfail reason or the failure message to show."""

    outcome: str  # "passed" | "failed" | "skipped"
    xfail_reason: str | None = None
    message: str | None = None


class Expectations:
    """One backend's entries, looked up by scenario id and run context; ``source`` is the file
    they came from (None: the backend has none)."""

    def __init__(
        self,
        backend: str,
        entries: list[ExpectedFailure] | None = None,
        source: Path | None = None,
        generated: list[GeneratedFinding] | None = None,
    ) -> None:
        self.backend = backend
        self.entries = list(entries or [])
        self.generated = list(generated or [])
        """The known findings of generated programs (``[[generated_finding]]``)."""
        self.source = source
        self._by_scenario: dict[str, list[ExpectedFailure]] = {}
        for entry in self.entries:
            self._by_scenario.setdefault(entry.scenario, []).append(entry)

    def __iter__(self) -> Iterator[ExpectedFailure]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def matching(self, scenario: str, context: RunContext) -> list[ExpectedFailure]:
        """The entries of ``scenario`` whose conditions describe ``context``."""
        return [e for e in self._by_scenario.get(scenario, []) if e.when.matches(context)]


def torch_version_key(version: str) -> Version:
    """A torch version for comparisons: the public part (``2.13.0+cpu`` -> ``2.13.0``)."""
    return Version(Version(version).public)


def parse_torch_condition(text: str) -> list[tuple[str, Version, bool]]:
    """``">=2.11, <2.14"`` -> [(">=", 2.11, False), ("<", 2.14, False)]; the bool marks ``.*``."""
    clauses = []
    for part in text.split(","):
        found = _CLAUSE.match(part)
        if found is None:
            raise ValueError(
                f"{part.strip()!r} is not a version comparison; write e.g. '>=2.11', '<2.14', "
                "'==2.13.*', comma-separated"
            )
        op, number, wildcard = found.groups()
        if wildcard and op not in ("==", "!="):
            raise ValueError(f"{part.strip()!r}: '.*' only goes with == or !=")
        try:
            clauses.append((op, Version(number), bool(wildcard)))
        except InvalidVersion:
            raise ValueError(f"{part.strip()!r}: {number!r} is not a version") from None
    return clauses


def torch_matches(condition: str, version: str) -> bool:
    """Whether torch ``version`` satisfies every comparison in ``condition``."""
    have = torch_version_key(version)
    for op, wanted, wildcard in parse_torch_condition(condition):
        if wildcard:
            prefix = wanted.release
            same = have.release[: len(prefix)] == prefix
            result = same if op == "==" else not same
        else:
            result = _COMPARISONS[op](have, wanted)
        if not result:
            return False
    return True


def path_for(backend: str, directory: Path = EXPECTATIONS_DIR) -> Path:
    return directory / f"{backend}.toml"


def adapter_file(adapter_cls: type) -> Path | None:
    """The expectations file an adapter class carries (``EXPECTATIONS``, a path relative to the
    file of the module whose class sets it, or absolute), or None."""
    for klass in adapter_cls.__mro__:
        if "EXPECTATIONS" in vars(klass):
            declared = vars(klass)["EXPECTATIONS"]
            if declared is None:
                return None
            return (Path(inspect.getfile(klass)).parent / declared).resolve()
    return None


def load(backend: str, directory: Path = EXPECTATIONS_DIR) -> Expectations:
    """The backend's expected failures from ``directory/<backend>.toml`` (none without one)."""
    return load_file(backend, path_for(backend, directory))


def load_file(backend: str, path: Path) -> Expectations:
    """The backend's expected failures from ``path`` (none when it does not exist)."""
    if not path.exists():
        return Expectations(backend)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ExpectationsError(f"{path}: not valid TOML ({error})") from None
    unknown_tables = set(data) - {"expected_failure", "generated_finding"}
    if unknown_tables:
        raise ExpectationsError(
            f"{path}: unknown keys {sorted(unknown_tables)}; entries go in [[expected_failure]] "
            "(scenarios) and [[generated_finding]] (generated programs)"
        )
    entries: list[ExpectedFailure] = []
    seen: set[tuple[str, Condition]] = set()
    for index, raw in enumerate(data.get("expected_failure", [])):
        where = f"{path}: entry {index + 1}"
        unknown = set(raw) - _KEYS
        missing = {"scenario", "failure", "reason"} - set(raw)
        if unknown or missing:
            raise ExpectationsError(
                f"{where}: missing {sorted(missing)}, unknown {sorted(unknown)}; an entry has "
                "scenario, failure (text seen in the failure), reason, optional link, when and also"
            )
        text_fields = {k: v for k, v in raw.items() if k not in ("when", "also")}
        if not all(isinstance(v, str) and v.strip() for v in text_fields.values()):
            raise ExpectationsError(f"{where}: every field but 'when' and 'also' must be a non-empty string")
        also = raw.get("also", [])
        if not isinstance(also, list) or not all(isinstance(text, str) and text.strip() for text in also):
            raise ExpectationsError(
                f"{where}: 'also' must be a list of non-empty texts (later checks the same defect fails), not {also!r}"
            )
        entry = ExpectedFailure(**text_fields, when=_condition(raw.get("when"), where), also=tuple(also))
        if (entry.scenario, entry.when) in seen:
            raise ExpectationsError(
                f"{where}: scenario {entry.scenario!r} is listed twice"
                + (f" with the same condition ({entry.when})" if entry.when else "")
                + "; give each entry of a scenario a different 'when'"
            )
        seen.add((entry.scenario, entry.when))
        entries.append(entry)
    generated = [
        _generated_finding(raw, f"{path}: generated_finding {index + 1}")
        for index, raw in enumerate(data.get("generated_finding", []))
    ]
    if (entries or generated) and backend in NO_EXPECTATIONS_ALLOWED:
        raise ExpectationsError(
            f"{path}: the {backend} backend may not have expected failures ({len(entries) + len(generated)} "
            "listed); fix the reference backend instead"
        )
    return Expectations(backend, entries, source=path, generated=generated)


_GENERATED_KEYS = {"pattern", "failure", "reason", "program", "link", "when"}


def _generated_finding(raw: Any, where: str) -> GeneratedFinding:
    from conformance.programs.patterns import PATTERNS  # the suite's own program shapes

    unknown = set(raw) - _GENERATED_KEYS
    missing = {"pattern", "failure", "reason"} - set(raw)
    if unknown or missing:
        raise ExpectationsError(
            f"{where}: missing {sorted(missing)}, unknown {sorted(unknown)}; a generated finding has pattern "
            "(a name of conformance.programs.patterns.PATTERNS), failure (a text, or a list of texts, of its "
            "findings), reason, and optional program, link and when"
        )
    if raw["pattern"] not in PATTERNS:
        raise ExpectationsError(f"{where}: pattern {raw['pattern']!r} is not one of {sorted(PATTERNS)}")
    failure = raw["failure"]
    failures = (failure,) if isinstance(failure, str) else tuple(failure) if isinstance(failure, list) else ()
    if not failures or not all(isinstance(text, str) and text.strip() for text in failures):
        raise ExpectationsError(f"{where}: failure must be a non-empty text or a list of them")
    for key in ("reason", "program", "link"):
        if key in raw and not (isinstance(raw[key], str) and raw[key].strip()):
            raise ExpectationsError(f"{where}: {key} must be a non-empty string")
    return GeneratedFinding(
        pattern=raw["pattern"],
        failure=failures,
        reason=raw["reason"],
        program=raw.get("program", "").strip(),
        link=raw.get("link"),
        when=_condition(raw.get("when"), where),
    )


def _condition(raw: Any, where: str) -> Condition:
    if raw is None:
        return Condition()
    if not isinstance(raw, dict) or not raw:
        raise ExpectationsError(f"{where}: 'when' must be a non-empty table, e.g. when = {{ device = \"cuda\" }}")
    unknown = set(raw) - _WHEN_KEYS
    if unknown:
        raise ExpectationsError(f"{where}: 'when' has unknown keys {sorted(unknown)}; use {sorted(_WHEN_KEYS)}")
    devices = _string_list(raw.get("device", []), where, "device")
    bad = [d for d in devices if d not in DEVICES]
    if bad:
        raise ExpectationsError(f"{where}: when.device {bad} is not one of {list(DEVICES)}")
    torch_condition = raw.get("torch", "")
    if not isinstance(torch_condition, str):
        raise ExpectationsError(f"{where}: when.torch must be a string such as '>=2.11,<2.14'")
    if torch_condition:
        try:
            parse_torch_condition(torch_condition)
        except ValueError as error:
            raise ExpectationsError(f"{where}: when.torch: {error}") from None
    sizes = raw.get("world_size", [])
    sizes = [sizes] if isinstance(sizes, int) and not isinstance(sizes, bool) else sizes
    if not isinstance(sizes, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes):
        raise ExpectationsError(f"{where}: when.world_size must be a positive int or a list of them")
    return Condition(tuple(devices), torch_condition.strip(), tuple(sizes))


def _string_list(value: Any, where: str, key: str) -> list[str]:
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ExpectationsError(f"{where}: when.{key} must be a string or a list of strings")
    return values


def scenario_id(nodeid: str, backend_id: str) -> str:
    """``nodeid`` without ``backend_id`` in its parameter id (see the module docstring)."""
    base, bracket, rest = nodeid.partition("[")
    if not bracket or not rest.endswith("]"):
        raise ValueError(f"{nodeid!r} is not parametrized by a backend")
    ids = rest[:-1]
    if ids == backend_id:
        return base
    if ids.startswith(f"{backend_id}-"):
        remaining = ids[len(backend_id) + 1 :]
    elif ids.endswith(f"-{backend_id}"):
        remaining = ids[: -len(backend_id) - 1]
    elif f"-{backend_id}-" in ids:
        remaining = ids.replace(f"-{backend_id}-", "-", 1)
    else:
        raise ValueError(f"{nodeid!r} does not contain backend id {backend_id!r}")
    return f"{base}[{remaining}]"


def judge(
    entry: ExpectedFailure | None,
    outcome: str,
    failure_text: str,
    ranks_stderr: Mapping[int, str] | None = None,
) -> Judgement | None:
    """The new outcome of a call-phase report, or None to leave it as it is. The entry's text
    may be in the failure or in what a rank wrote to stderr (``ranks_stderr``, by rank): a rank
    that died in C++ (gloo's abort on a size mismatch) says why there, not in an exception."""
    if entry is None or outcome == "skipped":
        return None
    if outcome == "passed":
        return Judgement(
            "failed",
            message=(
                f"unexpected pass: {entry.describe()} is listed as an expected failure "
                f"({entry.reason}); remove the entry from the backend's expectations file"
            ),
        )
    if DEFECT_BEHIND_KNOWN_FAILURE in failure_text:
        return Judgement(
            "failed",
            message=(
                f"{entry.describe()} is an expected failure ({entry.reason}), and the scenario went on "
                f"past it and failed again in a way the entry does not name: {DEFECT_BEHIND_KNOWN_FAILURE} "
                "(below). Fix that defect; if it is the known defect's consequence, add its text to the "
                "entry's 'also'"
            ),
        )
    stderr = ranks_stderr or {}
    searched = "the failure" + (f" nor in the stderr of ranks {sorted(stderr)}" if stderr else "")
    if not _seen(entry.failure, failure_text, stderr):
        return Judgement(
            "failed",
            message=(
                f"{entry.describe()} is an expected failure ({entry.reason}) but failed "
                f"differently: the recorded text {entry.failure!r} is not in {searched}"
            ),
        )
    unseen = [text for text in entry.also if not _seen(text, failure_text, stderr)]
    if unseen:
        return Judgement(
            "failed",
            message=(
                f"{entry.describe()} failed as expected ({entry.reason}), but its later checks did not "
                f"fail as the entry's 'also' says: {unseen} not in {searched}; remove them from 'also' "
                "(an entry names what is known, and no more)"
            ),
        )
    return Judgement("skipped", xfail_reason=f"expected-fail: {entry.reason}")


def _seen(text: str, failure_text: str, stderr: Mapping[int, str]) -> bool:
    return text in failure_text or any(text in rank_text for rank_text in stderr.values())


def ambiguous(entries: list[ExpectedFailure]) -> Judgement:
    """A failure for a test that several entries describe at once."""
    conditions = "; ".join(str(e.when) for e in entries)
    return Judgement(
        "failed",
        message=(
            f"{entries[0].scenario} matches {len(entries)} expected-failure entries at once "
            f"(when: {conditions}); make their 'when' conditions exclusive"
        ),
    )


@dataclass(frozen=True)
class StaleEntry:
    backend: str
    entry: ExpectedFailure
    why: str

    def __str__(self) -> str:
        return f"{self.backend}: {self.entry.describe()}: {self.why}"


@dataclass
class RunRecord:
    """What one session collected and skipped, per backend selection, for the stale report."""

    collected: dict[str, set[str]] = field(default_factory=dict)  # selection -> scenario ids
    collected_files: set[str] = field(default_factory=set)
    skipped: dict[tuple[str, str], tuple[RunContext, str]] = field(default_factory=dict)

    def note_collected(self, selection: str, scenario: str) -> None:
        self.collected.setdefault(selection, set()).add(scenario)
        self.collected_files.add(scenario.split("::", 1)[0])

    def note_skipped(self, selection: str, scenario: str, context: RunContext, reason: str) -> None:
        self.skipped[selection, scenario] = (context, reason)


def stale_entries(
    expected: dict[str, Expectations],
    record: RunRecord,
    covered: Callable[[str], bool],
    never_collected: Callable[[str], str | None] = lambda file: None,
) -> list[StaleEntry]:
    """Entries describing nothing this run checked (module docstring). ``covered(file)``: the
    run asked for that whole file (not a subset of its tests by node id). ``never_collected(file)``:
    why no run could collect a test from ``file`` (it does not exist, it is not a test file), or
    None; such an entry is stale whatever the run selected."""
    stale = []
    for selection, entries in expected.items():
        collected = record.collected.get(selection, set())
        for entry in entries:
            if entry.scenario not in collected:
                unreachable = never_collected(entry.file)
                if unreachable is not None:
                    stale.append(StaleEntry(selection, entry, unreachable + _full_form_hint(entry, record)))
                elif entry.file in record.collected_files and covered(entry.file):
                    stale.append(
                        StaleEntry(selection, entry, "matches no collected test" + _node_id_hint(entry, selection))
                    )
                continue
            skipped = record.skipped.get((selection, entry.scenario))
            if skipped is not None and entry.when.matches(skipped[0]):
                stale.append(StaleEntry(selection, entry, f"its test was skipped ({skipped[1]})"))
    return stale


def _full_form_hint(entry: ExpectedFailure, record: RunRecord) -> str:
    """For a scenario id written without its directory (the matrix's short form), the id to write."""
    candidates = sorted(f for f in record.collected_files if f.endswith("/" + entry.file))
    if not candidates:
        return ""
    return (
        "; a scenario id starts with the test file's path from the root directory: "
        f"{candidates[0]}::{entry.scenario.partition('::')[2]}"
    )


def _node_id_hint(entry: ExpectedFailure, backend: str) -> str:
    """For a scenario id copied from a test id with the backend still in it, the id to write."""
    try:
        without = scenario_id(entry.scenario, backend)
    except ValueError:
        return ""
    return f"; a scenario id leaves out the backend: {without}"
