"""The walk from ``--backend`` to a scenario resolves each selection once, in pytest.

The conformance plugin turns every ``--backend`` into a ``SelectedBackend`` in ``pytest_configure``
(``registry.resolve``: the name looked up, the adapter imported); tests are parametrized with a
``registry.BackendParam`` that carries the resolved ``module:attr``, and a rank opens the backend
from it without looking a name up again (no entry-point scan per test, per rank). Counted here in
an inner session, in the pytest process and in every rank, by wrapping the registry's lookups.
"""

from __future__ import annotations

import collections
import pickle
from pathlib import Path

from conformance.suite import registry
from tests.conformance_tests.adapter_testing import run_inner_session

COUNTER = '''
"""Counts the registry's name lookups per process (loaded with -p here, and in every rank as a
rank fixture module): one line per call, "<pid> <function> <argument>"."""
import os

from conformance.suite import registry

_CALLS = os.environ["RESOLUTION_CALLS"]


def _counted(function):
    def counted(selection, *args, **kwargs):
        with open(_CALLS, "a") as calls:
            calls.write(f"{os.getpid()} {function.__name__} {selection}\\n")
        return function(selection, *args, **kwargs)

    return counted


for _name in ("load", "target_of", "resolve", "select", "name_of"):
    setattr(registry, _name, _counted(getattr(registry, _name)))
'''

TESTS = """
import pytest
import torch
import torch.nn as nn

from conformance.protocol import ShardingSpec, ShardingStrategy


def _train(backend, device):
    spec = ShardingSpec(strategy=ShardingStrategy.FULL_SHARD)
    model = backend.shard(nn.Linear(4, 4).to(device), spec, backend.forms()[0])
    backend.backward(model, model(torch.ones(2, 4, device=device)).sum())


@pytest.mark.world_size(2)
def test_one(backend, device):
    _train(backend, device)


@pytest.mark.world_size(2)
def test_two(backend, device):
    _train(backend, device)


@pytest.mark.world_size(2)
def test_three(backend, device):
    _train(backend, device)


def test_in_pytest(backend):
    # A parent-side test sees the selection as given, with what it resolved to.
    assert backend in ("reference", "torch-fsdp1")
    assert backend.target.startswith("conformance.adapters.")
"""


def test_each_selection_is_resolved_once_in_pytest_and_never_in_a_rank(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "resolution_counter.py").write_text(COUNTER)
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("RESOLUTION_CALLS", str(calls))
    result = run_inner_session(
        tmp_path,
        TESTS,
        ["reference", "torch-fsdp1"],
        "-p",
        "resolution_counter",
        "-o",
        "rank_fixture_modules=conformance.suite.backend_fixture\nresolution_counter",
    )
    assert result.returncode == 0, result.stdout
    assert "8 passed" in result.stdout, result.stdout
    lines = [line.split(maxsplit=2) for line in calls.read_text().splitlines()]
    by_process: dict[str, collections.Counter[tuple[str, str]]] = collections.defaultdict(collections.Counter)
    for pid, function, argument in lines:
        by_process[pid][(function, argument)] += 1
    resolved = ("resolve", "['reference', 'torch-fsdp1']")
    pytest_pid = next(pid for pid, counts in by_process.items() if resolved in counts)
    in_pytest = by_process.pop(pytest_pid)
    # resolve() looks each name up once (target_of); nothing else asks the registry again.
    assert in_pytest == {
        resolved: 1,
        ("target_of", "reference"): 1,
        ("target_of", "torch-fsdp1"): 1,
    }, in_pytest
    # The ranks ran 6 tests of 2 backends on 2 ranks and looked no name up.
    assert dict(by_process) == {}, by_process


def test_a_backend_param_is_its_selection_and_travels_to_a_rank_whole() -> None:
    param = registry.BackendParam("torch-fsdp2", "torch-fsdp2", "conformance.adapters.torch_fsdp2:TorchFSDP2Adapter")
    assert param == "torch-fsdp2" and f"--backend {param}" == "--backend torch-fsdp2"
    travelled = pickle.loads(pickle.dumps(param, protocol=pickle.HIGHEST_PROTOCOL))
    assert (travelled, travelled.name, travelled.target) == (param, param.name, param.target)
    assert type(travelled) is registry.BackendParam


def test_a_rank_opens_a_param_from_its_target_not_its_name(monkeypatch) -> None:
    """A param's target is what is imported: a name that no longer resolves does not matter."""
    param = registry.BackendParam("renamed-since", "reference", "conformance.adapters.reference:ReferenceAdapter")
    monkeypatch.setattr(registry, "target_of", lambda selection: (_ for _ in ()).throw(AssertionError(selection)))
    assert registry.adapter_class(param).__name__ == "ReferenceAdapter"
