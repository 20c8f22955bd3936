"""The suite catches broken backends: every mutation of ``mutant_backends`` fails its scenarios.

One inner pytest session (the repository's own configuration, an empty expectations
directory) runs, for each built-in backend, the scenarios that must catch each mutation, plus
the same scenarios on the unmutated backend as the control: a mutant's failure then shows the
mutation, not a broken session or adapter. Each mutant must fail every scenario listed for it,
with a message naming a parameter and the size of its difference. Scenarios run at world size 2
with FULL_SHARD over auto-wrapped units (reduce-scatter and all-gather both in use); only the
listed node ids run, not the suite per mutant.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import fixtures
import mutant_backends
from conformance import registry

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SESSION_TIMEOUT_S = 600
# A mutant that made ranks disagree fails in seconds instead of the default 30 s per hang.
COLLECTIVE_TIMEOUT_S = 10
TRAINING = "conformance/test_runtime.py::test_training[{backend}-ws2-auto-FULL_SHARD-sgd]"
AFTER_TRAINING = (
    "conformance/test_runtime.py::test_unshard_after_training[{backend}-ws2-auto-FULL_SHARD-no_param_offload]"
)
# The scenarios that must catch each mutation (every one of them must fail).
CATCHERS: dict[str, tuple[str, ...]] = {
    "sum_grads": (TRAINING,),
    "doubled_reduce_scatter": (TRAINING,),
    "swapped_all_gather": (TRAINING, AFTER_TRAINING),
    "zeroed_all_gather": (TRAINING,),
    "stale_shard": (TRAINING, AFTER_TRAINING),
    "stale_unshard_view": (AFTER_TRAINING,),
}
CONTROLS = (TRAINING, AFTER_TRAINING)
BACKENDS = tuple(registry.BUILTIN)
PARAMETERS = frozenset(name for name, _ in fixtures.CompositeModel(dim=4).named_parameters())
# "  unit2.out.bias: max abs difference 0.0123 (relative 0.5) at index (3,)"
DIFFERENCE = re.compile(r"^\s+(?P<name>[\w.]+): max abs difference (?P<size>[0-9.e+-]+)", re.M)
assert set(CATCHERS) == set(mutant_backends.MUTATIONS), "every mutation needs its catchers"


def _node_ids() -> list[str]:
    ids = [node.format(backend=backend) for backend in BACKENDS for node in CONTROLS]
    for backend in BACKENDS:
        for mutation, nodes in CATCHERS.items():
            ids += [node.format(backend=mutant_backends.selection(backend, mutation)) for node in nodes]
    return ids


def _selections() -> list[str]:
    return [*BACKENDS, *(mutant_backends.selection(b, m) for b in BACKENDS for m in CATCHERS)]


@pytest.fixture(scope="module")
def inner_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """Run the inner session once: test name (function[params]) -> (outcome, failure text)."""
    directory = tmp_path_factory.mktemp("mutants")
    (directory / "expectations").mkdir()  # raw outcomes: no expected failures
    junit = directory / "junit.xml"
    command = [
        sys.executable, "-m", "pytest", *_node_ids(),
        "-c", str(REPO / "pyproject.toml"), "--rootdir", str(REPO), "-p", "no:cacheprovider",
        "--reports-dir", str(directory / "reports"),
        "--expectations-dir", str(directory / "expectations"),
        f"--junitxml={junit}", "-q", f"--collective-timeout={COLLECTIVE_TIMEOUT_S}",
        *[arg for selection in _selections() for arg in ("--backend", selection)],
    ]
    python_path = os.pathsep.join(filter(None, [str(REPO), str(HERE), os.environ.get("PYTHONPATH")]))
    try:
        result = subprocess.run(
            command, cwd=REPO, env={**os.environ, "PYTHONPATH": python_path}, text=True,
            capture_output=True, timeout=SESSION_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"the mutant session ran over {SESSION_TIMEOUT_S}s:\n{expired.stdout}")
    output = result.stdout[-20000:] + result.stderr[-5000:]
    assert junit.exists(), f"the mutant session wrote no JUnit report:\n{output}"
    results = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        skipped = case.find("skipped")
        if failure is not None:
            results[case.get("name")] = ("failed", f"{failure.get('message', '')}\n{failure.text or ''}")
        elif skipped is not None:
            results[case.get("name")] = ("skipped", skipped.get("message", ""))
        else:
            results[case.get("name")] = ("passed", "")
    expected = len(_node_ids())
    assert len(results) == expected, f"{len(results)} of {expected} tests reported:\n{output}"
    return results


def _name(node: str) -> str:
    return node.split("::", 1)[1]


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_unmutated_backends_pass(inner_results: dict[str, tuple[str, str]], backend_name: str) -> None:
    for node in CONTROLS:
        outcome, text = inner_results[_name(node.format(backend=backend_name))]
        assert outcome == "passed", f"the control {node.format(backend=backend_name)} {outcome}:\n{text}"


# Not named `backend`: the conformance plugin parametrizes every test taking that argument.
@pytest.mark.parametrize("mutation", list(CATCHERS))
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_mutant_fails_naming_parameter_and_difference(
    inner_results: dict[str, tuple[str, str]], backend_name: str, mutation: str
) -> None:
    selection = mutant_backends.selection(backend_name, mutation)
    for node in CATCHERS[mutation]:
        test = _name(node.format(backend=selection))
        outcome, text = inner_results[test]
        assert outcome == "failed", (
            f"{test}: a backend with {mutant_backends.MUTATIONS[mutation]} {outcome}"
        )
        named = [
            (found["name"], float(found["size"])) for found in DIFFERENCE.finditer(text)
            if found["name"] in PARAMETERS
        ]
        assert named and all(size > 0 for _, size in named), (
            f"{test}: the failure names no parameter with the size of its difference:\n{text[-4000:]}"
        )
