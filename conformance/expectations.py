"""Known failures of a backend, recorded per scenario, and how they change a test's outcome.

``conformance/expectations/<backend>.toml`` lists the scenarios a backend is known to fail::

    [[expected_failure]]
    scenario = "conformance/test_runtime.py::test_training[ws2-manual-HYBRID_SHARD]"
    failure = "diverge from the single-process oracle"   # must appear in the failure text
    reason = "HYBRID_SHARD with 1-rank shard groups stops syncing gradients"
    link = "https://github.com/pytorch/pytorch/issues/..."   # optional

A *scenario id* is the pytest node id with the backend's part removed from the parameter id:
``conformance/test_runtime.py::test_training[torch-fsdp2-ws2-auto-FULL_SHARD]`` is scenario
``conformance/test_runtime.py::test_training[ws2-auto-FULL_SHARD]`` of backend ``torch-fsdp2``;
a test parametrized by the backend alone has the bare function id.

Outcomes: a listed scenario that fails with the recorded text becomes xfail
("expected-fail: <reason>"); one that passes becomes a failure (the entry is stale: remove
it); one that fails differently stays a failure. The reference backend may list nothing.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

EXPECTATIONS_DIR = Path(__file__).parent / "expectations"
NO_EXPECTATIONS_ALLOWED = frozenset({"reference"})
_KEYS = {"scenario", "failure", "reason", "link"}


class ExpectationsError(ValueError):
    """An expectations file that cannot be trusted; the message names file and entry."""


@dataclass(frozen=True)
class ExpectedFailure:
    scenario: str
    failure: str
    reason: str
    link: str | None = None


@dataclass(frozen=True)
class Judgement:
    """What a report becomes: outcome plus the xfail reason or the failure message to show."""

    outcome: str  # "passed" | "failed" | "skipped"
    xfail_reason: str | None = None
    message: str | None = None


def path_for(backend: str, directory: Path = EXPECTATIONS_DIR) -> Path:
    return directory / f"{backend}.toml"


def load(backend: str, directory: Path = EXPECTATIONS_DIR) -> dict[str, ExpectedFailure]:
    """The backend's expected failures by scenario id (empty when it has no file)."""
    path = path_for(backend, directory)
    if not path.exists():
        return {}
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ExpectationsError(f"{path}: not valid TOML ({error})") from None
    unknown_tables = set(data) - {"expected_failure"}
    if unknown_tables:
        raise ExpectationsError(
            f"{path}: unknown keys {sorted(unknown_tables)}; entries go in [[expected_failure]]"
        )
    entries: dict[str, ExpectedFailure] = {}
    for index, raw in enumerate(data.get("expected_failure", [])):
        where = f"{path}: entry {index + 1}"
        unknown = set(raw) - _KEYS
        missing = {"scenario", "failure", "reason"} - set(raw)
        if unknown or missing:
            raise ExpectationsError(
                f"{where}: missing {sorted(missing)}, unknown {sorted(unknown)}; an entry has "
                "scenario, failure (text seen in the failure), reason and optional link"
            )
        if not all(isinstance(raw[k], str) and raw[k].strip() for k in raw):
            raise ExpectationsError(f"{where}: every field must be a non-empty string")
        entry = ExpectedFailure(**raw)
        if entry.scenario in entries:
            raise ExpectationsError(f"{where}: scenario {entry.scenario!r} is listed twice")
        entries[entry.scenario] = entry
    if entries and backend in NO_EXPECTATIONS_ALLOWED:
        raise ExpectationsError(
            f"{path}: the {backend} backend may not have expected failures ({len(entries)} "
            "listed); fix the reference backend instead"
        )
    return entries


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


def judge(entry: ExpectedFailure | None, outcome: str, failure_text: str) -> Judgement | None:
    """The new outcome of a call-phase report, or None to leave it as it is."""
    if entry is None or outcome == "skipped":
        return None
    if outcome == "passed":
        return Judgement(
            "failed",
            message=(
                f"unexpected pass: {entry.scenario} is listed as an expected failure "
                f"({entry.reason}); remove the entry from the backend's expectations file"
            ),
        )
    if entry.failure in failure_text:
        return Judgement("skipped", xfail_reason=f"expected-fail: {entry.reason}")
    return Judgement(
        "failed",
        message=(
            f"{entry.scenario} is an expected failure ({entry.reason}) but failed "
            f"differently: the recorded text {entry.failure!r} is not in the failure"
        ),
    )
