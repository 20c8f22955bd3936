"""Property tests of the collective core, run inside every rank.

Hypothesis is derandomized so all ranks draw the same examples in the same order (their
collectives must match); values are generated from a per-example seed so every rank can also
compute every other rank's data for the expected result.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine import ShardingStrategy
from engine.unit import ShardedUnit

SETTINGS = settings(derandomize=True, max_examples=15, deadline=None, database=None)
shapes = st.lists(
    st.lists(st.integers(min_value=1, max_value=7), min_size=0, max_size=3).map(tuple),
    min_size=1,
    max_size=5,
)
dtypes = st.sampled_from([torch.float32, torch.float64])


def examples(check: Callable[..., None]) -> Callable[[], None]:
    """`check(shape_list, dtype, seed)` as a property over the derandomized examples (the same on
    every rank, in the same order: their collectives match)."""
    return SETTINGS(given(shape_list=shapes, dtype=dtypes, seed=st.integers(0, 2**16))(check))


def module_with(params: list[torch.Tensor]) -> nn.Module:
    module = nn.Module()
    for index, value in enumerate(params):
        module.register_parameter(f"p{index}", nn.Parameter(value.clone()))
    return module


def values(shape_list, dtype, seed: int, device) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator, dtype=dtype).to(device) for shape in shape_list]


def flat_grads(shape_list, dtype, seed: int, world_size: int) -> list[torch.Tensor]:
    """Per-rank flat gradients (unpadded), identical on every rank."""
    numel = sum(math.prod(s) for s in shape_list)
    generator = torch.Generator().manual_seed(seed + 1)
    return [torch.randn(numel, generator=generator, dtype=dtype) for _ in range(world_size)]


def inject_and_reduce(unit, grads: list[torch.Tensor], rank: int, device) -> None:
    padded = torch.zeros(unit.layout.padded_numel, dtype=grads[0].dtype, device=device)
    padded[: grads[rank].numel()] = grads[rank].to(device)
    unit.flat_leaf.grad = padded
    unit.reduce_grad()


def reduce_and_expect(
    unit: ShardedUnit,
    shape_list: list[tuple[int, ...]],
    dtype: torch.dtype,
    seed: int,
    rank: int,
    world_size: int,
    device: torch.device,
) -> torch.Tensor:
    """Reduce every rank's flat gradient through `unit`; return what this rank's chunk must then
    hold: its slice of the ranks' mean, zeros over the padding (computed on the CPU)."""
    grads = flat_grads(shape_list, dtype, seed, world_size)
    inject_and_reduce(unit, grads, rank, device)
    mean = torch.stack(grads).mean(0)
    expected = torch.zeros(unit.layout.chunk, dtype=dtype)
    start, valid = unit.layout.chunk_start, unit.layout.valid_in_chunk
    expected[:valid] = mean[start : start + valid]
    return expected


@pytest.mark.world_size([1, 2, 4])
def test_shard_then_all_gather_is_identity(rank, world_size, device):
    @examples
    def check(shape_list, dtype, seed):
        originals = values(shape_list, dtype, seed, device)
        model = engine.fully_shard(module_with(originals))
        unit = engine.units(model)[0]
        numel = sum(t.numel() for t in originals)
        assert unit.layout.chunk == -(-numel // world_size)
        assert unit.layout.padded_numel % world_size == 0
        assert sum(p.numel() for p in model.parameters()) == unit.layout.valid_in_chunk
        with engine.unshard_params(model, writeback=False):
            for original, (_, shown) in zip(originals, model.named_parameters()):
                assert shown.shape == original.shape
                torch.testing.assert_close(shown, original, rtol=0, atol=0)
            if unit.layout.padded_numel > numel:
                assert unit._full[numel:].abs().sum().item() == 0

    check()


@pytest.mark.world_size([1, 2, 4])
def test_reduce_scatter_is_mean_of_rank_gradients_chunked(rank, world_size, device):
    @examples
    def check(shape_list, dtype, seed):
        model = engine.fully_shard(module_with(values(shape_list, dtype, seed, device)))
        unit = engine.units(model)[0]
        expected_chunk = reduce_and_expect(unit, shape_list, dtype, seed, rank, world_size, device)
        for info, param in zip(unit.layout.params, unit.optimizer_params):
            expected = unit.layout.sharded_view(expected_chunk, info)
            torch.testing.assert_close(param.grad.cpu(), expected, rtol=1e-6, atol=1e-6)

    check()


@pytest.mark.world_size([1, 2, 4])
def test_flat_gradient_is_this_ranks_chunk_of_the_mean_with_zero_padding(rank, world_size, device):
    @examples
    def check(shape_list, dtype, seed):
        model = engine.fully_shard(module_with(values(shape_list, dtype, seed, device)), use_orig_params=False)
        unit = engine.units(model)[0]
        (flat,) = model.parameters()
        assert flat is unit.flat_param and flat.shape == (unit.layout.chunk,)
        expected = reduce_and_expect(unit, shape_list, dtype, seed, rank, world_size, device)
        torch.testing.assert_close(flat.grad.cpu(), expected, rtol=1e-6, atol=1e-6)

    check()


@pytest.mark.world_size([2, 4])
def test_hybrid_shard_equals_full_shard_over_the_world(rank, world_size, device):
    @settings(derandomize=True, max_examples=8, deadline=None, database=None)
    @given(
        shape_list=shapes,
        seed=st.integers(0, 2**16),
        shard_group_size=st.sampled_from([d for d in (1, 2, 4) if world_size % d == 0]),
    )
    def check(shape_list, seed, shard_group_size):
        results = []
        for options in (
            {"strategy": ShardingStrategy.FULL_SHARD},
            {"strategy": ShardingStrategy.HYBRID_SHARD, "shard_group_size": shard_group_size},
        ):
            model = engine.fully_shard(module_with(values(shape_list, torch.float64, seed, device)), **options)
            unit = engine.units(model)[0]
            inject_and_reduce(unit, flat_grads(shape_list, torch.float64, seed, world_size), rank, device)
            with engine.unshard_params(model, with_grads=True, writeback=False):
                results.append([p.grad.clone() for p in model.parameters()])
        for full, hybrid in zip(*results):
            torch.testing.assert_close(hybrid, full, rtol=1e-12, atol=1e-12)

    check()
