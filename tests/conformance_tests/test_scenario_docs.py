"""docs/scenarios.md names every scenario id as it is generated: each id collected for the
reference backend (at each scenario's default world sizes) matches a documented pattern, whose
``{a,b}`` groups expand like a shell's. An axis added to a scenario without its docs fails here."""

from __future__ import annotations

import os
import re
import sys

from adapter_testing import REPO

from tests.support.warm_pytest import run_pytest

_PATTERN = re.compile(r"`(test_\w+(?:\[[^`]*\])?)`")
_GROUP = re.compile(r"\{([^{}]*)\}")


def expand(pattern: str) -> list[str]:
    """Shell-like brace expansion: ``a{b,c}`` -> ``ab``, ``ac``."""
    group = _GROUP.search(pattern)
    if group is None:
        return [pattern]
    head, tail = pattern[: group.start()], pattern[group.end() :]
    return [name for choice in group.group(1).split(",") for name in expand(head + choice + tail)]


def test_every_generated_scenario_id_is_documented(tmp_path) -> None:
    documented = {
        name for pattern in _PATTERN.findall((REPO / "docs/scenarios.md").read_text()) for name in expand(pattern)
    }
    command = [sys.executable, "-m", "pytest", "conformance", "--backend", "reference", "--collect-only", "-q"]
    command += ["-p", "no:cacheprovider", "--reports-dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = run_pytest(command, cwd=REPO, env=env, timeout=120)
    ids = [line.split("::", 1)[1] for line in result.stdout.splitlines() if "::" in line]
    assert ids, result.stdout + result.stderr
    generated = [re.sub(r"\[reference-?", "[", scenario).replace("[]", "") for scenario in ids]
    undocumented = sorted(scenario for scenario in generated if scenario not in documented)
    assert undocumented == [], f"{len(undocumented)} scenario ids missing from docs/scenarios.md: {undocumented[:10]}"
