"""`unshard_params` semantics: writeback, padding, reshard behaviour, recurse, grads, errors."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn as nn

import engine
from engine import MixedPrecision, ShardingStrategy

FP16 = MixedPrecision(param_dtype=torch.float16)


def nested(device, **options) -> engine.ShardedModule:
    model = nn.Sequential(nn.Linear(5, 5, bias=False, device=device), nn.Linear(5, 3, bias=False, device=device))
    model[0] = engine.ShardedModule(model[0], **options)
    return engine.ShardedModule(model, **options)


@pytest.mark.world_size([1, 2])
@pytest.mark.parametrize("strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD], ids=lambda s: s.name)
@pytest.mark.parametrize("offload", [False, True], ids=["gpu_params", "offload"])
@pytest.mark.parametrize("mixed", [None, FP16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("use_orig_params", [True, False], ids=["orig_params", "flat_params"])
def test_writeback(rank, world_size, device, strategy, offload, mixed, use_orig_params):
    for writeback, check_outer in itertools.product([True, False], [True, False]):
        model = nested(
            device, strategy=strategy, offload_params=offload, mixed_precision=mixed, use_orig_params=use_orig_params
        )
        outer, inner = engine.units(model)
        param = (outer if check_outer else inner).optimizer_params[0]
        with torch.no_grad():
            param.fill_(rank + 2)
        with engine.unshard_params(model, writeback=writeback), torch.no_grad():
            for shown in model.parameters():
                shown.zero_()
        sharded = strategy is not ShardingStrategy.NO_SHARD and world_size > 1
        expected = 0 if writeback or (not sharded and not offload) else rank + 2
        if param.numel():
            assert param.reshape(-1)[0].item() == expected
        if offload:
            assert all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.world_size(2)
def test_writes_to_padding_do_not_persist(rank, device):
    model = engine.ShardedModule(nn.Linear(1, 1, bias=False, device=device))
    unit = engine.units(model)[0]
    assert unit.layout.padded_numel == 2 and unit.layout.numel == 1
    with torch.no_grad():
        unit.shard.fill_(rank + 2)
    with engine.unshard_params(model, writeback=True), torch.no_grad():
        unit._full.zero_()  # the whole padded buffer, padding included
    assert unit.shard[0].item() == (0 if rank == 0 else rank + 2)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("mixed", [None, FP16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rank0_only", [False, True])
@pytest.mark.parametrize("offload_to_cpu", [False, True])
def test_respects_reshard_between_forward_and_backward(device, mixed, rank0_only, offload_to_cpu):
    model = nested(device, mixed_precision=mixed)
    outer, inner = engine.units(model)
    output = model(torch.zeros(5, device=device))
    assert (outer.unsharded_storage_numel, inner.unsharded_storage_numel) == (outer.layout.padded_numel, 0)
    output.sum().backward()
    assert (outer.unsharded_storage_numel, inner.unsharded_storage_numel) == (0, 0)
    output = model(torch.zeros(5, device=device))
    with engine.unshard_params(model, rank0_only=rank0_only, writeback=not rank0_only, offload_to_cpu=offload_to_cpu):
        pass
    expected_outer = 0 if mixed is not None else outer.layout.padded_numel
    assert (outer.unsharded_storage_numel, inner.unsharded_storage_numel) == (expected_outer, 0)
    output.sum().backward()
    assert (outer.unsharded_storage_numel, inner.unsharded_storage_numel) == (0, 0)
    events = engine.events(model)
    assert events[:4] == [("unshard", ""), ("unshard", "0"), ("reshard", "0"), ("unshard", "0")]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("recurse", [False, True])
@pytest.mark.parametrize("unshard_outer", [False, True])
def test_recurse(device, recurse, unshard_outer):
    model = nested(device)
    outer, inner = engine.units(model)
    with engine.unshard_params(model if unshard_outer else model[0], recurse=recurse):
        assert outer.is_unsharded == unshard_outer
        assert inner.is_unsharded == (recurse or not unshard_outer)
        if unshard_outer:
            assert model[1].weight.shape == (3, 5)
    assert not outer.is_unsharded and not inner.is_unsharded


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 4)
        self.blocks = nn.Sequential(nn.Sequential(nn.Linear(4, 16), nn.ReLU()), nn.Sequential(nn.Linear(16, 4)))
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.inp(x)) * self.scale


@pytest.mark.world_size(2)
@pytest.mark.parametrize("offload_to_cpu", [False, True])
@pytest.mark.parametrize("rank0_only", [False, True])
def test_named_parameters_show_original_names_shapes_values(rank, device, offload_to_cpu, rank0_only):
    torch.manual_seed(0)
    local = Tower().to(device)
    model = engine.fully_shard(copy.deepcopy(local), auto_wrap_classes={nn.Sequential})
    with engine.unshard_params(model, rank0_only=rank0_only, writeback=False, offload_to_cpu=offload_to_cpu):
        if rank0_only and rank != 0:
            assert all(p.dim() == 1 for p in model.parameters())
            return
        for (name, expected), (got_name, got) in itertools.zip_longest(
            local.named_parameters(), model.named_parameters()
        ):
            assert name == got_name and isinstance(got, nn.Parameter)
            assert got.device.type == ("cpu" if offload_to_cpu else device.type)
            torch.testing.assert_close(got.to(device), expected)
        assert [n for n, _ in model.named_buffers()] == ["scale"]
    assert engine.unit_fqns(model)[1] == ("blocks", ())


@pytest.mark.world_size(2)
@pytest.mark.parametrize(
    "strategy",
    [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD],
    ids=lambda s: s.name,
)
@pytest.mark.parametrize("writeback", [False, True])
def test_with_grads_shows_reduced_full_gradients(rank, world_size, device, strategy, writeback):
    torch.manual_seed(0)
    local = Tower().to(device)
    model = engine.fully_shard(copy.deepcopy(local), strategy=strategy, auto_wrap_classes={nn.Sequential})
    batch = torch.randn(world_size, 3, 8, generator=torch.Generator().manual_seed(7)).to(device)
    (local(batch.view(-1, 8)).sum() / world_size).backward()
    model(batch[rank]).sum().backward()
    with engine.unshard_params(model, with_grads=True, writeback=writeback):
        for (name, expected), (_, got) in zip(local.named_parameters(), model.named_parameters()):
            torch.testing.assert_close(got.grad, expected.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD], ids=lambda s: s.name)
def test_with_grads_none_when_no_rank_has_grads(device, strategy):
    model = engine.fully_shard(Tower().to(device), strategy=strategy, auto_wrap_classes={nn.Sequential})
    with engine.unshard_params(model, with_grads=True):
        assert all(p.grad is None for p in model.parameters())


@pytest.mark.world_size(2)
def test_unshard_submodule_shows_its_parameters(device):
    model = nn.Sequential(
        nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)), nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    ).to(device)
    model = engine.ShardedModule(model, auto_wrap_classes={nn.Sequential})
    with engine.unshard_params(model[0]):
        shapes = [p.shape for p in model[0].parameters()]
        assert shapes == [(16, 16), (16,), (16, 16), (16,)]


class CallsUnshard(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(5))

    def forward(self, sharded: nn.Module) -> None:
        with engine.unshard_params(sharded):
            pass


@pytest.mark.world_size(2)
def test_unshard_from_forward_raises(device):
    model = engine.ShardedModule(CallsUnshard().to(device))
    with pytest.raises(RuntimeError, match="Cannot manually unshard parameters during forward/backward"):
        model(model)
    with engine.unshard_params(model):  # the failed forward left nothing behind
        pass


@pytest.mark.world_size(2)
def test_unshard_from_backward_raises(device):
    model = engine.ShardedModule(nn.Linear(2, 1, device=device))
    output = model(torch.ones(2, device=device))

    def unshard_in_backward(grad: torch.Tensor) -> None:
        with engine.unshard_params(model):
            pass

    output.register_hook(unshard_in_backward)
    with pytest.raises(RuntimeError, match="Cannot manually unshard parameters during forward/backward"):
        output.backward()
    with engine.unshard_params(model):  # the failed backward left nothing behind
        assert model.weight.shape == (1, 2)


@pytest.mark.world_size(2)
def test_rank0_only_with_writeback_raises(device):
    model = nested(device)
    with (
        pytest.raises(NotImplementedError, match=r"is not supported.*writeback=False"),
        engine.unshard_params(model, rank0_only=True, writeback=True),
    ):
        pass


@pytest.mark.world_size(2)
def test_offload_to_cpu_with_no_shard_raises(device):
    model = nested(device, strategy=ShardingStrategy.NO_SHARD)
    with (
        pytest.raises(NotImplementedError, match=r"is not supported.*offload_to_cpu=False"),
        engine.unshard_params(model, offload_to_cpu=True),
    ):
        pass
