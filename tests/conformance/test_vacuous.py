"""No vacuous verdict: a backend that can run nothing is refused at session start, and a
scenario that passes without sharding anything is red (conformance.admission, conformance.vacuity).
The harness's own routes (rank fixtures without a world_size marker, --device cuda without GPUs)
are tested in tests/harness/test_options.py."""

from __future__ import annotations

import pytest
import torch
from adapter_testing import run_inner_session

from conformance.adapters.template import TemplateAdapter
from conformance.admission import SessionContext, refusals
from tests.conformance.vacuous_adapters import BrokenConstructorAdapter, NoFormsHereAdapter

CPU = SessionContext(device=torch.device("cpu"))


def test_a_backend_without_a_usable_form_is_refused_with_what_is_missing() -> None:
    (reason,) = refusals(NoFormsHereAdapter, CPU)
    assert "capabilities() on cpu include neither WRAPPER or COMPOSABLE" in reason
    assert "--device" in reason


def test_a_backend_that_cannot_be_built_is_refused_with_the_cause() -> None:
    (reason,) = refusals(BrokenConstructorAdapter, CPU)
    assert "RuntimeError: no accelerator runtime found" in reason


def test_usable_backends_and_sessions_without_devices_are_admitted() -> None:
    assert refusals(TemplateAdapter, CPU) == []
    assert refusals(NoFormsHereAdapter, SessionContext(device=None)) == []  # the harness fails that run


SHARDS = """
import pytest
import torch.nn as nn
from conformance.protocol import ShardingSpec, ShardingStrategy

@pytest.mark.world_size(1)
def test_loops_over_no_form(backend):
    for form in []:  # what a scenario did for a backend whose forms() came back empty
        backend.shard(nn.Linear(2, 2), ShardingSpec(), form)

@pytest.mark.world_size(1)
def test_shards(backend, device):
    spec = ShardingSpec(strategy=ShardingStrategy.NO_SHARD)
    backend.shard(nn.Linear(2, 2).to(device), spec, backend.forms()[0])

@pytest.mark.world_size(1)
def test_skips(backend):
    pytest.skip("unsupported: something")

@pytest.mark.world_size(1)
def test_fails(backend):
    assert False, "its own failure"
"""


def test_vacuous_routes_end_to_end(tmp_path) -> None:
    """One inner session (each costs ~1-3 s): the refused backend stops the run at selection;
    with a usable backend a test that passed without sharding is red, the rest keep their own
    verdicts."""
    refused = run_inner_session(
        tmp_path, SHARDS, ["tests.conformance.vacuous_adapters:NoFormsHereAdapter"], "--device", "cpu"
    )
    assert refused.returncode == pytest.ExitCode.USAGE_ERROR, refused.stdout + refused.stderr
    assert "backend 'no-forms-here' cannot run here: its capabilities() on cpu include neither" in refused.stderr

    result = run_inner_session(tmp_path, SHARDS, ["conformance.adapters.template:TemplateAdapter"], "--device", "cpu")
    output = result.stdout + result.stderr
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, output
    assert "FAILED test_inner.py::test_loops_over_no_form" in output
    assert "passed without calling backend.shard(): it checked nothing of the template-ddp backend" in output, output
    assert "PASSED test_inner.py::test_shards" in output
    assert "SKIPPED" in output and "unsupported: something" in output
    assert "FAILED test_inner.py::test_fails" in output and "its own failure" in output
