"""The communication schedule: prefetch order, what may be in flight, waits before use, reuse.

The collective core is instrumented in the rank (every issue and every wait is logged with the
unit's label), and module hooks log where compute happens, so each test reads one step's
timeline and checks the invariants the CUDA path relies on, with gloo's async work on CPU.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn

import engine
from engine import MixedPrecision, ShardingStrategy, collectives
from engine.state import REDUCTIONS_IN_FLIGHT

Event = tuple[str, str, str]  # (what, kind, unit name): ("issue" | "wait" | "compute" | "backward", ...)


class Block(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(8, 8), nn.ReLU())


def stack() -> nn.Sequential:
    """Root parameters (first and last layer) around three blocks."""
    return nn.Sequential(nn.Linear(8, 8), Block(), Block(), Block(), nn.Linear(8, 8))


class _LoggedPending:
    def __init__(self, pending: collectives.Pending, log: list[Event], kind: str, name: str) -> None:
        self._pending, self._log, self._kind, self._name = pending, log, kind, name
        self._waited = False

    def wait(self) -> None:
        if not self._waited:
            self._log.append(("wait", self._kind, self._name))
            self._waited = True
        self._pending.wait()

    def abandon(self) -> None:
        self._pending.abandon()


@contextlib.contextmanager
def logged(model: nn.Module) -> Iterator[list[Event]]:
    """Log issues and waits of the engine's flat collectives, and forward / backward compute."""
    names = {unit.label: unit.module_fqn or "root" for unit in engine.units(model)}
    log: list[Event] = []
    originals = {
        name: getattr(collectives, name) for name in ("all_gather_flat", "reduce_scatter_flat", "all_reduce_sum")
    }

    def wrap(name: str, kind: str):
        def issue(*args, **kwargs):
            unit = names.get(collectives.current_label(), collectives.current_label())
            log.append(("issue", kind, unit))
            pending = originals[name](*args, **kwargs)
            if pending is None:  # synchronous
                log.append(("wait", kind, unit))
                return None
            return _LoggedPending(pending, log, kind, unit)

        return issue

    handles = []
    for fqn, module in model.named_modules():
        if isinstance(module, nn.Linear):
            owner = fqn.split(".")[0] if fqn.split(".")[0] in ("1", "2", "3") else "root"
            handles.append(
                module.register_forward_pre_hook(lambda m, a, o=owner: log.append(("compute", "forward", o)))
            )
            handles.append(
                module.register_full_backward_pre_hook(lambda m, g, o=owner: log.append(("backward", "compute", o)))
            )
    try:
        collectives.all_gather_flat = wrap("all_gather_flat", "all_gather")
        collectives.reduce_scatter_flat = wrap("reduce_scatter_flat", "reduce")
        collectives.all_reduce_sum = wrap("all_reduce_sum", "reduce")
        yield log
    finally:
        for name, original in originals.items():
            setattr(collectives, name, original)
        for handle in handles:
            handle.remove()


def step(model: nn.Module, device: torch.device, seed: int = 0) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed)).to(device).requires_grad_()
    model(x).sum().backward()


def in_flight(log: list[Event], kind: str) -> Iterator[tuple[int, Counter]]:
    """(position, collectives of `kind` issued and not yet waited, per unit) after each event."""
    pending: Counter = Counter()
    for position, (what, event_kind, unit) in enumerate(log):
        if event_kind == kind and what == "issue":
            pending[unit] += 1
        elif event_kind == kind and what == "wait":
            pending[unit] -= 1
            assert pending[unit] >= 0, f"{unit}: waited more often than issued at {position}: {log}"
        yield position, +pending


def assert_waited_before_compute(log: list[Event]) -> None:
    """Every unit computes (forward or backward) only after its all-gather was waited."""
    pending: set[str] = set()
    for what, kind, unit in log:
        if kind == "all_gather" and what == "issue":
            pending.add(unit)
        elif kind == "all_gather" and what == "wait":
            pending.discard(unit)
        elif what in ("compute", "backward"):
            assert unit not in pending, f"{unit} computes before its all-gather was waited: {log}"


def split(log: list[Event]) -> tuple[list[Event], list[Event]]:
    """(forward, backward): backward starts after the last forward compute."""
    end = max(i for i, event in enumerate(log) if event[:2] == ("compute", "forward")) + 1
    return log[:end], log[end:]


