"""Execution-order scenarios: a backend that validates the forward order catches ranks that
disagree on it (an error in the first iteration, a one-time warning later) and leaves eval alone.

The scenarios shard :class:`fixtures.TwoPathModel`: ``stem`` is the root unit, ``path_a`` and
``path_b`` are units of 36 elements each. A rank that takes the other path therefore all-gathers
(and reduce-scatters) a tensor of exactly the size its peers use for theirs: no shape check in
the collective library notices, only an execution-order check can. The first-iteration check
also runs on the seed's own model (:class:`fixtures.UnequalTwoPathModel`), whose paths differ in
shape: there the check must fire before the first mismatched collective, which gloo would
answer by aborting the process (the harness turns that into this test's failure).

The later-iteration and train/eval scenarios run two setups (the ``setup`` axis): ``equal``
(:class:`fixtures.TwoPathModel` with original parameters) and ``seed`` (the seed's own
configuration: its 6 -> 3 -> 6 model with flat parameters, ``use_orig_params=False``). After the
warning the ranks issue the mismatched collectives on purpose; both setups keep those the same
size (equal shapes, or one unpadded 36-element flat parameter per path), so they complete.

``EXEC_ORDER_CHECK`` is *forward*-order validation, as in the seed: the later-iteration warning
must be issued by the forward call of the changed step, not by its backward.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator

import pytest
import torch

import fixtures
from conformance.protocol import (
    BackendAdapter,
    Capability,
    ShardingSpec,
    ShardingStrategy,
    require,
)
from harness import current_seed

STRATEGIES = [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP]
MODELS = {"equal": fixtures.TwoPathModel, "seed": fixtures.UnequalTwoPathModel}
# The later-iteration / train-eval setups: (model, use_orig_params). "seed" is the seed's own:
# its 6 -> 3 -> 6 path with flat parameters.
SETUPS = {"equal": (fixtures.TwoPathModel, True), "seed": (fixtures.UnequalTwoPathModel, False)}
LOCAL_BATCH = 8
ORDER_WARNING_PREFIX = "Forward order differs"
# The seed's later-iteration warning, verbatim up to the rank's own details.
LATER_WARNING = (
    "Forward order differs from that of the first iteration on rank {rank}. Collectives are "
    "unchecked and may give incorrect results or hang"
)


def _sharded_models(
    backend: BackendAdapter,
    strategy: ShardingStrategy,
    device: torch.device,
    use_orig_params: bool = True,
    model_cls: type[fixtures.TwoPathModel] = fixtures.TwoPathModel,
) -> Iterator[tuple[fixtures.TwoPathModel, torch.nn.Module]]:
    """(original model, module to run) for every form the backend has, with order checking on.

    The check and the strategy are required first, so a backend without them is reported
    unsupported instead of failing inside ``shard``.
    """
    require(backend, Capability.EXEC_ORDER_CHECK)
    require(backend, Capability.for_strategy(strategy))
    if not use_orig_params:
        require(backend, Capability.FLAT_PARAMETERS)
    spec = ShardingSpec(
        strategy=strategy,
        manual_units=fixtures.TwoPathModel.UNIT_FQNS,
        use_orig_params=use_orig_params,
        check_exec_order=True,
    )
    for form in backend.forms():
        model = fixtures.build(model_cls, current_seed(), device)
        yield model, backend.shard(model, spec, form)


def _inputs(model: fixtures.TwoPathModel, iteration: int, rank: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    return fixtures.local_batch(
        model,
        seed=current_seed(),
        iteration=iteration,
        rank=rank,
        batch_size=LOCAL_BATCH,
        device=device,
    )


def _order_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [
        str(w.message)
        for w in caught
        if issubclass(w.category, UserWarning) and str(w.message).startswith(ORDER_WARNING_PREFIX)
    ]


def _train_step(
    backend: BackendAdapter,
    model: fixtures.TwoPathModel,
    sharded: torch.nn.Module,
    iteration: int,
    rank: int,
    device: torch.device,
) -> tuple[list[str], list[str]]:
    """One forward + backward (through the adapter); returns the order warnings issued by the
    forward call and by the backward, separately (the seed expects the warning in forward)."""
    with warnings.catch_warnings(record=True) as in_forward:
        warnings.simplefilter("always")  # count every issue, not just the first per location
        loss = model.loss(sharded(*_inputs(model, iteration, rank, device)))
    with warnings.catch_warnings(record=True) as in_backward:
        warnings.simplefilter("always")
        backend.backward(sharded, loss)
    return _order_warnings(in_forward), _order_warnings(in_backward)


# The order check is itself a collective, issued from inside the unit about to run: when the
# check carries no label of its own (FSDP1's), the harness labels it with the running module and
# sees path_a on rank 0 and path_b elsewhere, although the ranks issue the same check on purpose.
@pytest.mark.expect_divergence
@pytest.mark.world_size(min=2, default=[2, 4])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
@pytest.mark.parametrize("params", ["original", "flat"])
@pytest.mark.parametrize("model", list(MODELS))
def test_first_iteration_order_mismatch_raises(
    backend: BackendAdapter,
    model: str,
    strategy: ShardingStrategy,
    params: str,
    rank: int,
    device: torch.device,
) -> None:
    """Ranks that take different paths in the first forward all raise.

    Rank 0 takes ``path_a``, every other rank ``path_b``. Every rank must raise
    ``RuntimeError("Forward order differs across ranks ...")``: on one rank only, the others
    would block in a collective. ``params``: the model exposes its original parameters
    (``use_orig_params=True``) or flat parameters (the seed's configuration). ``model``:
    ``equal`` (paths of equal shapes) or ``seed`` (the seed's unequal shapes, module docstring).
    Marked ``expect_divergence`` because of the labels of the check's own collectives (above);
    the ``pytest.raises`` on every rank is what this scenario asserts.
    """
    models = _sharded_models(backend, strategy, device, use_orig_params=params == "original", model_cls=MODELS[model])
    for two_path, sharded in models:
        if rank != 0:
            two_path.flip_path()
        with pytest.raises(RuntimeError, match=r"^Forward order differs across ranks"):
            sharded(*_inputs(two_path, 0, rank, device))


# The ranks other than 0 all-gather and reduce-scatter path_b where rank 0 uses path_a: the
# harness would report that as divergent collectives, yet detecting it is the point here. Both
# paths are 36 elements, so the mismatched pairs still have equal sizes and complete.
@pytest.mark.expect_divergence
@pytest.mark.world_size(min=2, default=[2, 4])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
@pytest.mark.parametrize("iters_before_path_change", [1, 3])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_later_iteration_order_change_warns_once(
    backend: BackendAdapter,
    setup: str,
    strategy: ShardingStrategy,
    iters_before_path_change: int,
    rank: int,
    device: torch.device,
) -> None:
    """A path change after the first iteration warns once, from the forward call, on the
    changing ranks only.

    All ranks train ``iters_before_path_change`` steps on ``path_a``; then every rank but 0
    switches to ``path_b``. Each switching rank R issues exactly one ``UserWarning("Forward
    order differs from that of the first iteration on rank R. Collectives are unchecked and may
    give incorrect results or hang ...")`` (the seed's text) from the forward call of the
    changed step (its backward warns nothing) and none in the step after; rank 0 and the steps
    before the change warn nothing. ``setup``: module docstring.

    Marked ``expect_divergence``: after the switch the ranks issue collectives for different
    units on purpose (equal sizes, so they still pair up and complete), which the harness's
    trace diff would otherwise report as a failure.
    """
    expected_warning = "^" + re.escape(LATER_WARNING.format(rank=rank))
    model_cls, use_orig_params = SETUPS[setup]
    # Every form runs to the end before any (rank-dependent) assertion, so a rank that fails
    # never leaves its peers in the next form's collectives.
    runs = []
    for model, sharded in _sharded_models(backend, strategy, device, use_orig_params, model_cls):
        before = [_train_step(backend, model, sharded, i, rank, device) for i in range(iters_before_path_change)]
        if rank != 0:
            model.flip_path()
        changed, changed_backward = _train_step(backend, model, sharded, iters_before_path_change, rank, device)
        after = _train_step(backend, model, sharded, iters_before_path_change + 1, rank, device)
        runs.append((before, changed, changed_backward, after))
    for before, changed, changed_backward, after in runs:
        for iteration, issued in enumerate(before):
            assert issued == ([], []), f"rank {rank} warned before any path changed (iteration {iteration}): {issued}"
        if rank == 0:
            assert changed == [], f"rank 0 kept its path but warned: {changed}"
        else:
            assert len(changed) == 1, (
                f"rank {rank}: expected one order warning from the forward call of the changed step, "
                f"got {changed} (its backward warned {changed_backward})"
            )
            assert re.search(expected_warning, changed[0]), (
                f"rank {rank}: {changed[0]!r} does not match {expected_warning!r}"
            )
        assert changed_backward == [], (
            f"rank {rank}: the backward of the changed step warned {changed_backward}; the check "
            "validates the forward order and warns once, from forward"
        )
        assert after == ([], []), f"rank {rank} warned again in the step after the change: {after}"


@pytest.mark.world_size(min=2, default=[2, 4])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
@pytest.mark.parametrize("setup", list(SETUPS))
def test_train_eval_alternation_warns_nothing(
    backend: BackendAdapter, setup: str, strategy: ShardingStrategy, rank: int, device: torch.device
) -> None:
    """Eval forwards are not order-checked; switching between train and eval is not a change.

    Two epochs of three training steps on ``path_a`` and three eval forwards on ``path_b``
    (every rank), the eval forwards with autograd on and their loss computed, as in the seed
    (``eval()`` alone, not ``no_grad``, must turn the check off). A backend that checked eval
    forwards against the first training iteration, or that took the eval forwards as a new
    first iteration, would warn. None may warn. ``setup``: module docstring.

    Every rank takes the same eval path: with rank-dependent eval paths, a strategy that keeps
    units unsharded after a forward (SHARD_GRAD_OP) leaves different units unsharded per rank,
    and the next training forward issues different all-gathers — a user error about
    collectives, not about the order check this scenario is for.
    """
    model_cls, use_orig_params = SETUPS[setup]
    issued: list[str] = []  # asserted once every form has run (a failing rank never strands its peers)
    for model, sharded in _sharded_models(backend, strategy, device, use_orig_params, model_cls):
        iteration = 0
        for _epoch in range(2):
            sharded.train()
            for _ in range(3):
                in_forward, in_backward = _train_step(backend, model, sharded, iteration, rank, device)
                issued += in_forward + in_backward
                iteration += 1
            sharded.eval()
            # Only the route changes: flipping requires_grad here would edit parameters an
            # autograd-on forward may still hold unsharded (a user error of its own).
            model.use_path_b = True
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(3):
                    assert torch.is_grad_enabled(), "the eval forwards must run with autograd on, as in the seed"
                    model.loss(sharded(*_inputs(model, iteration, rank, device)))
                    iteration += 1
            issued += _order_warnings(caught)
            model.use_path_b = False
    assert issued == [], f"rank {rank} warned about eval forwards: {issued}"
