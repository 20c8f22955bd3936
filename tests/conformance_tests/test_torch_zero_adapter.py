"""The torch-zero adapter (DistributedDataParallel / replicate + ZeroRedundancyOptimizer) reports
its backend truly: what each rank stores, the training it runs, its state dicts and gradient
accumulation, each checked against torch itself or the single-process oracle.

What the conformance scenarios cannot reach yet without units (training parity of both
strategies, optimizer state dicts, storage of ZeRO-1) is pinned here, so a scenario failure can be
trusted to be the backend's and not the adapter's.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import fixtures
from conformance.adapters.torch_zero import TorchZeroAdapter, optimizer_class_and_defaults
from conformance.protocol import (
    ApiForm,
    BackendEnv,
    Capability,
    Phase,
    ShardingSpec,
    ShardingStrategy,
    StateDictKind,
    Stored,
    share_bounds,
    storage_claim,
    versions,
)
from conformance.suite import registry
from fixtures.compare import Tolerance, differences
from harness import current_seed

STRATEGIES = [ShardingStrategy.NO_SHARD, ShardingStrategy.SHARD_OPTIM_STATE]
ADAM = functools.partial(torch.optim.Adam, lr=1e-2)
DIM = 8
# Adam against the oracle over three steps: reduction-order noise only (see
# conformance/test_runtime.py, PARAM_TOLERANCE); a missing all-reduce or a parameter a rank
# did not receive from its owner moves whole Adam steps (lr = 1e-2).
PARAM_TOLERANCE = Tolerance(rtol=1e-3, atol=1e-3)
strategy_axis = pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)


def _adapter(rank: int, world_size: int, device: torch.device) -> TorchZeroAdapter:
    return TorchZeroAdapter(BackendEnv(rank, world_size, device))


def _model(device: torch.device, seed_offset: int = 0) -> nn.Module:
    return fixtures.build(fixtures.CompositeModel, current_seed() + seed_offset, device, dim=DIM)


def _param_numels() -> dict[str, int]:
    return {name: p.numel() for name, p in fixtures.CompositeModel(dim=DIM).named_parameters()}


def _train(adapter: TorchZeroAdapter, sharded: nn.Module, model: nn.Module, optim, rank: int, device, steps: int):
    for iteration in range(steps):
        inputs = fixtures.local_batch(
            model, seed=current_seed(), iteration=iteration, rank=rank, batch_size=2, device=device
        )
        adapter.zero_grad(sharded, optim)
        adapter.backward(sharded, model.loss(sharded(*inputs)))
        adapter.step(sharded, optim)


def test_registered_as_a_builtin() -> None:
    assert registry.load("torch-zero") is TorchZeroAdapter
    assert "torch-zero" in registry.select(["all"])
    assert TorchZeroAdapter.PROTOCOL_VERSION == versions.PROTOCOL_VERSION


def test_factory_is_read_as_class_and_keyword_arguments() -> None:
    device = torch.device("cpu")
    assert optimizer_class_and_defaults(ADAM, device) == (torch.optim.Adam, {"lr": 1e-2})
    # Any other factory is called once on a probe parameter: its class and defaults are read.
    cls, defaults = optimizer_class_and_defaults(lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9), device)
    assert cls is torch.optim.SGD and defaults["lr"] == 0.5 and defaults["momentum"] == 0.9
    with pytest.raises(TypeError, match=r"not a torch\.optim\.Optimizer"):
        optimizer_class_and_defaults(lambda params: object(), device)
    with pytest.raises(ValueError, match="2 parameter groups"):
        optimizer_class_and_defaults(
            lambda params: torch.optim.SGD([{"params": list(params)}, {"params": [torch.zeros(1)]}], lr=0.1),
            device,
        )


@pytest.mark.world_size(2)
def test_forms_strategies_and_wrapper_names(rank: int, world_size: int, device: torch.device) -> None:
    adapter = _adapter(rank, world_size, device)
    assert adapter.forms() == [ApiForm.WRAPPER, ApiForm.COMPOSABLE]
    names = list(_param_numels())
    wrapped = adapter.shard(_model(device), ShardingSpec(strategy=ShardingStrategy.NO_SHARD), ApiForm.WRAPPER)
    assert isinstance(wrapped, DistributedDataParallel)
    assert [adapter.original_fqn(n) for n, _ in wrapped.named_parameters()] == names
    model = _model(device)
    in_place = adapter.shard(model, ShardingSpec(strategy=ShardingStrategy.NO_SHARD), ApiForm.COMPOSABLE)
    assert in_place is model and [n for n, _ in in_place.named_parameters()] == names
    for strategy, optimizer_type in (
        (ShardingStrategy.NO_SHARD, torch.optim.Adam),
        (ShardingStrategy.SHARD_OPTIM_STATE, ZeroRedundancyOptimizer),
    ):
        sharded = adapter.shard(_model(device), ShardingSpec(strategy=strategy), ApiForm.WRAPPER)
        assert type(adapter.make_optimizer(sharded, ADAM)) is optimizer_type


@pytest.mark.world_size(2)
@strategy_axis
def test_training_matches_the_oracle(
    strategy: ShardingStrategy, rank: int, world_size: int, device: torch.device
) -> None:
    """Three Adam steps in each form: parameters equal the single-process oracle's."""
    adapter = _adapter(rank, world_size, device)
    plan = fixtures.TrainingPlan(seed=current_seed(), iterations=3, batch_size=2, make_optimizer=ADAM)
    oracle = fixtures.train_oracle(_model(device), plan, world_size=world_size, device=device)
    for form in adapter.forms():
        model = _model(device)
        sharded = adapter.shard(model, ShardingSpec(strategy=strategy), form)
        fixtures.train_sharded(adapter, sharded, model, plan, rank=rank, device=device)
        found = differences(adapter.state_dict(sharded, StateDictKind.FULL), oracle.state_dict, PARAM_TOLERANCE)
        assert not found, f"{form.value}, {strategy.name}: {found}"


