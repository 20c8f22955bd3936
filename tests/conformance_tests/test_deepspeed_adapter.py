"""The DeepSpeed adapter's basics, on the backend itself: strategy -> stage mapping and
training parity through the hooks, ZeRO-3 storage, unshard, state dicts, the rank environment,
cached groups, labels; and the DeepSpeed behaviours its expected failures will cite, pinned so
that a DeepSpeed release that changes them is noticed.

Skipped as a whole when DeepSpeed is not installed (``DS_BUILD_OPS=0 pip install
'fsdp-conformance[deepspeed]'``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn as nn
from adapter_testing import ops_labelled, run_inner_session, traced_tables, train_steps

import fixtures
from conformance.protocol import (
    ApiForm,
    BackendEnv,
    Capability,
    Holding,
    Phase,
    ShardingSpec,
    ShardingStrategy,
    StateDictKind,
    Stored,
    share_bounds,
    storage_claim,
)

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed)", allow_module_level=True)

TARGET = "conformance.adapters.deepspeed:DeepSpeedAdapter"
STAGES = {
    ShardingStrategy.NO_SHARD: 0,
    ShardingStrategy.SHARD_OPTIM_STATE: 1,
    ShardingStrategy.SHARD_GRAD_AND_OPTIM_STATE: 2,
    ShardingStrategy.FULL_SHARD: 3,
}
ADAM = functools.partial(torch.optim.Adam, lr=1e-2)
# As conformance/test_runtime.py: fp32 reduction order only (observed ~1e-6 here).
LOSS_TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}
PARAM_TOLERANCE = {"rtol": 1e-3, "atol": 1e-3}


def adapter(rank: int, world_size: int, device: torch.device):
    # Imported in the rank: the module imports DeepSpeed lazily, with the rank's accelerator.
    from conformance.adapters.deepspeed import DeepSpeedAdapter

    return DeepSpeedAdapter(BackendEnv(rank, world_size, device, local_rank=rank))


def trained(backend, strategy: ShardingStrategy, steps: int, rank: int, device: torch.device, seed: int = 0):
    """A CompositeModel sharded with ``strategy`` and its optimizer, after ``steps`` steps."""
    model = fixtures.build(fixtures.CompositeModel, seed, device, dim=8)
    sharded = backend.shard(model, ShardingSpec(strategy=strategy), ApiForm.WRAPPER)
    optim = backend.make_optimizer(sharded, ADAM)
    train_steps(backend, sharded, model, optim, steps, rank, device, first_iteration=5 * seed)
    return model, sharded, optim


class Square5(nn.Sequential):
    """One 5x5 weight: 25 elements, not divisible by 2 ranks (ZeRO-3 pads rank 1's part)."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(5, 5, bias=False))


def square_step(backend, sharded, optim, device) -> None:
    backend.zero_grad(sharded, optim)
    backend.backward(sharded, sharded(torch.ones(2, 5, device=device)).sum())
    backend.step(sharded, optim)


# -- training -------------------------------------------------------------------------------


@pytest.mark.world_size(2)
@pytest.mark.parametrize("strategy", list(STAGES), ids=lambda s: s.name)
def test_each_strategy_is_its_zero_stage_and_trains_like_the_oracle(strategy, rank, world_size, device):
    """Units only where DeepSpeed has them (ZeRO-3); stages 0-2 train the unit-less plan."""
    backend = adapter(rank, world_size, device)
    plan = fixtures.TrainingPlan(seed=0, iterations=4, batch_size=2, make_optimizer=ADAM)
    oracle = fixtures.train_oracle(
        fixtures.build(fixtures.CompositeModel, 0, device, dim=8), plan, world_size=world_size, device=device
    )
    model = fixtures.build(fixtures.CompositeModel, 0, device, dim=8)
    units = (fixtures.Unit,) if strategy is ShardingStrategy.FULL_SHARD else ()
    sharded = backend.shard(model, ShardingSpec(strategy=strategy, auto_wrap_classes=units), ApiForm.WRAPPER)
    optim = backend.make_optimizer(sharded, plan.make_optimizer)
    assert sharded.engine.zero_optimization_stage() == STAGES[strategy]
    assert sharded.engine.gradient_clipping() == 0.0  # DeepSpeed's default would clip to 1.0
    losses = train_steps(backend, sharded, model, optim, plan.iterations, rank, device)
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor([r[rank] for r in oracle.rank_losses]), **LOSS_TOLERANCE
    )
    state = backend.state_dict(sharded, StateDictKind.FULL)
    assert state.keys() == oracle.state_dict.keys()
    for name, expected in oracle.state_dict.items():
        torch.testing.assert_close(state[name], expected, **PARAM_TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")
    backend.close()


@pytest.mark.world_size(2)
def test_rank_environment_and_engine_lifetime(rank, world_size, device):
    """LOCAL_RANK/RANK/WORLD_SIZE come from BackendEnv; the optimizer must come before the
    first forward (DeepSpeed takes it at engine creation); a forward without one builds the
    engine with a placeholder so backward works."""
    backend = adapter(rank, world_size, device)
    assert (os.environ["LOCAL_RANK"], os.environ["RANK"], os.environ["WORLD_SIZE"]) == (
        str(rank),
        str(rank),
        str(world_size),
    )
    model = fixtures.build(fixtures.CompositeModel, 0, device, dim=4)
    sharded = backend.shard(model, ShardingSpec(), ApiForm.WRAPPER)
    inputs = fixtures.local_batch(model, seed=0, iteration=0, rank=rank, batch_size=2, device=device)
    backend.backward(sharded, model.loss(sharded(*inputs)))
    with pytest.raises(RuntimeError, match="call make_optimizer once, right after shard"):
        backend.make_optimizer(sharded, ADAM)
    assert not backend.supports(Capability.COMPOSABLE) and backend.forms() == [ApiForm.WRAPPER]


@pytest.mark.world_size(2)
def test_cached_groups_are_released_for_the_next_engine(rank, world_size, device):
    """The harness destroys every group a test created; DeepSpeed caches its clone of the
    world group. After close() and that destruction, a new engine must still build."""
    before = set(c10d._world.pg_map)
    for _ in range(2):
        backend = adapter(rank, world_size, device)
        model = fixtures.build(fixtures.CompositeModel, 0, device, dim=4)
        spec = ShardingSpec(strategy=ShardingStrategy.SHARD_GRAD_AND_OPTIM_STATE)
        sharded = backend.shard(model, spec, ApiForm.WRAPPER)
        backend.make_optimizer(sharded, ADAM)
        backend.close()
        for group in [g for g in c10d._world.pg_map if g not in before]:
            dist.destroy_process_group(group)  # what harness.rank.isolation does after each test


# -- what each stage stores (conformance.protocol.storage) ---------------------------------------


def _summed_numels(values: dict[str, int], device: torch.device) -> dict[str, int]:
    """Per parameter, the elements all ranks store together."""
    names = sorted(values)
    counts = torch.tensor([values[name] for name in names], device=device)
    dist.all_reduce(counts)
    return dict(zip(names, counts.tolist()))


def _stored_numels(backend, sharded, names, stored: Stored, optim=None) -> dict[str, int]:
    if stored is Stored.PARAMETERS:
        return {name: backend.local_shard(sharded, name).numel() for name in names}
    if stored is Stored.GRADIENTS:
        grads = {name: backend.local_grad_shard(sharded, name) for name in names}
        return {name: 0 if grad is None else grad.numel() for name, grad in grads.items()}
    states = {name: backend.local_optim_state(sharded, optim, name) for name in names}
    assert all(set(state) <= {"exp_avg", "exp_avg_sq"} for state in states.values()), states
    # Each elementwise state on its own; Adam keeps two of the same size.
    return {name: sum(value.numel() for value in state.values()) // 2 for name, state in states.items()}


# DeepSpeed 0.19.8's ZeRO-1 frees param.grad after a boundary backward and keeps only this rank's
# partition of the reduced gradients, like ZeRO-2: SHARD_OPTIM_STATE's claim (whole gradients)
# does not hold, and the storage scenario's expected failure cites this.
DEEPSPEED_STORES = {(ShardingStrategy.SHARD_OPTIM_STATE, Stored.GRADIENTS): Holding.SHARDED}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("strategy", list(STAGES), ids=lambda s: s.name)
def test_each_stage_stores_what_its_strategy_claims(strategy, rank, world_size, device):
    """Per parameter of CompositeModel, summed over the ranks: parameters between forward and
    backward (second step, after DeepSpeed recorded its trace) and at rest, gradients after
    backward, Adam's state after the step, each within storage.share_bounds of the strategy's
    claim; where DeepSpeed stores otherwise (DEEPSPEED_STORES), its behaviour is pinned instead."""
    backend = adapter(rank, world_size, device)
    model = fixtures.build(fixtures.CompositeModel, 0, device, dim=8)
    numels = {name: p.numel() for name, p in model.named_parameters()}
    sharded = backend.shard(model, ShardingSpec(strategy=strategy), ApiForm.WRAPPER)
    optim = backend.make_optimizer(sharded, ADAM)
    claim = storage_claim(strategy)
    observed: list[str] = []

    def check(stored: Stored, phase: Phase) -> None:
        holding = DEEPSPEED_STORES.get((strategy, stored), claim.holding(stored, phase))
        summed = _summed_numels(_stored_numels(backend, sharded, list(numels), stored, optim), device)
        for name, numel in numels.items():
            low, high = share_bounds(numel, holding, world_size, world_size)
            observed.append(f"{stored.value} {phase.value} {name}: {summed[name]}")
            assert low <= summed[name] <= high, (
                f"{strategy.name} {stored.value} {phase.value}: {name} ({numel} elements) stored "
                f"{summed[name]} times over the ranks; {holding.value} allows [{low}, {high}]"
            )

    for iteration in range(2):
        backend.zero_grad(sharded, optim)
        loss = model.loss(
            sharded(*fixtures.local_batch(model, seed=0, iteration=iteration, rank=rank, batch_size=2, device=device))
        )
        if iteration == 1:
            check(Stored.PARAMETERS, Phase.BETWEEN_FORWARD_AND_BACKWARD)
        backend.backward(sharded, loss)
        check(Stored.GRADIENTS, Phase.AFTER_BACKWARD)
        backend.step(sharded, optim)
        check(Stored.PARAMETERS, Phase.AT_REST)
        check(Stored.OPTIMIZER_STATE, Phase.AT_REST)
    if rank == 0:
        print(f"{strategy.name} at world size {world_size}: " + "; ".join(observed[-3 * len(numels) :]))
    backend.close()


# -- gradient accumulation, reduction dtype ---------------------------------------------------


def _full_grads(sharded) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_grad

    return {name: safe_get_full_grad(p).clone() for name, p in sharded.module.named_parameters()}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("strategy", list(STAGES), ids=lambda s: s.name)
def test_backwards_before_a_step_add_or_replace_and_no_sync_accumulates(strategy, rank, world_size, device):
    """Two backward calls before a step (gradient_accumulation_steps 1, every backward a
    boundary): stages 0 and 3 add the gradients, stages 1 and 2 keep the second backward's only
    (DeepSpeed replaces its reduced partitions; expected failures cite this). no_gradient_sync
    (engine.no_sync) inside which one backward runs, then one outside: the sum, on stages 0-1,
    the ones the adapter declares it for."""
    backend = adapter(rank, world_size, device)

    def fresh():
        model = fixtures.build(fixtures.CompositeModel, 0, device, dim=8)
        sharded = backend.shard(model, ShardingSpec(strategy=strategy), ApiForm.WRAPPER)
        backend.make_optimizer(sharded, ADAM)
        losses = [
            (
                lambda it=it: model.loss(
                    sharded(*fixtures.local_batch(model, seed=0, iteration=it, rank=rank, batch_size=2, device=device))
                )
            )
            for it in (0, 1)
        ]
        return sharded, losses

    sharded, losses = fresh()
    backend.backward(sharded, losses[0]() + losses[1]())
    summed = _full_grads(sharded)
    sharded, losses = fresh()
    backend.backward(sharded, losses[1]())
    second_only = _full_grads(sharded)

    sharded, losses = fresh()
    backend.backward(sharded, losses[0]())
    backend.backward(sharded, losses[1]())
    adds = strategy in (ShardingStrategy.NO_SHARD, ShardingStrategy.FULL_SHARD)
    for name, grad in _full_grads(sharded).items():
        torch.testing.assert_close(grad, summed[name] if adds else second_only[name], msg=lambda m, n=name: f"{n}: {m}")

    if frozenset({Capability.NO_SYNC, Capability.for_strategy(strategy)}) in backend.unsupported_combinations():
        return  # stages 2 and 3: DeepSpeed refuses (tests/conformance_tests/test_declared_absences.py)
    sharded, losses = fresh()
    with backend.no_gradient_sync(sharded):
        backend.backward(sharded, losses[0]())
        local = {name: backend.local_grad_shard(sharded, name) for name in summed}
        assert all(g is not None and g.shape == summed[name].shape for name, g in local.items()), "not local, whole"
    backend.backward(sharded, losses[1]())
    for name, grad in _full_grads(sharded).items():
        torch.testing.assert_close(grad, summed[name], msg=lambda m, n=name: f"{n}: {m}")


@contextlib.contextmanager
def _reduction_dtypes():
    """The dtypes of the floating tensors passed to DeepSpeed's comm backend's reductions
    (every stage reduces through it) while the context is open."""
    from deepspeed import comm

    sent: list[torch.dtype] = []
    backend_object = comm.comm.cdb
    names = ("all_reduce", "reduce", "reduce_scatter_tensor", "reduce_scatter", "all_to_all_single")
    originals = {name: getattr(backend_object, name) for name in names if hasattr(backend_object, name)}

    def recording(original):
        def call(*args, **kwargs):
            tensors = [*args, *kwargs.values()]
            sent.extend(t.dtype for t in tensors if torch.is_tensor(t) and t.is_floating_point())
            return original(*args, **kwargs)

        return call

    for name, original in originals.items():
        setattr(backend_object, name, recording(original))
    try:
        yield sent
    finally:
        for name in originals:
            delattr(backend_object, name)  # the instance attribute: the class's method shows again


@pytest.mark.world_size(2)
@pytest.mark.parametrize("strategy", list(STAGES), ids=lambda s: s.name)
def test_gradients_are_reduced_in_the_compute_dtype_unless_reduce_dtype_says_float32(
    strategy, rank, world_size, device
):
    """bf16 (the CPU accelerator's): every floating tensor the backward's reductions send
    through DeepSpeed's comm backend is bf16 with reduce_dtype None, float32 with float32
    (communication_data_type)."""
    backend = adapter(rank, world_size, device)
    for reduce_dtype, expected in ((None, torch.bfloat16), (torch.float32, torch.float32)):
        model = fixtures.build(fixtures.CompositeModel, 0, device, dim=8)
        spec = ShardingSpec(strategy=strategy, param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        sharded = backend.shard(model, spec, ApiForm.WRAPPER)
        optim = backend.make_optimizer(sharded, ADAM)
        loss = model.loss(
            sharded(*fixtures.local_batch(model, seed=0, iteration=0, rank=rank, batch_size=2, device=device))
        )
        with _reduction_dtypes() as sent:
            backend.backward(sharded, loss)
        assert sent and set(sent) == {expected}, (reduce_dtype, sorted(map(str, set(sent))))
        backend.step(sharded, optim)
    backend.close()


SGD = functools.partial(torch.optim.SGD, lr=1e-3)  # test_training_numerics' mixed-precision optimizer


@pytest.mark.world_size(2)
@pytest.mark.parametrize(
    "strategy", [ShardingStrategy.NO_SHARD, ShardingStrategy.SHARD_OPTIM_STATE], ids=lambda s: s.name
)
def test_fp16_runs_without_loss_scaling_as_deepspeeds_default_scaler_changes_the_steps(
    strategy, rank, world_size, device
):
    """Where DeepSpeed's accelerator has float16 (CUDA; on CPU only with oneDNN's fp16: AVX512-FP16
    or AMX-FP16, not under ONEDNN_MAX_CPU_ISA=AVX2): the adapter's fp16 mode has a static loss
    scale of 1, and a step moves every parameter as the oracle's step does, from the parameters
    rounded to float16 (all DeepSpeed keeps once it has cast the model). DeepSpeed's default,
    dynamic scaling from 2**16, pinned: one SGD step leaves every parameter where it was, ZeRO-1
    because it skips the step (the gradient of 65536 x a float16 loss is inf in float16), ZeRO-0
    while taking it (engine.backward never scales the loss, step divides the gradients by 65536:
    deepspeedai/DeepSpeed#8393)."""
    backend = adapter(rank, world_size, device)
    if torch.float16 not in backend.mixed_precision_dtypes():
        backend.close()
        pytest.skip(reason="DeepSpeed's accelerator has no float16 here (on CPU: no AVX512-FP16 / AMX-FP16 for oneDNN)")
    spec = ShardingSpec(strategy=strategy, param_dtype=torch.float16)
    plan = fixtures.TrainingPlan(seed=0, iterations=1, batch_size=2, make_optimizer=SGD)
    rounded = fixtures.build(fixtures.CompositeModel, 0, device, dim=8)
    with torch.no_grad():
        for param in rounded.parameters():
            param.copy_(param.half().float())
    oracle = fixtures.train_oracle(
        rounded, plan, world_size=world_size, device=device, precision=fixtures.Precision(torch.float16)
    )
    for default_scaler in (False, True):
        model = fixtures.build(fixtures.CompositeModel, 0, device, dim=8)
        sharded = backend.shard(model, spec, ApiForm.WRAPPER)
        if default_scaler:
            del sharded.config["fp16"]["loss_scale"]  # before the engine is built (make_optimizer)
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        optim = backend.make_optimizer(sharded, plan.make_optimizer)
        train_steps(backend, sharded, model, optim, plan.iterations, rank, device)
        after = {name: p.detach().clone() for name, p in model.named_parameters()}
        skipped = sharded.engine.skipped_steps
        if not default_scaler:
            assert (optim.loss_scale, skipped) == (1.0, 0)
            for name, expected in oracle.state_dict.items():
                if name in after:
                    # One float16 ulp, as the scenario allows (bit-equal on CPU + gloo).
                    torch.testing.assert_close(after[name], expected.half(), rtol=9.8e-4, atol=1.6e-5, msg=name)
        else:
            assert optim.loss_scale == 65536 and skipped == (0 if strategy is ShardingStrategy.NO_SHARD else 1)
            assert all(torch.equal(after[name], before[name]) for name in before), "a parameter moved"
    backend.close()


# -- ZeRO-3 storage, unshard ------------------------------------------------------------------


@pytest.mark.world_size(2)
def test_zero3_stores_a_padded_flat_part_and_writes_reach_gathers_and_steps(rank, world_size, device):
    """param is an empty placeholder; the rank's part is ceil(25 / 2) = 13 elements (rank 1's
    last one is padding); a write through set_local_shard shows in the gathered weight and
    survives an optimizer step with lr 0 (the fp32 master copy was updated too)."""
    backend = adapter(rank, world_size, device)
    model = fixtures.build(Square5, 0, device)
    sharded = backend.shard(model, ShardingSpec(), ApiForm.WRAPPER)
    weight = dict(sharded.named_parameters())["_deepspeed_wrapped_module.0.weight"]
    assert weight.numel() == 0
    stored = backend.local_shard(sharded, "0.weight")
    assert stored.shape == (13,)
    optim = backend.make_optimizer(sharded, functools.partial(torch.optim.SGD, lr=0.0))
    backend.set_local_shard(sharded, "0.weight", torch.full((13,), float(rank + 2), device=device))
    expected = torch.cat([torch.full((13,), 2.0), torch.full((12,), 3.0)]).reshape(5, 5).to(device)
    assert torch.equal(backend.state_dict(sharded, StateDictKind.FULL)["0.weight"], expected)
    square_step(backend, sharded, optim, device)
    assert torch.equal(backend.state_dict(sharded, StateDictKind.FULL)["0.weight"], expected)
    grad = backend.local_grad_shard(sharded, "0.weight")
    assert grad is not None and grad.shape == (13,)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("writeback", [True, False], ids=["writeback", "no_writeback"])
def test_zero3_unshard_shows_full_parameters_and_honours_writeback(writeback, rank, world_size, device):
    backend = adapter(rank, world_size, device)
    model = fixtures.build(fixtures.CompositeModel, 0, device, dim=4)
    local = copy.deepcopy(model)
    sharded = backend.shard(model, ShardingSpec(manual_units=("unit1",)), ApiForm.WRAPPER)
    with backend.unshard(sharded, "unit1", writeback=writeback, recurse=False), torch.no_grad():
        shown = {backend.original_fqn(n): p for n, p in sharded.named_parameters() if p.numel()}
        assert sorted(shown) == sorted(f"unit1.{n}" for n, _ in fixtures.Unit(dim=4).named_parameters())
        for name, param in shown.items():
            assert torch.equal(param, local.get_parameter(name)), name
            param.zero_()
    state = backend.state_dict(sharded, StateDictKind.FULL)
    for name, value in state.items():
        changed = name.startswith("unit1.") and writeback
        assert torch.equal(value, torch.zeros_like(value) if changed else local.state_dict()[name]), name


# -- state dicts ----------------------------------------------------------------------------


@pytest.mark.world_size(2)
@pytest.mark.parametrize("strategy", list(STAGES), ids=lambda s: s.name)
def test_optimizer_state_round_trips_keyed_by_fqn(strategy, rank, world_size, device):
    """Full optimizer state, torch's layout keyed by FQN, reloads bit for bit into an engine
    that has stepped once (DeepSpeed creates the state at the first step)."""
    backend = adapter(rank, world_size, device)
    model, sharded, optim = trained(backend, strategy, 2, rank, device)
    saved = copy.deepcopy(backend.optim_state_dict(sharded, optim, StateDictKind.FULL))
    assert set(saved["state"]) == {n for n, _ in model.named_parameters()}
    assert saved["param_groups"][0]["lr"] == 1e-2
    entry = saved["state"]["unit1.inp.weight"]
    assert set(entry) == {"step", "exp_avg", "exp_avg_sq"} and entry["exp_avg"].shape == (8, 8)

    _, restored, restored_optim = trained(backend, strategy, 1, rank, device, seed=1)
    backend.load_state_dict(restored, backend.state_dict(sharded, StateDictKind.FULL), StateDictKind.FULL)
    backend.load_optim_state_dict(restored, restored_optim, copy.deepcopy(saved), StateDictKind.FULL)
    again = backend.optim_state_dict(restored, restored_optim, StateDictKind.FULL)
    for fqn, state in saved["state"].items():
        for key, value in state.items():
            assert torch.equal(again["state"][fqn][key], value), (fqn, key)
    train_steps(backend, sharded, model, optim, 1, rank, device, first_iteration=2)
    train_steps(backend, restored, model, restored_optim, 1, rank, device, first_iteration=2)
    after, expected = (backend.state_dict(m, StateDictKind.FULL) for m in (restored, sharded))
    for name, value in expected.items():
        torch.testing.assert_close(after[name], value, rtol=1e-6, atol=1e-6)


# -- DeepSpeed behaviours that expected failures will cite -------------------------------------


@pytest.mark.world_size(2)
@pytest.mark.parametrize(
    "strategy", [ShardingStrategy.SHARD_OPTIM_STATE, ShardingStrategy.FULL_SHARD], ids=lambda s: s.name
)
def test_deepspeed_cannot_load_optimizer_state_before_its_first_step(strategy, rank, world_size, device):
    """ZeRO creates its optimizer state lazily at the first step; safe_set_full_optimizer_state
    before that fails (ZeRO-3: KeyError 'exp_avg'; ZeRO-1/2: TypeError on the not yet linked
    fragment), on every rank at once."""
    backend = adapter(rank, world_size, device)
    _, sharded, optim = trained(backend, strategy, 1, rank, device)
    saved = backend.optim_state_dict(sharded, optim, StateDictKind.FULL)
    _, fresh, fresh_optim = trained(backend, strategy, 0, rank, device)
    expected = (
        (KeyError, "exp_avg")
        if strategy is ShardingStrategy.FULL_SHARD
        else (TypeError, "argument of type 'NoneType' is not iterable")
    )
    with pytest.raises(expected[0], match=expected[1]):
        backend.load_optim_state_dict(fresh, fresh_optim, saved, StateDictKind.FULL)


@pytest.mark.world_size(2)
def test_zero3_full_optimizer_state_load_fails_on_the_last_rank_for_uneven_sizes(rank, world_size, device):
    """ZeRO-3's set_full_hp_param slices the full value at partition_numel * rank without the
    padding: for 25 elements on 2 ranks rank 1 asks for [13, 26). The adapter makes every rank
    raise, not only the last one (the others would wait in the next collective)."""
    backend = adapter(rank, world_size, device)
    model = fixtures.build(Square5, 0, device)
    sharded = backend.shard(model, ShardingSpec(), ApiForm.WRAPPER)
    optim = backend.make_optimizer(sharded, ADAM)
    square_step(backend, sharded, optim, device)
    saved = backend.optim_state_dict(sharded, optim, StateDictKind.FULL)
    message = (
        re.escape("start (13) + length (13) exceeds dimension size (25)")
        if rank == world_size - 1
        else "1 other rank\\(s\\) failed here"
    )
    with pytest.raises(RuntimeError, match=message):
        backend.load_optim_state_dict(sharded, optim, saved, StateDictKind.FULL)


@pytest.mark.world_size(2)
def test_zero3_gather_inside_forward_raises_without_saying_unshard(rank, world_size, device):
    """GatheredParameters inside forward, on parameters the forward is using, fails when it
    tries to release them; the message does not say 'unshard' (the scenario contract's word)."""
    backend = adapter(rank, world_size, device)

    class CallsBack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(6))

        def forward(self, x):
            with backend.unshard(sharded, writeback=False):
                pass
            return (self.weight * x).sum()

    model = CallsBack().to(device)
    sharded = backend.shard(model, ShardingSpec(), ApiForm.WRAPPER)
    with pytest.raises(RuntimeError, match="Cannot free a ZeRO-3 parameter while it is still active") as error:
        sharded(torch.ones(6, device=device))
    assert "unshard" not in str(error.value).lower()


# -- end to end: the registry path, the rank fixture, labels in the trace ----------------------

SMOKE = """
import functools
import pytest
import torch
import fixtures
from conformance.protocol import ShardingSpec, StateDictKind

@pytest.mark.world_size(2)
def test_step(backend, rank, device):
    model = fixtures.build(fixtures.CompositeModel, 0, device, dim=8)
    sharded = backend.shard(model, ShardingSpec(), backend.forms()[0])
    optim = backend.make_optimizer(sharded, functools.partial(torch.optim.SGD, lr=0.1))
    inputs = fixtures.local_batch(model, seed=0, iteration=0, rank=rank, batch_size=2, device=device)
    backend.zero_grad(sharded, optim)
    backend.backward(sharded, model.loss(sharded(*inputs)))
    backend.step(sharded, optim)
    assert backend.state_dict(sharded, StateDictKind.FULL).keys() == model.state_dict().keys()
"""


def test_runs_from_the_command_line_twice_in_one_warm_pool(tmp_path):
    """--backend module:attr, two tests in the same ranks (the second only works if the first
    one's cached groups were released), ZeRO-3 gathers labelled with parameter FQNs."""
    (tmp_path / "test_second.py").write_text(SMOKE)
    result = run_inner_session(tmp_path, SMOKE, [TARGET], "test_second.py", "--show-traces", "-s")
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "2 passed" in output, output
    assert "1 pool starts" in output, output
    for table in traced_tables(result.stdout):
        assert "all_gather_into_tensor" in ops_labelled(table, "unit1.inp.weight"), table
