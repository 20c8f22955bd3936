"""Each scenario family catches a defect of its kind: exec order, 2-D, ZeRO-1, divergence, mixed
precision, gradient accumulation, clipping, activation checkpointing, uneven data, tied weights and
parameter groups.

For every mutation of ``family_mutants`` and every built-in backend it applies to, the family's
scenario runs with the mutant adapter and must fail with the message that names the defect. The
scenario functions are called directly in the ranks (no inner session, no extra pool), except
for divergence: there the verdict is the harness's trace diff, which only a session gives, so one
inner session runs the clean and the mutant reference engine together. The unmutated backends
pass the same scenarios in the suite itself, which is what makes these failures the mutation's.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from pathlib import Path

import family_mutants  # tests/conformance_tests/family_mutants.py
import pytest
import torch
import torch.distributed as dist
from adapter_testing import run_inner_session

import conformance.test_2d as two_d  # modules, so their tests are not collected here
import conformance.test_exec_order as exec_order
import conformance.test_runtime as runtime
import conformance.test_training_numerics as numerics
from conformance.protocol import BackendEnv, Capability, ShardingStrategy
from conformance.suite import registry

Scenario = Callable[..., None]


def _scenario_failure(adapter: object, scenario: Scenario, rank: int, device: torch.device) -> str | None:
    """This rank's assertion message from ``scenario`` run with ``adapter`` (None: it passed)."""
    try:
        scenario(backend=adapter, rank=rank, device=device)
    except AssertionError as error:
        return str(error)
    return None


def _gathered(failure: str | None, world_size: int) -> list[str]:
    """Every rank's assertion message (the ranks that passed left out)."""
    per_rank: list[str | None] = [None] * world_size
    dist.all_gather_object(per_rank, failure)
    return [text for text in per_rank if text is not None]


def _failures(
    mutation: str, backend_name: str, scenario: Scenario, rank: int, world_size: int, device: torch.device
) -> list[str]:
    """Every rank's assertion message from ``scenario`` run with the mutant (None: passed there)."""
    adapter = family_mutants.mutant(registry.load(backend_name), mutation)(BackendEnv(rank, world_size, device))
    try:
        failure = _scenario_failure(adapter, scenario, rank, device)
    finally:
        family_mutants.restore()  # before the gather: what the mutant installed must not reach it
    return _gathered(failure, world_size)


def _failures_everywhere(
    mutation: str,
    backend_name: str,
    scenario: functools.partial,
    rank: int,
    world_size: int,
    device: torch.device,
    saying: str | None = None,
) -> list[str]:
    """`_failures`, which must hold one message per rank (the mutant fails ``scenario`` on every
    rank), each matching the pattern ``saying`` where one is given."""
    texts = _failures(mutation, backend_name, scenario, rank, world_size, device)
    name = scenario.func.__name__
    assert len(texts) == world_size, f"{name} passed on some rank for {backend_name}: {texts}"
    if saying is not None:
        assert all(re.search(saying, t) for t in texts), texts
    return texts


def _assert_clean_passes(
    backend_name: str, scenario: Scenario, rank: int, world_size: int, device: torch.device
) -> None:
    """The unmutated backend passes ``scenario`` on every rank: its failure with the mutant is the mutation's."""
    adapter = registry.load(backend_name)(BackendEnv(rank, world_size, device))
    clean = _gathered(_scenario_failure(adapter, scenario, rank, device), world_size)
    assert not clean, f"the unmutated {backend_name} fails the scenario itself: {clean}"


# A parameter named with its difference, in the report of fixtures.compare.
NAMED_DIFFERENCE = re.compile(r"^\s+[\w.]+: max abs difference (?P<size>[0-9.e+-]+)", re.MULTILINE)


def _some_parameter_moved(texts: list[str]) -> bool:
    """Some report of ``texts`` names a parameter that differs by more than zero."""
    return any(float(m["size"]) > 0 for t in texts for m in NAMED_DIFFERENCE.finditer(t))


def _params(mutation: str) -> list[object]:
    return [pytest.param(name, marks=_unavailable(name)) for name in family_mutants.APPLIES_TO[mutation]]


def against_mutants(mutation: str, world_size: int) -> Callable[[Scenario], Scenario]:
    """A family test's marks: its world size, and one case per built-in backend ``mutation``
    applies to (skipped where that backend cannot run)."""

    def mark(test: Scenario) -> Scenario:
        return pytest.mark.world_size(world_size)(pytest.mark.parametrize("backend_name", _params(mutation))(test))

    return mark


