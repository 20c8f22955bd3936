"""The torch adapters' protocol surface beyond training: unshard, state dicts, introspection.

These pin what each adapter reports about its backend, so a scenario failure can be trusted to
be the backend's and not the adapter's.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

import fixtures
from conformance.adapters.torch_fsdp1 import TorchFSDP1Adapter
from conformance.adapters.torch_fsdp2 import TorchFSDP2Adapter
from conformance.protocol import (
    ApiForm,
    BackendAdapter,
    BackendEnv,
    ShardEvent,
    ShardingSpec,
    StateDictKind,
)

ADAPTERS = [TorchFSDP1Adapter, TorchFSDP2Adapter]
MANUAL = ShardingSpec(manual_units=("unit2",))


def make(adapter_cls: type[BackendAdapter], rank: int, world_size: int, device: torch.device):
    adapter = adapter_cls(BackendEnv(rank, world_size, device))
    model = fixtures.build(fixtures.CompositeModel, 0, device, dim=8)
    return adapter, model, adapter.shard(model, MANUAL, adapter.forms()[0])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("adapter_cls", ADAPTERS, ids=lambda c: c.name)
def test_unit_fqns_name_original_parameters(adapter_cls, rank, world_size, device) -> None:
    adapter, _model, sharded = make(adapter_cls, rank, world_size, device)
    units = adapter.unit_fqns(sharded)
    unit2 = [f"unit2.{n}" for n, _ in fixtures.Unit(dim=8).named_parameters()]
    everything = [n for n, _ in fixtures.CompositeModel(dim=8).named_parameters()]
    assert sorted(units) == ["", "unit2"]
    assert sorted(units["unit2"]) == sorted(unit2)
    assert sorted(units[""]) == sorted(set(everything) - set(unit2))


@pytest.mark.world_size(2)
@pytest.mark.parametrize("adapter_cls", ADAPTERS, ids=lambda c: c.name)
def test_events_and_storage_follow_forward_and_backward(adapter_cls, rank, world_size, device) -> None:
    adapter, model, sharded = make(adapter_cls, rank, world_size, device)
    assert not adapter.is_unsharded(sharded, "unit2")
    inputs = fixtures.local_batch(model, seed=0, iteration=0, rank=rank, batch_size=2, device=device)
    with adapter.record_events(sharded) as events:
        loss = model.loss(sharded(*inputs))
        forward_events = list(events)
        loss.backward()
    assert forward_events[:2] == [ShardEvent("unshard", ""), ShardEvent("unshard", "unit2")]
    assert ShardEvent("reshard", "unit2") in forward_events
    for unit in ("", "unit2"):
        kinds = [e.kind for e in events if e.unit == unit]
        assert kinds and kinds[0] == "unshard" and kinds[-1] == "reshard", (unit, events)
        assert all(a != b for a, b in itertools.pairwise(kinds)), f"{unit}: {kinds} do not alternate"
        assert not adapter.is_unsharded(sharded, unit)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("adapter_cls", ADAPTERS, ids=lambda c: c.name)
def test_unshard_exposes_full_parameters(adapter_cls, rank, world_size, device) -> None:
    adapter, _model, sharded = make(adapter_cls, rank, world_size, device)
    reference = fixtures.build(fixtures.CompositeModel, 0, device, dim=8)
    with adapter.unshard(sharded, writeback=False):
        seen = {adapter.original_fqn(n): p for n, p in sharded.named_parameters()}
        for name, expected in reference.named_parameters():
            torch.testing.assert_close(seen[name].detach(), expected.detach(), msg=name)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("adapter_cls", ADAPTERS, ids=lambda c: c.name)
def test_state_dicts_round_trip(adapter_cls, rank, world_size, device) -> None:
    adapter, _model, sharded = make(adapter_cls, rank, world_size, device)
    expected = fixtures.build(fixtures.CompositeModel, 0, device, dim=8).state_dict()
    full = adapter.state_dict(sharded, StateDictKind.FULL)
    assert full.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(full[name], value, msg=name)
    sharded_sd = adapter.state_dict(sharded, StateDictKind.SHARDED)
    assert sharded_sd.keys() == expected.keys()
    assert isinstance(sharded_sd["unit2.inp.weight"], (DTensor, ShardedTensor))

    other_model = fixtures.build(fixtures.CompositeModel, 1, device, dim=8)
    other = adapter.shard(other_model, MANUAL, adapter.forms()[0])
    adapter.load_state_dict(other, sharded_sd, StateDictKind.SHARDED)
    for name, value in adapter.state_dict(other, StateDictKind.FULL).items():
        torch.testing.assert_close(value, expected[name], msg=name)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("adapter_cls", ADAPTERS, ids=lambda c: c.name)
def test_optimizer_state_dict_keys_are_fqns(adapter_cls, rank, world_size, device) -> None:
    adapter, model, sharded = make(adapter_cls, rank, world_size, device)
    optim = torch.optim.Adam(sharded.parameters(), lr=1e-2)
    inputs = fixtures.local_batch(model, seed=0, iteration=0, rank=rank, batch_size=2, device=device)
    model.loss(sharded(*inputs)).backward()
    optim.step()
    state = adapter.optim_state_dict(sharded, optim, StateDictKind.FULL)
    names = {n for n, _ in fixtures.CompositeModel(dim=8).named_parameters()}
    assert set(state["state"]) == names
    adapter.load_optim_state_dict(sharded, optim, state, StateDictKind.FULL)


@pytest.mark.world_size(2)
def test_missing_features_skip_with_reason(rank, world_size, device) -> None:
    fsdp2 = TorchFSDP2Adapter(BackendEnv(rank, world_size, device))
    model = fixtures.build(fixtures.CompositeModel, 0, device, dim=8)
    with pytest.raises(pytest.skip.Exception, match="unsupported: wrapper form: fully_shard has no wrapper"):
        fsdp2.shard(model, MANUAL, ApiForm.WRAPPER)
    with (
        pytest.raises(pytest.skip.Exception, match="unsupported: unshard rank0_only=True"),
        fsdp2.unshard(model, writeback=False, rank0_only=True),
    ):
        pass
    fsdp1 = TorchFSDP1Adapter(BackendEnv(rank, world_size, device))
    assert fsdp1.forms() == [ApiForm.WRAPPER] and fsdp2.forms() == [ApiForm.COMPOSABLE]
    offload = ShardingSpec(offload_params=True)
    if device.type == "cpu":
        with pytest.raises(pytest.skip.Exception, match="unsupported: parameter CPU offload"):
            fsdp1.shard(model, offload, ApiForm.WRAPPER)
