"""Bad input gets a clear error that names the fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import engine
from engine import ShardingStrategy


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


@pytest.mark.world_size(2)
def test_auto_wrap_matching_nothing(device):
    with pytest.raises(ValueError, match=r"matched no submodule.*omit auto_wrap_classes"):
        engine.fully_shard(mlp().to(device), auto_wrap_classes={nn.TransformerEncoderLayer})


@pytest.mark.world_size(2)
def test_parameters_on_mixed_devices(device):
    model = mlp().to(device)
    model[2].to("meta")
    with pytest.raises(ValueError, match=r"mixed devices.*module\.to\(device\)"):
        engine.fully_shard(model)


@pytest.mark.world_size(2)
def test_hybrid_world_size_that_does_not_fit(device):
    with pytest.raises(ValueError, match=r"cannot split world size 2 into shard groups of 3.*divides"):
        engine.fully_shard(mlp().to(device), strategy=ShardingStrategy.HYBRID_SHARD, shard_group_size=3)


@pytest.mark.world_size(2)
def test_hybrid_needs_a_2d_mesh(device):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (2,))
    with pytest.raises(ValueError, match=r"2-D.*init_device_mesh"):
        engine.fully_shard(mlp().to(device), strategy=ShardingStrategy.HYBRID_SHARD, mesh=mesh)


@pytest.mark.world_size(2)
def test_applying_twice(device):
    model = engine.fully_shard(mlp().to(device))
    with pytest.raises(ValueError, match="already sharded; apply the engine once"):
        engine.fully_shard(model)
    with pytest.raises(ValueError, match="already sharded"):
        engine.ShardedModule(model)


@pytest.mark.world_size(2)
def test_applying_to_a_submodule_after_its_ancestor(device):
    model = engine.fully_shard(mlp().to(device))
    with pytest.raises(ValueError, match="apply the engine to submodules first, then to their ancestors"):
        engine.fully_shard(model[0])


@pytest.mark.world_size(2)
def test_ignoring_a_module_outside_the_model(device):
    with pytest.raises(ValueError, match=r"not a submodule.*pass only submodules"):
        engine.fully_shard(mlp().to(device), ignored_modules=[nn.Linear(1, 1)])


@pytest.mark.world_size(2)
def test_parameter_shared_across_units(device):
    model = mlp().to(device)
    model[2].weight = nn.Parameter(torch.randn(4, 4, device=device))
    model.add_module("tied", nn.Linear(4, 4, bias=False, device=device))
    model.tied.weight = model[0].weight
    engine.fully_shard(model[0])
    with pytest.raises(ValueError, match="shared with an already-sharded submodule; shard a common ancestor"):
        engine.fully_shard(model)


@pytest.mark.world_size(2)
def test_mixed_parameter_dtypes_in_one_unit(device):
    model = mlp().to(device)
    model[2].double()
    with pytest.raises(ValueError, match=r"one parameter dtype.*mixed_precision"):
        engine.fully_shard(model)