def _unavailable(name: str) -> tuple[pytest.MarkDecorator, ...]:
    if family_mutants.installed(name):
        return ()
    if name in registry.OPTIONAL_BUILTIN:
        return (pytest.mark.skip(reason=f"{name}'s library is not installed: its mutant runs where it is"),)
    return (pytest.mark.skip(reason=f"{name} is not a registered backend here: its mutant runs where it is"),)


# Without the later-iteration warning the ranks go on to the mismatched (equal-sized)
# collectives the scenario provokes on purpose; the scenario itself is marked the same way.
@pytest.mark.expect_divergence
@against_mutants("exec_order", world_size=2)
def test_exec_order_family_catches_a_missing_later_iteration_check(
    backend_name: str, rank: int, world_size: int, device: torch.device
) -> None:
    scenario = functools.partial(
        exec_order.test_later_iteration_order_change_warns_once,
        setup="seed",
        strategy=ShardingStrategy.FULL_SHARD,
        iters_before_path_change=1,
    )
    texts = _failures("exec_order", backend_name, scenario, rank, world_size, device)
    assert texts, f"test_later_iteration_order_change_warns_once passed for {backend_name} without the check"
    assert all(re.search(r"rank \d+: expected one order warning from the forward call", t) for t in texts), texts


@against_mutants("eval_ignored", world_size=2)
def test_exec_order_family_catches_eval_forwards_checked_as_training(
    backend_name: str, rank: int, world_size: int, device: torch.device
) -> None:
    scenario = functools.partial(
        exec_order.test_train_eval_alternation_warns_nothing, setup="seed", strategy=ShardingStrategy.FULL_SHARD
    )
    saying = r"warned about eval forwards: \[.Forward order differs"
    _failures_everywhere("eval_ignored", backend_name, scenario, rank, world_size, device, saying=saying)


@against_mutants("two_d", world_size=4)
def test_2d_family_catches_dim_1_sharded_over_dp(
    backend_name: str, rank: int, world_size: int, device: torch.device
) -> None:
    saying = r"dp placement Shard\(dim=1\), expected Shard\(dim=0\)"
    scenario = functools.partial(two_d.test_2d_sharded_state_dict, model_name="even", world_size=world_size)
    _failures_everywhere("two_d", backend_name, scenario, rank, world_size, device, saying=saying)


@against_mutants("zero1", world_size=2)
def test_zero1_family_catches_an_optimizer_shard_updated_twice(
    backend_name: str, rank: int, world_size: int, device: torch.device
) -> None:
    scenario = functools.partial(
        runtime.test_training,
        wrap="none",  # the whole model one unit: what every ZeRO-1 backend runs (DeepSpeed has no units)
        strategy=ShardingStrategy.SHARD_OPTIM_STATE,
        optimizer="sgd",
        param_offload=False,
        world_size=world_size,
    )
    texts = _failures("zero1", backend_name, scenario, rank, world_size, device)
    assert texts, f"test_training[...SHARD_OPTIM_STATE-sgd] passed for {backend_name} with a shard stepped twice"
    assert _some_parameter_moved(texts), texts


@against_mutants("lowp_double", world_size=2)
def test_mixed_precision_family_catches_a_doubled_low_precision_gradient(
    backend_name: str, rank: int, world_size: int, device: torch.device
) -> None:
    """test_mixed_precision_training[ws2-none-FULL_SHARD-reduce_param_dtype] passes with the
    backend and fails with every gradient computed in low precision doubled, naming the dtype
    and the parameters (or losses) that moved."""
    scenario = functools.partial(
        numerics.test_mixed_precision_training,
        wrap="none",
        strategy=ShardingStrategy.FULL_SHARD,
        reduce_name="reduce_param_dtype",
        world_size=world_size,
    )
    _assert_clean_passes(backend_name, scenario, rank, world_size, device)
    texts = _failures_everywhere("lowp_double", backend_name, scenario, rank, world_size, device)
    assert all("mixed-precision training differs from the single-process oracle" in t for t in texts), texts
    assert all(re.search(r"(fp16|bf16) compute, gradients reduced in (fp16|bf16)", t) for t in texts), texts
    assert _some_parameter_moved(texts), texts


