"""The reference adapter's storage hooks meet the protocol's storage claims, per strategy.

`conformance.protocol.storage.STORAGE_CLAIMS` says, per strategy, whether a rank stores its share
or a whole copy of each parameter, its gradient and its optimizer state; `share_bounds` turns
that into bounds on what all ranks store together.  Here the reference adapter's `local_shard`,
`local_grad_shard` and `local_optim_state` are summed over the ranks for every parameter of the
sharded model (original parameters, or the flat parameters of `use_orig_params=False`) at rest
after a step and after a backward, and held to those bounds: the self-check behind the storage
scenario, for the engine's own strategies.  `set_local_grad_shard` must write what
`local_grad_shard` reads.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fixtures
from conformance.adapters.reference import ReferenceAdapter
from conformance.protocol import ApiForm, BackendEnv, ShardingSpec, ShardingStrategy
from conformance.protocol.storage import Phase, Stored, share_bounds, storage_claim

STRATEGIES = [
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.NO_SHARD,
    ShardingStrategy.SHARD_OPTIM_STATE,
    ShardingStrategy.SHARD_GRAD_AND_OPTIM_STATE,
]
STATE_KEYS = ("exp_avg", "exp_avg_sq")  # Adam's per-parameter state
FLAT_PARAM = "_flat_param"


def _numels(backend: ReferenceAdapter, sharded: nn.Module, local: nn.Module) -> dict[str, int]:
    """Elements of each parameter the sharded model lists, unsharded: an original parameter's,
    or for a flat parameter the sum over the original parameters of its unit."""
    original = {name: param.numel() for name, param in local.named_parameters()}
    units = backend.unit_fqns(sharded)
    numels = {}
    for name, _param in sharded.named_parameters():
        fqn = backend.original_fqn(name)
        if fqn.rpartition(".")[2] == FLAT_PARAM:
            unit = fqn.rpartition(".")[0]
            numels[fqn] = sum(original[param] for param in units[unit])
        else:
            numels[fqn] = original[fqn]
    return numels


def _stored(backend: ReferenceAdapter, sharded: nn.Module, optim, fqns: list[str]) -> torch.Tensor:
    """Per parameter, the elements this rank stores: [parameter, gradient, *optimizer state]."""
    rows = []
    for fqn in fqns:
        grad = backend.local_grad_shard(sharded, fqn)
        state = backend.local_optim_state(sharded, optim, fqn)
        rows.append(
            [backend.local_shard(sharded, fqn).numel(), 0 if grad is None else grad.numel()]
            + [state[key].numel() if key in state else 0 for key in STATE_KEYS]
        )
    return torch.tensor(rows, dtype=torch.int64)


def _check(strategy, phase, numels, totals, world_size) -> list[str]:
    claim = storage_claim(strategy)
    problems = []
    for row, (fqn, numel) in enumerate(numels.items()):
        checked = [(Stored.PARAMETERS, 0, "parameter"), (Stored.GRADIENTS, 1, "gradient")]
        checked += [(Stored.OPTIMIZER_STATE, 2 + i, key) for i, key in enumerate(STATE_KEYS)]
        for stored, column, what in checked:
            holding = claim.holding(stored, phase)
            if holding is None:
                continue
            low, high = share_bounds(numel, holding, world_size, world_size)
            total = int(totals[row, column])
            if not low <= total <= high:
                problems.append(
                    f"{phase.value}: {fqn} {what}: ranks store {total} of {numel} elements together, "
                    f"{holding.value} allows {low}..{high}"
                )
    return problems


@pytest.mark.world_size(2)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
@pytest.mark.parametrize(
    ("use_orig_params", "units"),
    [(True, True), (False, False)],
    ids=["orig_params-units", "flat_params-root_only"],
)
def test_storage_hooks_meet_the_claims(rank, world_size, device, strategy, use_orig_params, units):
    backend = ReferenceAdapter(BackendEnv(rank, world_size, device))
    local = fixtures.build(fixtures.CompositeModel, 0, device)
    spec = ShardingSpec(
        strategy=strategy,
        auto_wrap_classes=(fixtures.Unit,) if units else (),
        use_orig_params=use_orig_params,
    )
    sharded = backend.shard(fixtures.build(fixtures.CompositeModel, 0, device), spec, ApiForm.COMPOSABLE)
    numels = _numels(backend, sharded, local)
    fqns = list(numels)
    optim = backend.make_optimizer(sharded, functools.partial(torch.optim.Adam, lr=1e-3))
    generator = torch.Generator().manual_seed(rank)

    def backward() -> None:
        (x,) = local.example_input(generator, 4)
        backend.backward(sharded, local.loss(sharded(x.to(device))))

    problems = []
    for phase in (Phase.AT_REST, Phase.AFTER_BACKWARD):
        backend.zero_grad(sharded, optim)
        backward()
        if phase is Phase.AT_REST:
            backend.step(sharded, optim)  # gradients stay until the next zero_grad
        totals = _stored(backend, sharded, optim, fqns)
        dist.all_reduce(totals)
        problems += _check(strategy, phase, numels, totals, world_size)
    for fqn in fqns:  # what local_grad_shard reads is where set_local_grad_shard writes
        grad = backend.local_grad_shard(sharded, fqn)
        backend.set_local_grad_shard(sharded, fqn, grad + 1)
        torch.testing.assert_close(backend.local_grad_shard(sharded, fqn), grad + 1, msg=fqn)
    assert not problems, f"rank {rank}, {strategy.name}:\n" + "\n".join(problems)
