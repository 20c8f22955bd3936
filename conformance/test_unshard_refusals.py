"""Unshard-params scenarios of a unit below the root and of the refusals: unsharding from forward or
backward, ``rank0_only`` with ``writeback``, and ``offload_to_cpu`` under ``NO_SHARD`` each raise
what the adapter declares (module docstring of ``conformance.test_unshard_params`` for the whole
contract).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fixtures
from conformance.protocol import BackendAdapter, Misuse, ShardingSpec, ShardingStrategy, permits, refused
from conformance.scenario_unshard import (
    EXACT,
    CallsBackInForward,
    PairOfPairs,
    TinyLinear,
    named_params,
    require_unshard,
    sharded_models,
    shows_full,
)
from harness import current_seed


@pytest.mark.world_size(min=2, default=2)
def test_unshard_submodule(backend: BackendAdapter, device: torch.device) -> None:
    """Unsharding unit ``0`` of an auto-wrapped model shows its original parameters (more
    than one, no flat parameter), full and equal to an unsharded copy."""
    require_unshard(backend)
    spec = ShardingSpec(auto_wrap_classes=(nn.Sequential,))
    local = dict(fixtures.build(PairOfPairs, current_seed(), device).named_parameters())
    wanted = {name: p for name, p in local.items() if name.startswith("0.")}
    for form, sharded in sharded_models(backend, PairOfPairs, spec, device):
        with backend.unshard(sharded, "0", writeback=False):
            seen = {name: p for name, p in named_params(backend, sharded).items() if name.startswith("0.")}
            assert seen.keys() == wanted.keys(), f"{form.value}: unit 0 shows {sorted(seen)}, expected {sorted(wanted)}"
            for name, param in seen.items():
                assert shows_full(param, wanted[name].shape), f"{form.value}: {name} not full"
                torch.testing.assert_close(
                    param.detach(),
                    wanted[name].detach(),
                    **EXACT,
                    msg=lambda m, name=name: (
                        f"{form.value}: {name} inside unshard of unit 0 differs from the unsharded model\n{m}"
                    ),
                )


@pytest.mark.world_size(min=2, default=2)
def test_unshard_from_forward_raises(backend: BackendAdapter, device: torch.device) -> None:
    """Entering the context from inside forward raises (misuse contract, module docstring)."""
    require_unshard(backend)
    for form, sharded in sharded_models(backend, CallsBackInForward, ShardingSpec(), device):
        target = next(m for m in sharded.modules() if isinstance(m, CallsBackInForward))

        def unshard_now(sharded: nn.Module = sharded) -> None:
            with backend.unshard(sharded, writeback=False):
                pass

        target.during_forward = unshard_now
        with refused(backend, Misuse.UNSHARD_DURING_FORWARD, form.value):
            output = sharded(torch.ones(5, device=device))
        if permits(backend, Misuse.UNSHARD_DURING_FORWARD):
            # Allowed by the backend: the forward must still compute what the unsharded model does.
            local = fixtures.build(CallsBackInForward, current_seed(), device)
            torch.testing.assert_close(
                output.detach(),
                local(torch.ones(5, device=device)).detach(),
                **EXACT,
                msg=lambda m, form=form: f"{form.value}: a forward that unsharded inside it computed otherwise\n{m}",
            )


@pytest.mark.world_size(min=2, default=2)
def test_unshard_from_backward_raises(backend: BackendAdapter, device: torch.device) -> None:
    """Entering the context from a hook that runs during backward raises (misuse contract)."""
    require_unshard(backend)
    for form, sharded in sharded_models(backend, TinyLinear, ShardingSpec(), device):
        output = sharded(torch.ones(2, device=device))
        assert output.requires_grad

        def unshard_now(grad: torch.Tensor, sharded: nn.Module = sharded) -> None:
            with backend.unshard(sharded, writeback=False):
                pass

        output.register_hook(unshard_now)
        with refused(backend, Misuse.UNSHARD_DURING_BACKWARD, form.value):
            backend.backward(sharded, output.sum())
        if permits(backend, Misuse.UNSHARD_DURING_BACKWARD):
            _parameters_unchanged(backend, sharded, TinyLinear, device, f"{form.value}: after unshard during backward")


@pytest.mark.world_size(min=2, default=2)
def test_unshard_rank0_only_with_writeback_raises(backend: BackendAdapter, device: torch.device) -> None:
    """``rank0_only`` with ``writeback`` is refused: other ranks could not persist writes.

    Needs only ``rank0_only``: a backend that has it must refuse this combination whether or not
    it has writeback."""
    require_unshard(backend, rank0_only=True)
    spec = ShardingSpec(manual_units=fixtures.NestedModel.UNIT_FQNS)
    for form, sharded in sharded_models(backend, fixtures.NestedModel, spec, device):
        with (
            refused(backend, Misuse.UNSHARD_RANK0_ONLY_WITH_WRITEBACK, form.value),
            backend.unshard(sharded, rank0_only=True, writeback=True),
        ):
            pass
        if permits(backend, Misuse.UNSHARD_RANK0_ONLY_WITH_WRITEBACK):
            where = f"{form.value}: after unshard(rank0_only=True, writeback=True)"
            _parameters_unchanged(backend, sharded, fixtures.NestedModel, device, where)


@pytest.mark.world_size(min=2, default=2)
@pytest.mark.parametrize("call", ["offload_to_cpu", "seed_call"])
def test_unshard_offload_to_cpu_no_shard_raises(backend: BackendAdapter, call: str, device: torch.device) -> None:
    """``offload_to_cpu`` with NO_SHARD is refused (parameters are never gathered there).

    ``offload_to_cpu``: the intended refusal in isolation (``offload_to_cpu=True,
    writeback=False``). ``seed_call``: the upstream seed's literal call on the same NO_SHARD
    model, ``rank0_only=True, writeback=True`` (no ``offload_to_cpu``), which the seed expects
    refused as "is not supported": the ``rank0_only`` with ``writeback`` refusal, declared as such.
    """
    if call == "offload_to_cpu":
        options, misuse = {"offload_to_cpu": True, "writeback": False}, Misuse.UNSHARD_OFFLOAD_TO_CPU_NO_SHARD
        require_unshard(backend, offload_to_cpu=True)
    else:  # needs only rank0_only, as test_unshard_rank0_only_with_writeback_raises
        options, misuse = {"rank0_only": True, "writeback": True}, Misuse.UNSHARD_RANK0_ONLY_WITH_WRITEBACK
        require_unshard(backend, rank0_only=True)
    spec = ShardingSpec(strategy=ShardingStrategy.NO_SHARD, manual_units=fixtures.NestedModel.UNIT_FQNS)
    for form, sharded in sharded_models(backend, fixtures.NestedModel, spec, device):
        with refused(backend, misuse, form.value), backend.unshard(sharded, **options):
            pass
        if permits(backend, misuse):
            _parameters_unchanged(backend, sharded, fixtures.NestedModel, device, f"{form.value}: after {misuse.value}")


def _parameters_unchanged(
    backend: BackendAdapter, sharded: nn.Module, model_cls: type[nn.Module], device: torch.device, where: str
) -> None:
    """After a misuse the backend permits, the full parameters still equal an unsharded copy's."""
    local = dict(fixtures.build(model_cls, current_seed(), device).named_parameters())
    with backend.unshard(sharded, writeback=False):
        seen = {name: p.detach().clone() for name, p in named_params(backend, sharded).items()}
    assert seen.keys() == local.keys(), f"{where}: parameters {sorted(seen)}, expected {sorted(local)}"
    for name, value in seen.items():
        torch.testing.assert_close(
            value, local[name].detach(), **EXACT, msg=lambda m, name=name: f"{where}: {name} changed\n{m}"
        )