# Most sharded first, among what can run an accumulation: FULL_SHARD where the backend has it
# (DeepSpeed's ZeRO-1/2 fail plain accumulation themselves), else ZeRO-1 (torch-zero).
ACCUMULATION_STRATEGIES = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_OPTIM_STATE, ShardingStrategy.NO_SHARD)


@against_mutants("accumulation_overwrite", world_size=2)
def test_accumulation_family_catches_an_overwritten_gradient(
    backend_name: str, rank: int, world_size: int, device: torch.device
) -> None:
    """test_gradient_accumulation[ws2-plain-none-<strategy>] (two backward passes per step, each
    reducing) passes with the backend and fails with each backward overwriting the stored
    gradients, naming the accumulation and the parameters that moved."""
    declared = registry.load(backend_name).CAPABILITIES
    strategy = next(s for s in ACCUMULATION_STRATEGIES if Capability.for_strategy(s) in declared)
    scenario = functools.partial(
        numerics.test_gradient_accumulation, mode="plain", wrap="none", strategy=strategy, world_size=world_size
    )
    _assert_clean_passes(backend_name, scenario, rank, world_size, device)
    texts = _failures_everywhere("accumulation_overwrite", backend_name, scenario, rank, world_size, device)
    expected = "gradient accumulation (plain: 2 steps of 2 backward passes) differs from the single-process oracle"
    assert all(expected in t for t in texts), texts
    assert _some_parameter_moved(texts), texts


@against_mutants("clip_local_norm", world_size=2)
def test_clipping_family_catches_a_local_norm(
    backend_name: str, rank: int, world_size: int, device: torch.device
) -> None:
    """test_gradient_clipping[ws2-none-FULL_SHARD] passes with the backend and fails with each
    rank clipping by the norm of its own gradient pieces: the norm it returns is named against
    the oracle's, and the parameters moved."""
    scenario = functools.partial(
        numerics.test_gradient_clipping, wrap="none", strategy=ShardingStrategy.FULL_SHARD, world_size=world_size
    )
    _assert_clean_passes(backend_name, scenario, rank, world_size, device)
    texts = _failures_everywhere("clip_local_norm", backend_name, scenario, rank, world_size, device)
    assert all("gradient clipping to total norm 0.05 (FULL_SHARD, one unit) differs" in t for t in texts), texts
    assert all(re.search(r"clip_grad_norm at step 0 returned the total norm [\d.]+; the oracle's", t) for t in texts)
    assert _some_parameter_moved(texts), texts


def _training_family_catches(
    mutation: str,
    backend_name: str,
    scenario: Scenario,
    expected: str,
    rank: int,
    world_size: int,
    device: torch.device,
    *,
    inert_without_it: bool = True,
) -> None:
    """``scenario`` (a test of conformance/test_training_numerics.py) with the whole model one
    unit, under the first of ACCUMULATION_STRATEGIES the backend declares: it passes with the
    clean backend and fails on every rank with ``mutation``, saying ``expected`` (``{strategy}``
    standing for the strategy's name) and naming a parameter that moved. ``inert_without_it``:
    the mutant passes plain gradient accumulation, which has none of what the family exercises
    (no recomputation, even data, no tied parameters), so the failure is the family's alone."""
    declared = registry.load(backend_name).CAPABILITIES
    strategy = next(s for s in ACCUMULATION_STRATEGIES if Capability.for_strategy(s) in declared)
    scenario = functools.partial(scenario, wrap="none", strategy=strategy, world_size=world_size)
    _assert_clean_passes(backend_name, scenario, rank, world_size, device)
    texts = _failures_everywhere(mutation, backend_name, scenario, rank, world_size, device)
    wanted = expected.format(strategy=strategy.name)
    assert all(wanted in t for t in texts), texts
    assert _some_parameter_moved(texts), texts
    if inert_without_it:
        plain = functools.partial(
            numerics.test_gradient_accumulation, mode="plain", wrap="none", strategy=strategy, world_size=world_size
        )
        assert not _failures(mutation, backend_name, plain, rank, world_size, device)


@against_mutants("checkpoint_reduced_twice", world_size=2)
def test_checkpointing_family_catches_gradients_reduced_twice(
    backend_name: str, rank: int, world_size: int, device: torch.device
) -> None:
    """test_activation_checkpointing[ws2-none-<strategy>] passes with the backend and fails with
    a backward that recomputes a checkpointed unit doubling the gradients it stores, naming the
    checkpointed training and the parameters that moved. The same mutant passes a scenario
    without checkpointing (test_gradient_accumulation's plain case): only recomputation sets it off."""
    expected = "activation-checkpointed training ({strategy}, one unit) differs from the single-process oracle"
    _training_family_catches(
        "checkpoint_reduced_twice",
        backend_name,
        numerics.test_activation_checkpointing,
        expected,
        rank,
        world_size,
        device,
    )


