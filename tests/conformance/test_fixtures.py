"""The fixtures every parity scenario leans on: deterministic models and data, and the oracle."""

from __future__ import annotations

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


@pytest.mark.parametrize("model_cls", [fixtures.CompositeModel, fixtures.TiedTransformer], ids=lambda c: c.__name__)
def test_oracle_step_is_the_mean_of_rank_gradients(model_cls) -> None:
    """One SGD(lr=1) oracle step moves each parameter by minus the rank-averaged gradient."""
    world_size = 2
    model = fixtures.build(model_cls, 0, CPU)
    plan = fixtures.TrainingPlan(
        seed=5,
        iterations=1,
        batch_size=2,
        make_optimizer=functools.partial(torch.optim.SGD, lr=1.0),
    )
    run = fixtures.train_oracle(model, plan, world_size=world_size, device=CPU)

    grads: dict[str, torch.Tensor] = {}
    rank_losses = []
    for rank in range(world_size):
        replica = copy.deepcopy(model)
        inputs = fixtures.local_batch(replica, seed=5, iteration=0, rank=rank, batch_size=2, device=CPU)
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