def first(log: list[Event], event: Event, after: int = 0) -> int:
    return log.index(event, after)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("use_orig_params", [True, False], ids=["orig_params", "flat_params"])
def test_backward_prefetches_in_reverse_forward_order_one_at_a_time(device, use_orig_params):
    model = engine.fully_shard(stack().to(device), auto_wrap_classes={Block}, use_orig_params=use_orig_params)
    step(model, device)  # the first iteration runs the order check; the schedule is the same after
    with logged(model) as log:
        step(model, device, seed=1)
    assert_waited_before_compute(log)
    forward, backward = split(log)
    # Forward without forward_prefetch: each unit's gather is issued and waited right before it runs.
    assert [u for what, kind, u in forward if what == "issue" and kind == "all_gather"] == ["root", "1", "2", "3"]
    for unit in ("1", "2", "3"):
        issue = first(forward, ("issue", "all_gather", unit))
        assert forward[issue + 1] == ("wait", "all_gather", unit)
    # Backward gathers 3, 2, 1 (the root stays gathered), each issued while the previous one's
    # backward has not started yet: the gather of 2 is in flight before 3 computes its backward.
    gathers = [u for what, kind, u in backward if what == "issue" and kind == "all_gather"]
    assert gathers == ["3", "2", "1"]
    for current, prefetched in (("3", "2"), ("2", "1")):
        assert first(backward, ("issue", "all_gather", prefetched)) < first(backward, ("backward", "compute", current))
    assert first(backward, ("issue", "all_gather", "3")) < first(backward, ("backward", "compute", "3"))
    # At most one prefetch in flight: besides the unit being gathered for use, one more at most.
    assert max(sum(pending.values()) for _, pending in in_flight(backward, "all_gather")) <= 2
    # Reductions: issued while backward continues; a new one is issued before the oldest is
    # completed, so REDUCTIONS_IN_FLIGHT + 1 right at an issue and at most REDUCTIONS_IN_FLIGHT
    # whenever backward computes; all waited by the end of backward.
    reductions = list(in_flight(backward, "reduce"))
    assert max(sum(pending.values()) for _, pending in reductions) <= REDUCTIONS_IN_FLIGHT + 1
    assert (
        max(sum(pending.values()) for position, pending in reductions if backward[position][0] == "backward")
        <= REDUCTIONS_IN_FLIGHT
    )
    assert not reductions[-1][1], f"reductions never waited: {reductions[-1][1]}"
    issued_3 = first(backward, ("issue", "reduce", "3"))
    assert issued_3 < first(backward, ("backward", "compute", "2")), "reduce-scatter does not overlap backward"
    assert not any(unit.is_unsharded or unit.has_pending_gather for unit in engine.units(model))


@pytest.mark.world_size(2)
def test_forward_prefetch_follows_the_first_iterations_order(device):
    model = engine.fully_shard(stack().to(device), auto_wrap_classes={Block}, forward_prefetch=True)
    with logged(model) as first_log:
        step(model, device)
    # First iteration: no order recorded yet, nothing is gathered ahead.
    first_forward, _ = split(first_log)
    for unit in ("1", "2", "3"):
        issue = first(first_forward, ("issue", "all_gather", unit))
        assert first_forward[issue + 1] == ("wait", "all_gather", unit)
    with logged(model) as log:
        step(model, device, seed=1)
    assert_waited_before_compute(log)
    forward, _ = split(log)
    # Each unit's pre-forward issues its own gather and the next unit's before waiting its own.
    assert forward[:3] == [
        ("issue", "all_gather", "root"),
        ("issue", "all_gather", "1"),
        ("wait", "all_gather", "root"),
    ]
    for current, following in (("1", "2"), ("2", "3")):
        assert first(forward, ("issue", "all_gather", following)) < first(forward, ("wait", "all_gather", current))
    assert max(sum(pending.values()) for _, pending in in_flight(forward, "all_gather")) <= 2


@pytest.mark.world_size(2)
def test_unused_forward_prefetch_is_waited_and_freed(rank, device):
    """Every rank skips block 2 after the first iteration: its prefetched gather is never used,
    yet it is waited before its buffer is freed, and training goes on correctly."""

    class Skipping(nn.Sequential):
        skip = False

        def forward(self, x):
            for index, layer in enumerate(self):
                if not (self.skip and index == 2):
                    x = layer(x)
            return x

    torch.manual_seed(0)
    model = engine.fully_shard(
        Skipping(*stack()).to(device), auto_wrap_classes={Block}, forward_prefetch=True, check_exec_order=False
    )
    step(model, device)
    model.skip = True
    with logged(model) as log:
        step(model, device, seed=1)
    assert ("issue", "all_gather", "2") in log and ("wait", "all_gather", "2") in log
    assert ("compute", "forward", "2") not in log
    assert not any(unit.is_unsharded or unit.has_pending_gather for unit in engine.units(model))
    assert all(unit.unsharded_storage_numel == 0 for unit in engine.units(model))