@against_mutants("sample_weighted", world_size=2)
def test_uneven_data_family_catches_gradients_weighted_by_samples(
    backend_name: str, rank: int, world_size: int, device: torch.device
) -> None:
    """test_uneven_batches[ws2-none-<strategy>] passes with the backend and fails with each rank's
    gradient weighted by its share of the samples, naming the batch sizes and the parameters that
    moved. The same mutant passes with even data (test_gradient_accumulation's plain case)."""
    expected = "training on uneven batches (samples per rank 2, 3; {strategy}, one unit) differs"
    _training_family_catches(
        "sample_weighted", backend_name, numerics.test_uneven_batches, expected, rank, world_size, device
    )


@against_mutants("untied", world_size=2)
def test_tied_weights_family_catches_untied_parameters(
    backend_name: str, rank: int, world_size: int, device: torch.device
) -> None:
    """test_tied_weights_training[ws2-none-<strategy>] passes with the backend and fails with the
    tied embedding and output weights untied by shard(), naming the parameters that moved. The
    same mutant passes a model without tied parameters (test_gradient_accumulation's plain case)."""
    expected = "training with tied weights ({strategy}, one unit) differs from the single-process oracle"
    _training_family_catches(
        "untied", backend_name, numerics.test_tied_weights_training, expected, rank, world_size, device
    )


@against_mutants("groups_ignored", world_size=2)
def test_parameter_groups_family_catches_dropped_groups(
    backend_name: str, rank: int, world_size: int, device: torch.device
) -> None:
    """test_parameter_groups[ws2-none-<strategy>] passes with the backend and fails with its
    parameter groups dropped (every parameter with the factory's defaults), naming the
    parameters that moved."""
    expected = "training with parameter groups ({strategy}, one unit) differs from the single-process oracle"
    _training_family_catches(
        "groups_ignored",
        backend_name,
        numerics.test_parameter_groups,
        expected,
        rank,
        world_size,
        device,
        inert_without_it=False,
    )


@against_mutants("init_skipped", world_size=2)
def test_deferred_init_family_catches_uninitialized_submodules(
    backend_name: str, rank: int, world_size: int, device: torch.device
) -> None:
    """test_deferred_init[ws2-none-<strategy>] passes with the backend and fails with deferred
    initialization skipping the modules below the root's children: the check right after
    sharding names a unit's parameter that is not what the init filled in, and training moves
    away from the oracle. The same mutant passes a model built on a real device
    (test_gradient_accumulation's plain case)."""
    expected = "training a model built on the meta device ({strategy}, one unit) differs from the single-process oracle"
    _training_family_catches(
        "init_skipped", backend_name, numerics.test_deferred_init, expected, rank, world_size, device
    )


DIVERGENCE_INNER_TESTS = """
import pytest
from conformance.test_divergence import test_same_shape_divergence_is_not_silent as same_shape

@pytest.mark.world_size(2)
def test_same_shape(backend, rank, device):
    same_shape(backend=backend, rank=rank, device=device)
"""


def test_divergence_family_catches_a_backend_without_its_order_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``test_same_shape_divergence_is_not_silent`` on the clean reference engine passes (its order
    check raises on every rank); with the check off the step completes and the harness's trace
    diff fails the scenario. torch FSDP1 and FSDP2 are this mutant out of the box: their clean
    runs are expected failures for exactly this reason (``test_backend_divergence.py``)."""
    here = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    mutant = family_mutants.selection("reference", "divergence")
    result = run_inner_session(tmp_path, DIVERGENCE_INNER_TESTS, ["reference", mutant], "--collective-timeout=10")
    output = result.stdout + result.stderr
    assert "1 failed, 1 passed" in output, output
    assert "PASSED test_inner.py::test_same_shape[reference]" in output, output
    section = re.search(r"_ test_same_shape\[reference\+divergence\] _+\n(?P<body>.*?)\nREPRO:", output, re.S)
    assert section is not None, output
    failure = section["body"]
    assert "ranks issued divergent collectives" in failure, failure
    assert "Forward order differs" not in failure, failure
