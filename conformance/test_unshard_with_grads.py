"""Unshard-params scenarios with gradients (``with_grads=True``): inside the context every unsharded
parameter shows its full gradient, equal to an unsharded copy's, and gradients written there reach
the stored shards (module docstring of ``conformance.test_unshard_params`` for the whole contract).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import fixtures
from conformance.protocol import BackendAdapter, Misuse, ShardingSpec, ShardingStrategy, refused, unsharded_name
from conformance.scenario_unshard import (
    EXACT,
    GRAD_TOLERANCE,
    WRITEBACK_FACTOR,
    PartlyUsed,
    full_values,
    grad_strategy_axis,
    named_params,
    offload_to_cpu_axis,
    require_unshard,
    sharded_models,
    writeback_axis,
)
from harness import check, current_seed


def _stored_grads(backend: BackendAdapter, sharded: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's stored gradient of every parameter that has one, by name."""
    stored = {name: backend.local_grad_shard(sharded, name) for name in named_params(backend, sharded)}
    return {name: grad for name, grad in stored.items() if grad is not None}


@pytest.mark.world_size(min=2, default=2)
@grad_strategy_axis
@offload_to_cpu_axis
@writeback_axis
def test_unshard_with_grads(
    backend: BackendAdapter,
    writeback: bool,
    offload_to_cpu: bool,
    strategy: ShardingStrategy,
    rank: int,
    device: torch.device,
) -> None:
    """``with_grads`` shows the averaged gradients DDP computes, after backward and between
    forward and backward; gradients scaled inside persist iff parameter changes would.

    ``offload_to_cpu`` with NO_SHARD is refused (see test_unshard_offload_to_cpu_no_shard_raises).
    """
    require_unshard(backend, writeback=writeback, offload_to_cpu=offload_to_cpu, with_grads=True)
    spec = ShardingSpec(strategy=strategy, auto_wrap_classes=fixtures.TiedTransformer.LAYER_CLASSES)
    changes_persist = writeback or (strategy is ShardingStrategy.NO_SHARD and not offload_to_cpu)
    is_refused = offload_to_cpu and strategy is ShardingStrategy.NO_SHARD
    for form, sharded in sharded_models(backend, fixtures.TiedTransformer, spec, device):
        local = fixtures.build(fixtures.TiedTransformer, current_seed(), device)
        ddp = DistributedDataParallel(local, device_ids=[device] if device.type == "cuda" else None)
        ddp_params = dict(local.named_parameters())
        full = full_values(backend, sharded)
        assert full.keys() == ddp_params.keys(), f"{form.value}: parameter names differ"
        for name, value in full.items():
            torch.testing.assert_close(
                value,
                ddp_params[name].detach(),
                **EXACT,
                msg=lambda m, name=name: f"{form.value}: full {name} differs from DDP's\n{m}",
            )

        def check_grads(when: str) -> None:
            before = _stored_grads(backend, sharded)
            context = backend.unshard(sharded, writeback=writeback, offload_to_cpu=offload_to_cpu, with_grads=True)
            if is_refused:
                with refused(backend, Misuse.UNSHARD_OFFLOAD_TO_CPU_NO_SHARD, f"{form.value}: {when}"), context:
                    pass
                return
            with context, torch.no_grad():
                pairs = itertools.zip_longest(local.named_parameters(), sharded.named_parameters())
                for (name, expected), (seen_name, seen) in pairs:
                    assert seen_name == unsharded_name(backend, name), (  # raw, as the seed compares
                        f"{form.value}: {seen_name!r} where {unsharded_name(backend, name)!r} was expected"
                    )
                    assert seen.grad is not None, f"{form.value} {when}: {name} shows no gradient"
                    torch.testing.assert_close(
                        seen.grad,
                        expected.grad.to(seen.grad.device),
                        **GRAD_TOLERANCE,
                        msg=lambda m, name=name: f"{form.value} {when}: {name} gradient differs from DDP\n{m}",
                    )
                    # A zero gradient would make the writeback check below vacuous.
                    assert seen.grad.count_nonzero() > 0, f"{form.value}: {name} gradient is 0"
                    seen.grad *= WRITEBACK_FACTOR
            after = _stored_grads(backend, sharded)
            assert after.keys() == before.keys(), (
                f"{form.value} {when}: parameters storing a gradient before the context "
                f"{sorted(before)}, after it {sorted(after)}"
            )
            factor = WRITEBACK_FACTOR if changes_persist else 1.0
            for name, old in before.items():
                torch.testing.assert_close(
                    after[name],
                    old * factor,
                    **EXACT,
                    msg=lambda m, name=name: (
                        f"{form.value} {when}: {name}: stored gradient after the context is not "
                        f"{factor} x the one before (writeback={writeback})\n{m}"
                    ),
                )
            if changes_persist:
                with torch.no_grad():
                    for param in local.parameters():
                        param.grad *= WRITEBACK_FACTOR

        for iteration, phase in enumerate(("after backward", "between forward and backward")):
            inputs = fixtures.local_batch(
                local,
                seed=current_seed(),
                iteration=iteration,
                rank=rank,
                batch_size=2,
                device=device,
            )
            ddp_loss = local.loss(ddp(*inputs))
            sharded_loss = local.loss(sharded(*inputs))
            if iteration == 0:
                ddp_loss.backward()  # DDP is the reference, not the backend under test
                backend.backward(sharded, sharded_loss)
            check_grads(phase)