@pytest.mark.world_size(2)
@strategy_axis
def test_storage_is_what_the_strategy_claims(
    strategy: ShardingStrategy, rank: int, world_size: int, device: torch.device
) -> None:
    """After a step, what the ranks store together of each parameter, its gradient and each of
    Adam's state tensors is what ``STORAGE_CLAIMS`` allows (conformance.protocol.storage): whole
    on every rank, or under SHARD_OPTIM_STATE each state tensor on exactly one rank; the
    all-reduced gradients are equal everywhere."""
    adapter = _adapter(rank, world_size, device)
    numels = _param_numels()
    claim = storage_claim(strategy)
    for form in adapter.forms():
        model = _model(device)
        sharded = adapter.shard(model, ShardingSpec(strategy=strategy), form)
        optim = adapter.make_optimizer(sharded, ADAM)
        _train(adapter, sharded, model, optim, rank, device, steps=1)
        # At rest after the step (gradients kept: zero_grad runs before the next backward).
        stored: dict[tuple[str, Stored, str], int] = {}
        for fqn in numels:
            stored[fqn, Stored.PARAMETERS, ""] = adapter.local_shard(sharded, fqn).numel()
            stored[fqn, Stored.GRADIENTS, ""] = adapter.local_grad_shard(sharded, fqn).numel()
            state = adapter.local_optim_state(sharded, optim, fqn)
            for name in ("exp_avg", "exp_avg_sq"):
                stored[fqn, Stored.OPTIMIZER_STATE, name] = state[name].numel() if name in state else 0
        totals = torch.tensor(list(stored.values()), device=device)
        dist.all_reduce(totals)
        for (fqn, kind, name), total in zip(stored, totals.tolist()):
            holding = claim.holding(kind, Phase.AT_REST)
            low, high = share_bounds(numels[fqn], holding, world_size, world_size)
            assert low <= total <= high, (
                f"{form.value}, {strategy.name}: the ranks store {total} elements of {fqn}'s {kind.value} "
                f"{name}; {holding.value} allows {low}..{high}"
            )
        for fqn in numels:
            grad = adapter.local_grad_shard(sharded, fqn)
            gathered = [torch.empty_like(grad) for _ in range(world_size)]
            dist.all_gather(gathered, grad)
            assert all(torch.equal(g, gathered[0]) for g in gathered), f"{form.value}: {fqn} gradients differ"


@pytest.mark.world_size(2)
@strategy_axis
def test_optimizer_state_dict_is_whole_on_every_rank_and_round_trips(
    strategy: ShardingStrategy, rank: int, world_size: int, device: torch.device
) -> None:
    """The FULL optimizer state dict is keyed by parameter FQNs and holds every parameter's
    state on every rank; loaded into a fresh model and optimizer, it reads back the same and
    one more step gives the same parameters as the original pair."""
    adapter = _adapter(rank, world_size, device)
    numels = _param_numels()
    for form in adapter.forms():
        model = _model(device)
        sharded = adapter.shard(model, ShardingSpec(strategy=strategy), form)
        optim = adapter.make_optimizer(sharded, ADAM)
        _train(adapter, sharded, model, optim, rank, device, steps=2)
        saved = adapter.optim_state_dict(sharded, optim, StateDictKind.FULL)
        assert set(saved["state"]) == set(numels), f"{form.value}: {sorted(saved['state'])}"
        assert [sorted(g["params"]) for g in saved["param_groups"]] == [sorted(numels)]
        for fqn, numel in numels.items():
            assert saved["state"][fqn]["exp_avg"].numel() == numel, f"{form.value}: {fqn}"
            assert saved["state"][fqn]["exp_avg"].device == device, f"{form.value}: {fqn}"
        restored_model = _model(device, seed_offset=1)
        restored = adapter.shard(restored_model, ShardingSpec(strategy=strategy), form)
        restored_optim = adapter.make_optimizer(restored, ADAM)
        adapter.load_state_dict(restored, adapter.state_dict(sharded, StateDictKind.FULL), StateDictKind.FULL)
        adapter.load_optim_state_dict(restored, restored_optim, saved, StateDictKind.FULL)
        read_back = adapter.optim_state_dict(restored, restored_optim, StateDictKind.FULL)
        for fqn in numels:
            for key, value in saved["state"][fqn].items():
                assert torch.equal(read_back["state"][fqn][key], value), f"{form.value}: {fqn} {key}"
        _train(adapter, sharded, model, optim, rank, device, steps=1)
        _train(adapter, restored, model, restored_optim, rank, device, steps=1)
        found = differences(
            adapter.state_dict(restored, StateDictKind.FULL),
            adapter.state_dict(sharded, StateDictKind.FULL),
            Tolerance(rtol=1e-6, atol=1e-6),
        )
        assert not found, f"{form.value}, {strategy.name}: one step after loading: {found}"


