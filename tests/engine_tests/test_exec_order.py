"""Execution-order validation: first-iteration error across ranks, later-iteration warning."""

from __future__ import annotations

import contextlib
import time
import warnings

import pytest
import torch
import torch.nn as nn

import engine
from engine import ShardingStrategy, collectives
from harness.rank.tracing import register_label_provider

STRATEGIES = [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP]


class TwoPaths(nn.Module):
    """layer0 then layer1 or layer2; both branches have 36 elements, so unchecked
    all-gathers of one against the other would match silently."""

    def __init__(self) -> None:
        super().__init__()
        self.layer0 = nn.Linear(5, 6)
        self.layer1 = nn.Linear(6, 6, bias=False)
        self.layer2 = nn.Sequential(nn.Linear(6, 3, bias=False), nn.ReLU(), nn.Linear(3, 6, bias=False))
        self.use_alt_path = False
        for param in self.layer2.parameters():
            param.requires_grad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.relu(self.layer0(x))
        return torch.relu(self.layer2(z) if self.use_alt_path else self.layer1(z))

    def flip_path(self) -> None:
        old, new = (self.layer2, self.layer1) if self.use_alt_path else (self.layer1, self.layer2)
        for param in old.parameters():
            param.requires_grad = False
        for param in new.parameters():
            param.requires_grad = True
        self.use_alt_path = not self.use_alt_path


@contextlib.contextmanager
def engine_labels():
    """Let the harness's collective tracer label collectives with the engine's unit FQNs."""
    remove = register_label_provider(collectives.current_label)
    try:
        yield
    finally:
        remove()


def wrapped(strategy: ShardingStrategy, device: torch.device, **options) -> engine.ShardedModule:
    model = TwoPaths().to(device)
    model.layer1 = engine.ShardedModule(model.layer1, strategy=strategy, **options)
    model.layer2 = engine.ShardedModule(model.layer2, strategy=strategy, **options)
    return engine.ShardedModule(model, strategy=strategy, **options)


def step(model: nn.Module, device: torch.device) -> None:
    model(torch.randn(8, 5, device=device)).sum().backward()


@pytest.mark.world_size(2)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_first_iteration_order_mismatch_raises_on_all_ranks(rank, device, strategy):
    model = wrapped(strategy, device)
    if rank != 0:
        model.flip_path()
    with engine_labels(), pytest.raises(RuntimeError, match=r"^Forward order differs across ranks") as caught:
        model(torch.randn(8, 5, device=device))
    assert "rank 0 unshards [layer1.weight]" in str(caught.value)
    assert "rank 1 unshards [layer2.0.weight, layer2.2.weight]" in str(caught.value)
    assert not any(unit.is_unsharded for unit in engine.units(model))


@pytest.mark.world_size(2)
@pytest.mark.expect_divergence  # ranks gather different (equal-sized) units after the change
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
@pytest.mark.parametrize("iters_before_change", [1, 3])
def test_later_iteration_order_change_warns_once(rank, device, strategy, iters_before_change):
    model = wrapped(strategy, device)
    for _ in range(iters_before_change):
        step(model, device)
    if rank != 0:
        model.flip_path()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(model, device)
        step(model, device)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    messages = [m for m in messages if m.startswith("Forward order differs")]
    if rank == 0:
        assert messages == []
    else:
        assert len(messages) == 1
        assert messages[0].startswith(
            f"Forward order differs from that of the first iteration on rank {rank}. "
            "Collectives are unchecked and may give incorrect results or hang."
        )


@pytest.mark.world_size(2)
@pytest.mark.expect_divergence  # eval forwards take rank-dependent paths on purpose
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_eval_forwards_are_not_checked(rank, device, strategy):
    model = wrapped(strategy, device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model.train()
            for _ in range(3):
                step(model, device)
            model.eval()
            if rank != 0:
                model.flip_path()  # differs across ranks, but eval is unchecked
            for _ in range(3):
                with torch.no_grad():
                    model(torch.randn(8, 5, device=device))
            if rank != 0:
                model.flip_path()
    assert not [w for w in caught if str(w.message).startswith("Forward order differs")]


@pytest.mark.world_size(2)
@pytest.mark.expect_divergence
def test_check_can_be_disabled(rank, device):
    model = wrapped(ShardingStrategy.FULL_SHARD, device, check_exec_order=False)
    if rank != 0:
        model.flip_path()
    model(torch.randn(8, 5, device=device))  # unchecked: equal sizes match silently


@pytest.mark.world_size(2)
def test_collectives_are_labelled_with_unit_fqns(device):
    labels: list = []
    original = collectives._all_gather_single

    def spy(*args, **kwargs):
        labels.append(collectives.current_label())
        return original(*args, **kwargs)

    model = wrapped(ShardingStrategy.FULL_SHARD, device, check_exec_order=False)
    collectives._all_gather_single = spy
    try:
        step(model, device)
    finally:
        collectives._all_gather_single = original
    assert collectives.current_label() is None
    assert labels == ["layer0.weight, layer0.bias", "layer1.weight", "layer1.weight"]
    assert engine.unit_fqns(model) == [
        ("", ("layer0.weight", "layer0.bias")),
        ("layer1", ("layer1.weight",)),
        ("layer2", ("layer2.0.weight", "layer2.2.weight")),
    ]
    assert engine.events(model) == [
        ("unshard", ""),
        ("unshard", "layer1"),
        ("reshard", "layer1"),
        ("unshard", "layer1"),
        ("reshard", "layer1"),
        ("reshard", ""),
    ]


@pytest.mark.world_size(2)
def test_check_cost_is_first_iteration_only(device):
    """The cross-rank check adds one tiny all-gather per unit to the first forward only."""
    checked = wrapped(ShardingStrategy.FULL_SHARD, device)
    unchecked = wrapped(ShardingStrategy.FULL_SHARD, device, check_exec_order=False)
    for model in (checked, unchecked):
        step(model, device)
    timings = {}
    for name, model in (("checked", checked), ("unchecked", unchecked)):
        start = time.perf_counter()
        for _ in range(20):
            step(model, device)
        timings[name] = time.perf_counter() - start
    assert timings["checked"] < 2.0 * timings["unchecked"] + 0.05, timings
