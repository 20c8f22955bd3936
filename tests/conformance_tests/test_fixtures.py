"""The fixtures every parity scenario leans on: deterministic models and data, and the oracle."""

from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch

import fixtures
from fixtures.compare import (
    EXACT,
    Tolerance,
    assert_tensors_close,
    describe_difference,
    differences,
)

CPU = torch.device("cpu")
MODELS = [
    fixtures.CompositeModel,
    fixtures.TwoPathModel,
    fixtures.UnequalTwoPathModel,
    fixtures.NestedModel,
    fixtures.TiedTransformer,
    fixtures.ThreeLayerMLP,
    fixtures.UnevenMLP,
]


@pytest.mark.parametrize("model_cls", MODELS, ids=lambda c: c.__name__)
def test_build_depends_only_on_the_seed(model_cls) -> None:
    rng_before = torch.get_rng_state()
    first, second = fixtures.build(model_cls, 7, CPU), fixtures.build(model_cls, 7, CPU)
    other = fixtures.build(model_cls, 8, CPU)
    assert torch.equal(torch.get_rng_state(), rng_before), "build disturbed the global RNG"
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name
    assert any(not torch.equal(a, c) for a, c in zip(first.parameters(), other.parameters()))


def test_tied_transformer_shares_embedding_and_head() -> None:
    model = fixtures.build(fixtures.TiedTransformer, 0, CPU)
    assert model.head.weight is model.embed.weight


def test_two_path_model_freezes_the_unused_path() -> None:
    model = fixtures.TwoPathModel()
    flat_sizes = [sum(p.numel() for p in m.parameters()) for m in (model.path_a, model.path_b)]
    assert flat_sizes == [36, 36]
    assert all(p.requires_grad for p in model.path_a.parameters())
    assert not any(p.requires_grad for p in model.path_b.parameters())
    model.flip_path()
    assert not any(p.requires_grad for p in model.path_a.parameters())
    assert all(p.requires_grad for p in model.path_b.parameters())


def test_unequal_two_path_model_has_the_seeds_shapes() -> None:
    model = fixtures.UnequalTwoPathModel()
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters() if "path" in name}
    assert shapes == {"path_a.weight": (6, 6), "path_b.0.weight": (3, 6), "path_b.2.weight": (6, 3)}
    assert not any(p.requires_grad for p in model.path_b.parameters())
    assert model(torch.zeros(2, 5)).shape == (2, 6)
    model.flip_path()
    assert model(torch.zeros(2, 5)).shape == (2, 6)


@pytest.mark.parametrize("model_cls", MODELS, ids=lambda c: c.__name__)
def test_global_batch_is_the_rank_batches_in_order(model_cls) -> None:
    model = model_cls()
    kwargs = {"seed": 3, "iteration": 1, "batch_size": 2, "device": CPU}
    parts = [fixtures.local_batch(model, rank=r, **kwargs) for r in range(3)]
    whole = fixtures.global_batch(model, world_size=3, **kwargs)
    for position, tensor in enumerate(whole):
        expected = torch.cat([p[position] for p in parts], dim=model.BATCH_DIM)
        assert torch.equal(tensor, expected)
    assert not torch.equal(parts[0][0], parts[1][0]), "ranks must see different data"
    again = fixtures.local_batch(model, rank=0, **{**kwargs, "iteration": 2})
    assert not torch.equal(parts[0][0], again[0]), "iterations must see different data"