@pytest.mark.world_size(2)
def test_no_gradient_sync_accumulates_then_reduces_the_sum(rank: int, world_size: int, device: torch.device) -> None:
    """Inside the context a forward and backward leave this rank's own gradient (ranks differ);
    the next forward and backward outside reduce the sum of both: the gradients then equal
    those of two synced backwards accumulated."""
    adapter = _adapter(rank, world_size, device)
    spec = ShardingSpec(strategy=ShardingStrategy.NO_SHARD)
    for form in adapter.forms():
        results = []
        for use_switch in (True, False):
            model = _model(device)
            sharded = adapter.shard(model, spec, form)
            batches = [
                fixtures.local_batch(model, seed=current_seed(), iteration=i, rank=rank, batch_size=2, device=device)
                for i in range(2)
            ]
            if use_switch:
                with adapter.no_gradient_sync(sharded):
                    adapter.backward(sharded, model.loss(sharded(*batches[0])))
                local = adapter.local_grad_shard(sharded, "mix")
                gathered = [torch.empty_like(local) for _ in range(world_size)]
                dist.all_gather(gathered, local)
                assert not torch.equal(gathered[0], gathered[1]), f"{form.value}: gradients were reduced inside"
            else:
                adapter.backward(sharded, model.loss(sharded(*batches[0])))
            adapter.backward(sharded, model.loss(sharded(*batches[1])))
            results.append({fqn: adapter.local_grad_shard(sharded, fqn) for fqn in _param_numels()})
        found = differences(results[0], results[1], Tolerance(rtol=1e-5, atol=1e-6))
        assert not found, f"{form.value}: accumulated without sync then reduced vs synced twice: {found}"


@pytest.mark.world_size(2)
def test_unshard_shows_the_parameters_and_their_gradients(rank: int, world_size: int, device: torch.device) -> None:
    adapter = _adapter(rank, world_size, device)
    expected = dict(_model(device).named_parameters())
    for form in adapter.forms():
        model = _model(device)
        sharded = adapter.shard(model, ShardingSpec(strategy=ShardingStrategy.SHARD_OPTIM_STATE), form)
        inputs = fixtures.local_batch(model, seed=current_seed(), iteration=0, rank=rank, batch_size=2, device=device)
        adapter.backward(sharded, model.loss(sharded(*inputs)))
        with adapter.unshard(sharded, "unit1", writeback=False, recurse=False, with_grads=True):
            for name, param in sharded.named_parameters():
                fqn = adapter.original_fqn(name)
                assert torch.equal(param.detach(), expected[fqn].detach()), f"{form.value}: {fqn}"
                assert param.grad is not None and param.grad.shape == param.shape, f"{form.value}: {fqn}"
        with pytest.raises(ValueError, match="no submodule 'nowhere'"), adapter.unshard(sharded, "nowhere"):
            pass


@pytest.mark.world_size(2)
def test_missing_features_skip_with_reason(rank: int, world_size: int, device: torch.device) -> None:
    adapter = _adapter(rank, world_size, device)
    model = _model(device)
    for spec, skip_text in (
        (ShardingSpec(), "unsupported: strategy FULL_SHARD: DistributedDataParallel replicates"),
        (
            ShardingSpec(strategy=ShardingStrategy.SHARD_GRAD_AND_OPTIM_STATE),
            "unsupported: strategy SHARD_GRAD_AND_OPTIM_STATE: .* all-reduced whole",
        ),
        (
            ShardingSpec(strategy=ShardingStrategy.NO_SHARD, manual_units=("unit1",)),
            "unsupported: sharding units .*: DistributedDataParallel has no units",
        ),
        (
            ShardingSpec(strategy=ShardingStrategy.NO_SHARD, param_dtype=torch.bfloat16),
            "unsupported: mixed precision param dtype: .*_MixedPrecision, a private",
        ),
    ):
        with pytest.raises(pytest.skip.Exception, match=skip_text):
            adapter.shard(model, spec, ApiForm.WRAPPER)
    sharded = adapter.shard(model, ShardingSpec(strategy=ShardingStrategy.NO_SHARD), ApiForm.WRAPPER)
    with pytest.raises(pytest.skip.Exception, match="unsupported: sharded state dict"):
        adapter.state_dict(sharded, StateDictKind.SHARDED)
    with (
        pytest.raises(pytest.skip.Exception, match="unsupported: unshard rank0_only"),
        adapter.unshard(sharded, writeback=False, rank0_only=True),
    ):
        pass
    assert not adapter.supports(Capability.UNITS) and adapter.supports(Capability.NO_SYNC)
