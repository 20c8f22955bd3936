"""A backend that gathers into temporaries and has no units (tests/conformance_tests/
per_parameter_dtensor, a SimpleFSDP-style per-parameter DTensor design) gets true verdicts.

Its parameters stay stored as shards the whole time; forward computes with whole temporaries
that a property all-gathers. The storage scenario judges what forward computes with, not what
is stored, and the vacuity rule accepts a rank whose share under the declared layout is all of
the model (rank 0 of a 1-element weight), so the backend passes ``test_storage_claim`` (FULL_SHARD
at world size 2, HYBRID_SHARD at 4) and ``test_unshard_singleton_writeback``; its replicating
twin, declaring the same, fails each. A backend whose forward computes with its shard (a sharded
DTensor of the parameter's global shape) fails the in-forward check, naming what it read.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from adapter_testing import run_inner_session
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import conformance.test_storage as storage
from conformance.protocol import BackendEnv
from tests.conformance_tests import per_parameter_dtensor
from tests.conformance_tests.per_parameter_dtensor.adapter import PerParameterDTensorAdapter

ADAPTERS = "tests.conformance_tests.per_parameter_dtensor.adapter:"
SCENARIOS = """
from conformance.test_storage import test_storage_claim  # noqa: F401
from conformance.test_unshard_params import test_unshard_singleton_writeback  # noqa: F401
"""
JUDGED = (
    "test_storage_claim[{}-ws2-FULL_SHARD-whole_model]",
    "test_storage_claim[{}-ws4-HYBRID_SHARD-whole_model]",
    "test_unshard_singleton_writeback[{}-ws2-orig_params]",
)


def test_a_unit_less_backend_gathering_into_temporaries_passes_and_its_replicating_twin_fails(tmp_path) -> None:
    result = run_inner_session(
        tmp_path,
        SCENARIOS,
        [ADAPTERS + "PerParameterDTensorAdapter", ADAPTERS + "ReplicatingTwin"],
        "-k",
        "whole_model and (FULL_SHARD or HYBRID_SHARD) or singleton and orig_params",
    )
    output = result.stdout + result.stderr
    for test in JUDGED:
        assert f"PASSED test_inner.py::{test.format('per-parameter-dtensor')}" in output, output
        assert f"FAILED test_inner.py::{test.format('per-parameter-dtensor-replicating')}" in output, output
    # The twin fails for what it stores, on the claim's own terms.
    assert "FULL_SHARD claims parameters sharded" in output, output
    assert "rank 1 stores {'0.weight': 1} elements of the 1-element weight" in output, output


PERMITTED_SCENARIOS = """
from conformance.test_unshard_refusals import test_unshard_from_backward_raises  # noqa: F401
from conformance.test_unshard_refusals import test_unshard_from_forward_raises  # noqa: F401
"""


def test_a_misuse_declared_permitted_runs_and_is_checked_not_refused(tmp_path) -> None:
    """The backend declares unsharding inside forward and backward Permitted: the refusal
    scenarios run the call through and check its values (the forward's output, the parameters
    afterwards), and pass; a backend declaring the same that refuses fails them, saying so."""
    result = run_inner_session(
        tmp_path,
        PERMITTED_SCENARIOS,
        [ADAPTERS + "PerParameterDTensorAdapter", ADAPTERS + "PermitsButRefuses"],
    )
    output = result.stdout + result.stderr
    for test in ("test_unshard_from_forward_raises", "test_unshard_from_backward_raises"):
        assert f"PASSED test_inner.py::{test}[per-parameter-dtensor-ws2]" in output, output
        assert f"FAILED test_inner.py::{test}[per-parameter-dtensor-permits-but-refuses-ws2]" in output, output
    assert (
        "declares it permitted (gathered() holds no state a forward depends on), but it raised RuntimeError" in output
    )


def _sharded_linear(world_size: int, device: torch.device) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(storage.DIM, storage.DIM)).to(device)
    mesh = init_device_mesh(device.type, (world_size,))
    return per_parameter_dtensor.data_parallel(model, mesh, (Shard(0),))


@pytest.mark.world_size(2)
def test_the_in_forward_check_fails_a_forward_computing_with_its_shard(
    rank: int, world_size: int, device: torch.device
) -> None:
    backend = PerParameterDTensorAdapter(BackendEnv(rank, world_size, device, rank))
    model = _sharded_linear(world_size, device)
    numels = {"0.weight": storage.DIM * storage.DIM, "0.bias": storage.DIM}
    shapes = {"0.weight": (storage.DIM, storage.DIM), "0.bias": (storage.DIM,)}
    batch = torch.randn(storage.LOCAL_BATCH, storage.DIM, device=device)
    linear = model[0]

    def verdict(run: Callable[[], object], inputs: object) -> list[str]:
        problems: list[str] = []
        storage._check_in_forward(
            backend, model, numels, shapes, "0", "", False, problems, "FULL_SHARD", linear, run, inputs
        )
        return problems

    # Gathered into a whole temporary (the backend's own forward): stored as a shard, read whole.
    assert verdict(lambda: linear.forward(batch), ((batch,), {})) == []
    # Computing with the shard: the DTensor has the parameter's global shape, half its elements here.
    mesh = model[0]._parameters["weight"].device_mesh
    replicated = DTensor.from_local(batch, mesh, [Replicate()])
    stored_weight, stored_bias = linear._parameters["weight"], linear._parameters["bias"]
    problems = verdict(lambda: F.linear(replicated, stored_weight, stored_bias), ((replicated,), {}))
    half = storage.DIM * storage.DIM // world_size
    assert len(problems) == 2, problems
    assert problems[0] == (
        f"FULL_SHARD, in forward of '0': this rank stores {half} of the {storage.DIM * storage.DIM} elements of "
        f"'0.weight' and its forward read tensors of its shape [{storage.DIM}, {storage.DIM}] with [{half}] elements "
        "on this rank: it computes with a parameter it has not gathered whole (neither stored whole nor read whole "
        "as a temporary)"
    ), problems[0]
    dist.barrier()
