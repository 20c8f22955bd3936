"""2-D: tensor-parallel DTensor parameters sharded over the "dp" mesh dimension."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import engine


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(5, 8)
        self.net2 = nn.Linear(8, 4)
        self.net3 = nn.Linear(4, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.net3(F.relu(self.net2(F.relu(self.net1(x))))))


def two_d(local: nn.Module, device: torch.device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(copy.deepcopy(local), mesh["tp"], {"net1": ColwiseParallel(), "net2": RowwiseParallel()})
    return engine.fully_shard(model, mesh=mesh["dp"]), mesh


@pytest.mark.world_size(4)
def test_2d_training_matches_single_process(rank, device):
    torch.manual_seed(0)
    local = Small().to(device)
    model, mesh = two_d(local, device)
    dp_rank = mesh.get_local_rank("dp")
    local_optim = torch.optim.Adam(local.parameters(), lr=1e-2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(5)
    for _ in range(5):
        batch = torch.randn(2, 4, 5, generator=generator).to(device)
        local_optim.zero_grad()
        (local(batch.view(-1, 5)).sum() / 2).backward()
        local_optim.step()
        optim.zero_grad()
        model(batch[dp_rank]).sum().backward()
        optim.step()
    with engine.unshard_params(model):
        for (name, expected), (got_name, got) in zip(local.named_parameters(), model.named_parameters()):
            assert name == got_name
            got = got.full_tensor() if hasattr(got, "full_tensor") else got
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.world_size(4)
def test_2d_full_state_dict_round_trip(device):
    torch.manual_seed(0)
    local = Small().to(device)
    model, _ = two_d(local, device)
    state = model.state_dict()
    assert set(state) == set(local.state_dict())
    for key, value in local.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=key)
    fresh, _ = two_d(Small().to(device), device)
    fresh.load_state_dict(state)
    with engine.unshard_params(fresh):
        for (name, got), (_, expected) in zip(fresh.named_parameters(), local.named_parameters()):
            got = got.full_tensor() if hasattr(got, "full_tensor") else got
            torch.testing.assert_close(got, expected, msg=name)


@pytest.mark.world_size(4)
def test_2d_sharded_state_dict_is_dp_shard_over_tp(device):
    from torch.distributed.tensor import DTensor, Shard

    torch.manual_seed(0)
    local = Small().to(device)
    model, mesh = two_d(local, device)
    engine.set_state_dict_type(model, engine.StateDictKind.SHARDED)
    state = model.state_dict()
    weight = state["net1.weight"]
    assert isinstance(weight, DTensor) and weight.device_mesh.mesh_dim_names == ("dp", "tp")
    assert state["net2.weight"].placements[1] == Shard(1)
    for key, value in local.state_dict().items():
        torch.testing.assert_close(state[key].full_tensor(), value, msg=key)
    fresh, _ = two_d(Small().to(device), device)
    engine.set_state_dict_type(fresh, engine.StateDictKind.SHARDED)
    fresh.load_state_dict(state)
    with engine.unshard_params(fresh):
        for (name, got), (_, expected) in zip(fresh.named_parameters(), local.named_parameters()):
            got = got.full_tensor() if hasattr(got, "full_tensor") else got
            torch.testing.assert_close(got, expected, msg=name)
