"""Every capability the adapter declares missing is missing from zero2_lib, shown on the library.

"Unsupported" is a claim: each gap the adapter declares skips scenarios, so each is backed here by
a proof that calls the library itself (never the adapter) and shows the feature absent, refused or
impossible. The meta-test fails when the adapter declares a gap without a proof, or keeps a proof
of a gap it closed. The same holds for the backend facts it declares (none today).

Run with the repository's other tests (``python -m pytest``); the proofs are distributed tests,
run by the suite's harness plugin, which the installed suite registers.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from zero2_backend import lib
from zero2_backend.adapter import Zero2Adapter

from conformance.protocol import AbsenceProofs, Capability, FactProofs

BACKEND = Zero2Adapter.name
PROOFS = AbsenceProofs()
FACTS = FactProofs()
proves = PROOFS.proves


def _model(device: torch.device, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)  # wrap() broadcasts rank 0's values anyway
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)).to(device=device, dtype=dtype)


def _trained(device: torch.device, stage: int = 2) -> tuple[nn.Sequential, lib.Zero2, torch.optim.Optimizer]:
    """A model wrapped at ``stage``, after one backward and one Adam step."""
    model = lib.wrap(_model(device), stage=stage)
    engine = lib.engine_of(model)
    optimizer = engine.build_optimizer(lambda params: torch.optim.Adam(params, lr=0.1))
    model(torch.ones(3, 4, device=device)).sum().backward()
    engine.reduce_gradients()
    engine.step(optimizer)
    return model, engine, optimizer


def _options(function: Callable[..., object]) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name != "self"]


def _equal_on_every_rank(tensor: torch.Tensor) -> bool:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor.contiguous())
    return all(torch.equal(gathered[0], other) for other in gathered)


@proves(BACKEND, Capability.WRAPPER)
def _wrap_shards_in_place(rank: int, world_size: int, device: torch.device) -> None:
    model = _model(device)
    assert lib.wrap(model) is model and type(model) is nn.Sequential


@proves(
    BACKEND,
    Capability.UNITS,
    Capability.AUTO_WRAP,
    Capability.UNMANAGED_ROOT,
    Capability.MIXED_STRATEGIES,
    Capability.UNSHARD_NON_RECURSIVE,
    Capability.INTROSPECT_UNIT_FQNS,
)
def _one_partition_for_the_whole_model(rank: int, world_size: int, device: torch.device) -> None:
    # No way to name a unit, a policy, or a part of the model to gather...
    assert _options(lib.wrap) == ["module", "group", "stage"]
    assert _options(lib.Zero2.full_params) == ["writeback"]
    with pytest.raises(TypeError, match="auto_wrap_policy"):
        lib.wrap(_model(device), auto_wrap_policy=lambda module: True)  # type: ignore[call-arg]
    # ...and one flat space over every parameter, in order, each rank owning one contiguous part
    # of it that runs across parameter boundaries.
    model = lib.wrap(_model(device))
    engine = lib.engine_of(model)
    assert [slot.fqn for slot in engine.slots] == [name for name, _ in model.named_parameters()]
    owned = [
        (slot.offset + slot.owned_start, slot.offset + slot.owned_stop) for slot in engine.slots if slot.owned_numel
    ]
    assert owned[0][0] == engine.partition_start, owned
    assert all(stop == start for (_, stop), (start, _) in itertools.pairwise(owned)), owned
    assert sum(stop - start for start, stop in owned) == min(
        engine.partition_numel, engine.numel - engine.partition_start
    )


@proves(BACKEND, Capability.FULL_SHARD, Capability.SHARD_GRAD_OP, Capability.HYBRID_SHARD, Capability.SHARD_OPTIM_STATE)
def _stage_two_or_nothing(rank: int, world_size: int, device: torch.device) -> None:
    for stage in (1, 3):  # ZeRO-1 (SHARD_OPTIM_STATE) and ZeRO-3 (FULL_SHARD) do not exist
        with pytest.raises(ValueError, match=f"stage {stage} does not exist"):
            lib.wrap(_model(device), stage=stage)
    model, engine, _ = _trained(device)
    full = _model(device)
    for (name, param), (_, whole) in zip(model.named_parameters(), full.named_parameters(), strict=True):
        # Parameters stay whole on every rank after a step (not FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD)...
        assert param.shape == whole.shape and _equal_on_every_rank(param.detach()), name
        # ...and the gradient kept is the owned part only (not SHARD_OPTIM_STATE's whole gradient).
        assert param.grad is None, name
    assert engine.grad_partition.numel() == engine.partition_numel < engine.numel
    # One group to shard over; no second (replica) dimension.
    assert "group" in _options(lib.wrap) and not {"mesh", "device_mesh", "replicate_group"} & set(_options(lib.wrap))


@proves(BACKEND, Capability.MIXED_PRECISION, Capability.REDUCE_DTYPE)
def _float32_master_and_reduction(rank: int, world_size: int, device: torch.device) -> None:
    assert not {"mixed_precision", "param_dtype", "reduce_dtype", "dtype"} & set(_options(lib.wrap))
    # A low-precision model computes in its own dtype (there is no second, compute dtype); the
    # master copies and the gradient reduction are float32 whatever the model's dtype.
    model = lib.wrap(_model(device, torch.bfloat16))
    engine = lib.engine_of(model)
    model(torch.ones(3, 4, device=device, dtype=torch.bfloat16)).sum().backward()
    engine.reduce_gradients()
    assert engine.master.dtype == torch.float32 and engine.grad_partition.dtype == torch.float32
    assert all(param.dtype == torch.bfloat16 for param in model.parameters())


@proves(BACKEND, Capability.CPU_OFFLOAD)
def _master_stays_on_the_model_device(rank: int, world_size: int, device: torch.device) -> None:
    assert not {"offload", "cpu_offload", "offload_device"} & set(_options(lib.wrap))
    _, engine, optimizer = _trained(device)
    assert engine.master.device.type == device.type
    assert all(
        value.device.type == device.type
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim()
    )


@proves(BACKEND, Capability.IGNORED_MODULES)
def _every_parameter_is_managed(rank: int, world_size: int, device: torch.device) -> None:
    with pytest.raises(TypeError, match="ignored_modules"):
        lib.wrap(_model(device), ignored_modules=[])  # type: ignore[call-arg]
    model = _model(device)
    model[2].requires_grad_(False)  # even a frozen one
    engine = lib.engine_of(lib.wrap(model))
    assert {slot.fqn for slot in engine.slots} == {name for name, _ in model.named_parameters()}


@proves(BACKEND, Capability.PARAMETER_GROUPS)
def _optimizer_state_dict_has_no_group_membership(rank: int, world_size: int, device: torch.device) -> None:
    model = lib.wrap(_model(device))
    engine = lib.engine_of(model)

    def two_groups(pieces: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD([{"params": pieces[:1]}, {"params": pieces[1:], "lr": 0.5}], lr=0.1)

    optimizer = engine.build_optimizer(two_groups)
    groups = engine.full_optimizer_state_dict(optimizer)["param_groups"]
    names = [name for name, _ in model.named_parameters()]
    # Two groups with their own options, and each names every parameter: membership is lost.
    assert [group["lr"] for group in groups] == [0.1, 0.5]
    assert all(sorted(group["params"]) == sorted(names) for group in groups)


@proves(BACKEND, Capability.FLAT_PARAMETERS)
def _original_parameters_are_kept(rank: int, world_size: int, device: torch.device) -> None:
    model = _model(device)
    before = [(name, param, param.shape) for name, param in model.named_parameters()]
    after = list(lib.wrap(model).named_parameters())
    assert [(name, id(param), param.shape) for name, param in after] == [(n, id(p), s) for n, p, s in before]
    assert not any("flat" in name for name, _ in after)


@proves(BACKEND, Capability.UNSHARD_RANK0_ONLY, Capability.UNSHARD_OFFLOAD_TO_CPU, Capability.UNSHARD_WITH_GRADS)
def _full_params_has_only_writeback(rank: int, world_size: int, device: torch.device) -> None:
    model, engine, _ = _trained(device)
    for option in ("rank0_only", "offload_to_cpu", "with_grads"):
        with pytest.raises(TypeError, match=option), engine.full_params(**{option: True}):
            pass
    # The reduced gradient is kept as this rank's part only: inside full_params there is no
    # whole gradient to show.
    model(torch.ones(3, 4, device=device)).sum().backward()
    engine.reduce_gradients()
    with engine.full_params():
        assert all(param.grad is None for param in model.parameters())


@proves(BACKEND, Capability.SHARDED_STATE_DICT)
def _state_dicts_are_whole(rank: int, world_size: int, device: torch.device) -> None:
    model, engine, optimizer = _trained(device)
    assert all(type(value) is torch.Tensor for value in model.state_dict().values())
    assert sorted(name for name in dir(lib.Zero2) if "state_dict" in name) == [
        "full_optimizer_state_dict",
        "load_full_optimizer_state_dict",
        "load_model_state_dict",
    ]
    whole = engine.full_optimizer_state_dict(optimizer)
    for name, param in model.named_parameters():
        assert whole["state"][name]["exp_avg"].numel() == param.numel(), name


@proves(BACKEND, Capability.EXEC_ORDER_CHECK)
def _forward_order_is_not_checked(rank: int, world_size: int, device: torch.device) -> None:
    torch.manual_seed(0)
    model = lib.wrap(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).to(device))
    engine = lib.engine_of(model)
    layers = list(model) if rank == 0 else list(reversed(model))  # a different order on each rank
    out = torch.ones(2, 4, device=device)
    for layer in layers:
        out = layer(out)
    out.sum().backward()
    engine.reduce_gradients()  # raises nothing, on any rank: nothing recorded the order


@proves(BACKEND, Capability.TENSOR_PARALLEL)
def _dtensor_parameters_are_refused(rank: int, world_size: int, device: torch.device) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(device.type, (world_size,))
    model = nn.Linear(4, 4).to(device)
    model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))
    with pytest.raises(Exception) as refused:
        lib.wrap(model)
    print(f"zero2_lib.wrap on a DTensor parameter: {type(refused.value).__name__}: {refused.value}")


@proves(BACKEND, Capability.INTROSPECT_UNSHARDED, Capability.INTROSPECT_EVENTS, Capability.INTROSPECT_STORAGE)
def _parameters_are_never_sharded(rank: int, world_size: int, device: torch.device) -> None:
    model = lib.wrap(_model(device))
    engine = lib.engine_of(model)
    stored = [(param.data_ptr(), param.numel()) for param in model.parameters()]
    optimizer = engine.build_optimizer(lambda params: torch.optim.SGD(params, lr=0.1))
    model(torch.ones(3, 4, device=device)).sum().backward()
    engine.reduce_gradients()
    engine.step(optimizer)
    # The same storage, whole, throughout: nothing was gathered or freed, so there is no
    # unsharded state, event or storage to report; and no hook runs around a forward.
    assert [(param.data_ptr(), param.numel()) for param in model.parameters()] == stored
    assert not any(module._forward_pre_hooks or module._forward_hooks for module in model.modules())


@proves(BACKEND, Capability.NATIVE_CHECKPOINT)
def _no_checkpoint_format(rank: int, world_size: int, device: torch.device) -> None:
    names = [*dir(lib), *dir(lib.Zero2)]
    assert not [name for name in names if "save" in name.lower() or "checkpoint" in name.lower()], names


@proves(BACKEND, Capability.GRADIENT_CLIPPING)
def _no_clipping(rank: int, world_size: int, device: torch.device) -> None:
    names = [*dir(lib), *dir(lib.Zero2)]
    assert not [name for name in names if "clip" in name.lower() or "norm" in name.lower()], names


# -- the tests -----------------------------------------------------------------------------------


def test_every_declared_absence_has_a_proof() -> None:
    assert PROOFS.unproven(BACKEND, Zero2Adapter) == set(), "declared unsupported without a proof"
    assert PROOFS.stale(BACKEND, Zero2Adapter) == set(), "proofs of gaps no longer declared: delete them"


def test_every_declared_fact_has_a_proof() -> None:
    assert FACTS.unproven(BACKEND, Zero2Adapter) == set()
    assert FACTS.stale(BACKEND, Zero2Adapter) == set()


def _each_proof_once() -> list:
    """One test per proof (a proof backs several capabilities), named after what it proves."""
    proving: dict[Callable[..., None], list[str]] = {}
    for backend, capability in PROOFS.at(2):
        proving.setdefault(PROOFS.proofs[backend, capability], []).append(capability.name)
    return [pytest.param(proof, id="+".join(names)) for proof, names in proving.items()]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("proof", _each_proof_once())
def test_declared_absence_is_real(
    proof: Callable[[int, int, torch.device], None], rank: int, world_size: int, device: torch.device
) -> None:
    proof(rank, world_size, device)