@pytest.mark.world_size(min=2, default=2)
@pytest.mark.parametrize("case", ["before_backward", "partly_used"])
@grad_strategy_axis
def test_unshard_with_grads_none(
    backend: BackendAdapter,
    strategy: ShardingStrategy,
    case: str,
    rank: int,
    device: torch.device,
) -> None:
    """Gradients that are None on every rank stay None inside ``with_grads``, and those
    stored on some rank show up.

    before_backward: no backward ran, so every gradient is None. partly_used: after a
    backward through ``used`` only, unit ``idle`` has None gradients and ``used`` real ones;
    ``unused`` (same unit as ``used``) shows whatever the backend stored for it.
    """
    require_unshard(backend, with_grads=True)
    if case == "before_backward":
        model_cls: type[nn.Module] = fixtures.TiedTransformer
        spec = ShardingSpec(strategy=strategy, auto_wrap_classes=fixtures.TiedTransformer.LAYER_CLASSES)
    else:
        model_cls = PartlyUsed
        spec = ShardingSpec(strategy=strategy, manual_units=PartlyUsed.UNIT_FQNS)
    for form, sharded in sharded_models(backend, model_cls, spec, device):
        if case == "partly_used":
            inputs = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
            backend.backward(sharded, sharded(inputs.to(device)).sum())
        stored = _has_grad_on_any_rank(backend, sharded, device)
        with backend.unshard(sharded, writeback=False, with_grads=True):
            shown = {name: p.grad is not None for name, p in named_params(backend, sharded).items()}
        with check("the gradients the context shows"):
            assert shown == stored, (
                f"{form.value}: gradient shown inside {shown} differs from gradient stored on some rank {stored}"
            )
        # ``unused`` shares a unit with ``used``: a flat-gradient backend may store zeros for
        # it rather than None (torch FSDP1 does), so only the other two are pinned down.
        expected = {
            name: case == "partly_used" and name.startswith("used.")
            for name in shown
            if case == "before_backward" or not name.startswith("unused.")
        }
        with check("which parameters show a gradient"):
            assert {name: shown[name] for name in expected} == expected, (
                f"{form.value}: parameters showing a gradient {shown}"
            )


def _has_grad_on_any_rank(backend: BackendAdapter, sharded: nn.Module, device: torch.device) -> dict[str, bool]:
    """Whether any rank stores a gradient for each parameter (shards may be empty locally)."""
    names = list(named_params(backend, sharded))
    flags = torch.tensor([backend.local_grad_shard(sharded, name) is not None for name in names], device=device).int()
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return dict(zip(names, (bool(f) for f in flags.tolist())))