@pytest.mark.parametrize("extra_rows", [0, 1], ids=["even", "uneven"])
@pytest.mark.parametrize("model_cls", [fixtures.CompositeModel, fixtures.TiedTransformer], ids=lambda c: c.__name__)
def test_oracle_step_is_the_mean_of_rank_gradients(model_cls, extra_rows) -> None:
    """One SGD(lr=1) oracle step moves each parameter by minus the rank-averaged gradient, also
    where rank r feeds 2 + r samples (uneven: the average is still over ranks, not samples)."""
    world_size = 2
    model = fixtures.build(model_cls, 0, CPU)
    plan = fixtures.TrainingPlan(
        seed=5,
        iterations=1,
        batch_size=2,
        make_optimizer=functools.partial(torch.optim.SGD, lr=1.0),
        extra_rows_per_rank=extra_rows,
    )
    run = fixtures.train_oracle(model, plan, world_size=world_size, device=CPU)

    grads: dict[str, torch.Tensor] = {}
    rank_losses = []
    for rank in range(world_size):
        replica = copy.deepcopy(model)
        inputs = fixtures.local_batch(
            replica, seed=5, iteration=0, rank=rank, batch_size=2 + rank * extra_rows, device=CPU
        )
        loss = replica.loss(replica(*inputs))
        loss.backward()
        rank_losses.append(loss.item())
        for name, param in replica.named_parameters():
            grads[name] = grads.get(name, 0) + param.grad / world_size
    assert run.rank_losses[0] == pytest.approx(rank_losses, rel=1e-5)
    assert run.losses[0] == pytest.approx(sum(rank_losses) / world_size, rel=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(run.state_dict[name], param.detach() - grads[name], rtol=1e-4, atol=1e-5, msg=name)
        torch.testing.assert_close(run.grads[0][name], grads[name], rtol=1e-4, atol=1e-5, msg=name)
        assert torch.equal(run.params[0][name], run.state_dict[name]), name


def test_uneven_batch_sizes_are_checked() -> None:
    model = fixtures.CompositeModel(dim=4)
    parts = [fixtures.local_batch(model, seed=1, iteration=0, rank=r, batch_size=r + 1, device=CPU) for r in range(3)]
    (whole,) = fixtures.global_batch(model, seed=1, iteration=0, world_size=3, batch_size=[1, 2, 3], device=CPU)
    assert torch.equal(whole, torch.cat([p[0] for p in parts]))
    with pytest.raises(ValueError, match="2 batch sizes for 3 ranks; give one per rank"):
        fixtures.global_batch(model, seed=1, iteration=0, world_size=3, batch_size=[1, 2], device=CPU)
    with pytest.raises(ValueError, match="give 0 \\(even data\\) or more"):
        fixtures.TrainingPlan(
            seed=0, iterations=1, batch_size=2, make_optimizer=torch.optim.SGD, extra_rows_per_rank=-1
        )


def test_differences_name_each_tensor_and_its_size() -> None:
    expected = {"a": torch.zeros(3), "b": torch.ones(2, 2), "c": torch.ones(1)}
    actual = {"a": torch.tensor([0.0, 0.5, 0.0]), "b": torch.ones(2, 2), "d": torch.ones(1)}
    problems = differences(actual, expected, Tolerance(rtol=0.0, atol=1e-3))
    assert problems == [
        "c: missing",
        "d: unexpected",
        "a: max abs difference 0.5 at index (1,)",
    ]
    assert differences(expected, expected, EXACT) == []
    close = {"b": torch.ones(2, 2) * (1 + 1e-7)}
    assert differences(close, {"b": torch.ones(2, 2)}, Tolerance(rtol=1e-6, atol=0.0)) == []
    scaled = Tolerance(rtol=0.0, atol=0.0, scaled_atol=1e-3)
    big = {"g": torch.tensor([100.0, 0.0])}
    assert differences({"g": torch.tensor([100.0, 0.05])}, big, scaled) == []
    assert differences({"g": torch.tensor([100.0, 0.2])}, big, scaled) == ["g: max abs difference 0.2 at index (1,)"]
    assert describe_difference(torch.tensor([2.0]), torch.tensor([1.0])) == (
        "max abs difference 1 (relative 1) at index (0,)"
    )
    assert "dtype" not in describe_difference(torch.zeros(2), torch.zeros(3))
    with pytest.raises(AssertionError, match=r"what: 1 of 1 differ \(rtol 0, atol 0\):\n  a: max abs"):
        assert_tensors_close({"a": torch.ones(1)}, {"a": torch.zeros(1)}, EXACT, "what")


# -- gradient accumulation and mixed precision in the oracle ------------------------------------

FROZEN_SGD = functools.partial(torch.optim.SGD, lr=0.0)  # gradients without moving parameters


def _frozen_plan(**fields: object) -> fixtures.TrainingPlan:
    return fixtures.TrainingPlan(seed=5, batch_size=2, make_optimizer=FROZEN_SGD, **fields)


def test_oracle_accumulates_micro_batches_and_keeps_gradients_without_zero_grad() -> None:
    """A step's gradient is the sum over its micro-batches (data iterations step * k + i); without
    zero_grad each step's gradient is the sum over every backward pass so far."""
    model = fixtures.build(fixtures.CompositeModel, 0, CPU, dim=8)
    single = fixtures.train_oracle(model, _frozen_plan(iterations=4), world_size=2, device=CPU)
    accumulated = fixtures.train_oracle(model, _frozen_plan(iterations=2, micro_batches=2), world_size=2, device=CPU)
    kept = fixtures.train_oracle(model, _frozen_plan(iterations=3, zero_grad=False), world_size=2, device=CPU)
    assert accumulated.rank_losses == single.rank_losses, "micro-batches must feed data iterations in order"
    for name in single.grads[0]:
        for step in range(2):
            summed = single.grads[2 * step][name] + single.grads[2 * step + 1][name]
            torch.testing.assert_close(accumulated.grads[step][name], summed, msg=name)
        torch.testing.assert_close(kept.grads[2][name], sum(single.grads[i][name] for i in range(3)), msg=name)
    assert len(accumulated.losses) == 4 and len(accumulated.grads) == 2


def test_plan_refuses_a_step_without_backward() -> None:
    with pytest.raises(ValueError, match="micro_batches is 0"):
        _frozen_plan(iterations=1, micro_batches=0)


@pytest.mark.parametrize("reduce_dtype", [None, torch.float32], ids=["reduce_param_dtype", "reduce_fp32"])
def test_mixed_precision_oracle_runs_each_rank_in_low_precision(reduce_dtype: torch.dtype | None) -> None:
    """Each rank's gradient is computed in bfloat16 on its own batch, the average is taken in the
    reduction dtype (a bfloat16 sum rounds), and the float32 master takes the step."""
    model = fixtures.build(fixtures.CompositeModel, 0, CPU, dim=8)
    plan = fixtures.TrainingPlan(
        seed=5, iterations=1, batch_size=2, make_optimizer=functools.partial(torch.optim.SGD, lr=1.0)
    )
    precision = fixtures.Precision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    run = fixtures.train_oracle(model, plan, world_size=2, device=CPU, precision=precision)

    rank_grads, rank_losses = [], []
    for rank in range(2):
        replica = copy.deepcopy(model).to(torch.bfloat16)
        (inputs,) = fixtures.local_batch(replica, seed=5, iteration=0, rank=rank, batch_size=2, device=CPU)
        loss = replica.loss(replica(inputs.to(torch.bfloat16)))
        loss.backward()
        rank_losses.append(loss.item())
        rank_grads.append({name: p.grad for name, p in replica.named_parameters()})
    reduction = reduce_dtype or torch.bfloat16
    assert run.rank_losses[0] == rank_losses
    for name, param in model.named_parameters():
        average = ((rank_grads[0][name].to(reduction) + rank_grads[1][name].to(reduction)) / 2).float()
        assert run.grads[0][name].dtype == torch.float32
        assert torch.equal(run.grads[0][name], average), name
        assert torch.equal(run.state_dict[name], param.detach() - average), name


def test_mixed_precision_oracle_reduction_dtype_matters() -> None:
    """Summing rank gradients in bfloat16 rounds where float32 does not: the two runs differ."""
    model = fixtures.build(fixtures.CompositeModel, 0, CPU, dim=8)
    plan = fixtures.TrainingPlan(seed=5, iterations=1, batch_size=2, make_optimizer=FROZEN_SGD)
    runs = [
        fixtures.train_oracle(
            model, plan, world_size=2, device=CPU, precision=fixtures.Precision(torch.bfloat16, dtype)
        )
        for dtype in (None, torch.float32)
    ]
    assert any(not torch.equal(runs[0].grads[0][name], runs[1].grads[0][name]) for name in runs[0].grads[0])


class _RecordingLoop:
    """A TrainingLoop on plain torch that records what train_sharded calls, in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def make_optimizer(self, model, factory):
        self.calls.append("make_optimizer")
        return factory(model.parameters())

    def zero_grad(self, model, optimizer) -> None:
        self.calls.append("zero_grad")
        optimizer.zero_grad(set_to_none=True)

    def backward(self, model, loss) -> None:
        self.calls.append("backward")
        loss.backward()

    def step(self, model, optimizer) -> None:
        self.calls.append("step")
        optimizer.step()


@pytest.mark.parametrize("zero_grad", [True, False])
def test_train_sharded_runs_the_accumulation_program(zero_grad: bool) -> None:
    """Per step: zero_grad (unless told not to), the first k - 1 backward passes inside the
    accumulation context, the last outside it, then step; one loss per backward pass."""
    loop = _RecordingLoop()

    @contextlib.contextmanager
    def without_sync():
        loop.calls.append("enter")
        yield
        loop.calls.append("exit")

    model = fixtures.build(fixtures.CompositeModel, 0, CPU, dim=8)
    plan = _frozen_plan(iterations=2, micro_batches=3, zero_grad=zero_grad)
    losses = fixtures.train_sharded(loop, model, model, plan, rank=0, device=CPU, accumulate_without_sync=without_sync)
    step = ["enter", "backward", "exit", "enter", "backward", "exit", "backward", "step"]
    assert loop.calls == ["make_optimizer", *((["zero_grad"] if zero_grad else []) + step) * 2]
    assert len(losses) == 6