@pytest.mark.world_size(2)
@pytest.mark.parametrize("mixed", [None, MixedPrecision(param_dtype=torch.bfloat16)], ids=["fp32", "bf16"])
def test_buffers_are_reused_across_steps(device, mixed):
    model = engine.fully_shard(
        stack().to(device), auto_wrap_classes={Block}, mixed_precision=mixed, forward_prefetch=True
    )
    units = engine.units(model)

    def identities() -> list[tuple[int, int | None]]:
        return [
            (unit._full.untyped_storage()._cdata, None if unit._staging is None else unit._staging.data_ptr())
            for unit in units
        ]

    step(model, device)
    before = identities()
    for seed in range(3):
        step(model, device, seed=seed)
    assert identities() == before  # same storage objects, same staging buffers
    assert all(unit.unsharded_storage_numel == 0 for unit in units)
    if mixed is not None:
        assert all(unit._staging is not None for unit in units if unit.has_params)


@pytest.mark.world_size(2)
def test_shard_grad_op_keeps_units_gathered_so_nothing_is_prefetched(device):
    model = engine.fully_shard(stack().to(device), auto_wrap_classes={Block}, strategy=ShardingStrategy.SHARD_GRAD_OP)
    step(model, device)
    with logged(model) as log:
        step(model, device, seed=1)
    _, backward = split(log)
    assert not [event for event in backward if event[:2] == ("issue", "all_gather")]
    assert_waited_before_compute(log)


class CheckpointedStack(nn.Sequential):
    """`stack()` with each block called through non-reentrant activation checkpointing: backward
    runs every block's forward (its pre- and post-forward hooks) again before its backward."""

    def __init__(self) -> None:
        super().__init__(*stack())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, *blocks, last = self
        h = first(x)
        for block in blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
        return last(h)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP], ids=str)
def test_checkpointed_recompute_gathers_once_and_reduces_once(rank, world_size, device, strategy):
    torch.manual_seed(0)
    plain = CheckpointedStack().to(device)
    torch.manual_seed(0)  # the same initial values
    model = engine.fully_shard(
        CheckpointedStack().to(device), auto_wrap_classes={Block}, strategy=strategy, use_orig_params=True
    )
    step(model, device)  # the first iteration (order recorded); the recompute must not disturb it
    model.zero_grad(set_to_none=True)
    with logged(model) as log:
        step(model, device, seed=1 + rank)
    assert_waited_before_compute(log)
    # Backward starts at the first backward compute (recomputed forwards log forward compute in it).
    backward = log[next(i for i, event in enumerate(log) if event[:2] == ("backward", "compute")) :]
    for unit in ("1", "2", "3"):
        assert ("compute", "forward", unit) in backward, f"unit {unit} was not recomputed: {log}"
        # Forward gathers each unit once; backward (its prefetch or the recomputed forward) gathers
        # a unit forward resharded once more, and the unit's backward finds it gathered: no third
        # gather. SHARD_GRAD_OP keeps units gathered after forward: one gather in all.
        gathers = log.count(("issue", "all_gather", unit))
        assert gathers == (2 if strategy is ShardingStrategy.FULL_SHARD else 1), (unit, log)
        assert log.count(("issue", "reduce", unit)) == 1, f"unit {unit} reduced other than once: {log}"
    assert not any(unit.is_unsharded or unit.has_pending_gather for unit in engine.units(model))
    # The gradients are the average over the ranks' batches of the unsharded checkpointed model's.
    for seed in range(1, world_size + 1):
        step(plain, device, seed=seed)
    expected = {name: param.grad / world_size for name, param in plain.named_parameters()}
    with engine.unshard_params(model, with_grads=True):
        shown = {name: param.grad.clone() for name, param in model.named_parameters()}
    assert shown.keys() == expected.keys()
    for name, grad in shown.items():
        torch.testing.assert_close(grad, expected[name], msg=name)
