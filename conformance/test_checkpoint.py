"""Checkpoint scenarios: state dicts of a sharded model match the unsharded model and reload.

Exactness: producing or loading a state dict gathers, slices and copies stored values without
arithmetic, so every comparison of state-dict values here is bit-exact (``torch.equal``).
Tolerances appear only where a forward pass or an optimizer step computes something; each one
says why.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fixtures
from conformance.protocol import (
    BackendAdapter,
    Capability,
    Holding,
    Phase,
    ShardingSpec,
    ShardingStrategy,
    ShardLayout,
    StateDictKind,
    declared_fqn,
    require,
    require_all,
    storage_claim,
)
from conformance.scenario_specs import lean_round_trip_world_sizes, spec_with_mesh, unit_plan_fields
from fixtures.compare import EXACT, Tolerance, describe_difference, differences
from harness import check, current_seed

# A forward through a sharded model against the same computation unsharded: same values, same
# input, but a kernel may block a matmul differently when a parameter is a view into a flat
# buffer, so the last few ulps may differ (torch's fp32 defaults: rtol 1.3e-6, atol 1e-5). A
# parameter left zeroed or loaded under the wrong name moves the output by O(1).
FORWARD_TOLERANCE = {"rtol": 1.3e-6, "atol": 1e-5}
# Two identically sharded models stepping from identical parameters, optimizer state and batch
# run the same program; only accelerator kernels that reorder sums may differ, and an ulp in a
# gradient moves an Adam update by ~1e-9 here. A lost or mis-keyed optimizer state changes the
# update by the order of lr = 1e-2.
STEP_TOLERANCE = Tolerance(rtol=1e-6, atol=1e-6)
LOCAL_BATCH = 2

# The strategies of the unit-less variants: all but HYBRID_SHARD, whose (replicate, shard) mesh
# the plans with units cover.
UNITLESS_STRATEGIES = [s for s in ShardingStrategy if s is not ShardingStrategy.HYBRID_SHARD]
param_offload_axis = pytest.mark.parametrize("param_offload", [False, True], ids=["no_param_offload", "param_offload"])


def _layout_spec(layout: str) -> ShardingSpec:
    """The seed's three ways of sharding the composite model."""
    if layout == "root":  # every Unit auto-wrapped, then the root
        return ShardingSpec(auto_wrap_classes=(fixtures.Unit,))
    if layout == "submodules":  # both units sharded, the root stays a plain module
        return ShardingSpec(manual_units=fixtures.CompositeModel.UNIT_FQNS, shard_root=False)
    if layout == "mixed":  # unit1 fully sharded inside a NO_SHARD root
        return ShardingSpec(manual_units=("unit1",), strategy_overrides={"": ShardingStrategy.NO_SHARD})
    raise ValueError(f"unknown layout {layout!r}: use root, submodules or mixed")


@pytest.mark.world_size(min=2, default=[2, 4])
@param_offload_axis
@pytest.mark.parametrize("layout", ["root", "submodules", "mixed"])
def test_full_state_dict(
    backend: BackendAdapter, layout: str, param_offload: bool, rank: int, device: torch.device
) -> None:
    """The full state dict equals the unsharded model's and reloads into a zeroed sharded model.

    Keys are the original FQNs, values equal bit for bit; after loading into a sharded copy
    whose parameters and buffers were zeroed, its full state dict is the original again and its
    forward matches the unsharded model's. ``param_offload``: the shards live on CPU, so saving
    gathers from and loading writes into the offloaded copies.
    """
    require(backend, Capability.FULL_STATE_DICT)
    spec = dataclasses.replace(_layout_spec(layout), offload_params=param_offload)
    require_all(backend, spec.feature_capabilities())
    _check_full_state_dict(backend, spec, f"{layout} layout, param_offload={param_offload}", rank, device)


@pytest.mark.world_size(min=2, default=2)
@pytest.mark.parametrize("strategy", UNITLESS_STRATEGIES, ids=lambda s: s.name)
def test_full_state_dict_unit_less(
    backend: BackendAdapter, strategy: ShardingStrategy, rank: int, device: torch.device
) -> None:
    """test_full_state_dict with the whole model as the only unit (no units below the root), for
    every strategy: what a backend without units (ZeRO-1/2, DDP) saves and loads."""
    require(backend, Capability.FULL_STATE_DICT)
    spec = ShardingSpec(strategy=strategy)
    require_all(backend, spec.feature_capabilities())
    _check_full_state_dict(backend, spec, f"{strategy.name}, unit-less", rank, device)


def _check_full_state_dict(
    backend: BackendAdapter, spec: ShardingSpec, label: str, rank: int, device: torch.device
) -> None:
    local = fixtures.build(fixtures.CompositeModel, current_seed(), device)
    _make_nonzero(local)
    expected = _detached(local.state_dict())
    inputs = fixtures.local_batch(
        local, seed=current_seed(), iteration=0, rank=rank, batch_size=LOCAL_BATCH, device=device
    )
    with torch.no_grad():
        expected_output = local(*inputs)

    for form in backend.forms():
        where = f"rank {rank}: {form.value}, {label}"
        saved = backend.shard(copy.deepcopy(local), spec, form)
        state = backend.state_dict(saved, StateDictKind.FULL)
        _assert_plain(state, where)
        _assert_same_state(state, expected, f"{where}: full state dict vs the unsharded model")

        target = backend.shard(copy.deepcopy(local), spec, form)
        _zero_local_storage(backend, target)
        _assert_all_zero(backend.state_dict(target, StateDictKind.FULL), where)
        backend.load_state_dict(target, copy.deepcopy(state), StateDictKind.FULL)
        _assert_model_parity(backend, target, saved, local, f"{where}: loaded model vs the model saved from", device)
        _assert_same_state(
            backend.state_dict(target, StateDictKind.FULL),
            expected,
            f"{where}: full state dict after loading into a zeroed sharded model",
        )
        with torch.no_grad():
            output = target(*inputs)
        torch.testing.assert_close(
            output,
            expected_output,
            **FORWARD_TOLERANCE,
            msg=lambda m, where=where: f"{where}: forward after loading differs from the unsharded model\n{m}",
        )


@pytest.mark.world_size(min=2, default=[2, 4])
@pytest.mark.parametrize("kind", list(StateDictKind), ids=lambda k: k.value)
@pytest.mark.parametrize(
    ("ignore", "param_offload"),
    [(False, False), (True, False), (False, True)],
    ids=["none-ignored", "ignored", "none-ignored-param_offload"],
)
def test_save_load_flow(
    backend: BackendAdapter,
    kind: StateDictKind,
    ignore: bool,
    param_offload: bool,
    rank: int,
    device: torch.device,
) -> None:
    """Save a trained tied-weight transformer, load it into a fresh sharded model, match.

    Encoder and decoder layers are auto-wrapped units under a sharded root. With ``ignored``,
    the whole ``transformer`` submodule is left unsharded: its parameters still appear in both
    kinds of state dict under their original FQNs, as plain full tensors, and round-trip like
    the rest. Before training, the (gathered) state dict equals the unsharded model's; after
    one SGD step, a model built from another seed, sharded alike, zeroed and loaded, holds the
    saved state bit for bit and computes the same forward. ``param_offload``: the same flow
    with CPU-offloaded shards (saved from and loaded into the offloaded copies).
    """
    require(backend, Capability.for_state_dict(kind))
    model_cls = fixtures.TiedTransformer
    ignored = model_cls.IGNORABLE_MODULES if ignore else ()
    spec = ShardingSpec(
        auto_wrap_classes=model_cls.LAYER_CLASSES,
        ignored_modules=ignored,
        offload_params=param_offload,
    )
    require_all(backend, spec.feature_capabilities())
    local = fixtures.build(model_cls, current_seed(), device)
    _make_nonzero(local)
    expected = _detached(local.state_dict())
    ignored_params = {name for name, _ in local.named_parameters() if _under(name, ignored)}
    batch = functools.partial(
        fixtures.local_batch,
        local,
        seed=current_seed(),
        rank=rank,
        batch_size=LOCAL_BATCH,
        device=device,
    )

    for form in backend.forms():
        where = (
            f"rank {rank}: {form.value}, {kind.value} state dict, ignored={list(ignored)}, "
            f"param_offload={param_offload}"
        )
        saved = backend.shard(copy.deepcopy(local), spec, form)
        optim = backend.make_optimizer(saved, functools.partial(torch.optim.SGD, lr=0.1))
        state = backend.state_dict(saved, kind)
        _assert_kind(state, kind, local, ignored_params, where)
        _assert_same_state(_gathered(state, device), expected, f"{where}: state dict vs the unsharded model")

        _train_step(backend, saved, optim, local, 0, rank, device)
        checkpoint = copy.deepcopy(backend.state_dict(saved, kind))

        target = backend.shard(fixtures.build(model_cls, current_seed() + 1, device), spec, form)
        _zero_local_storage(backend, target)
        _assert_stored_zero(backend.state_dict(target, kind), where, device)
        backend.load_state_dict(target, checkpoint, kind)
        _assert_model_parity(backend, target, saved, local, f"{where}: loaded model vs the trained model", device)
        _assert_stores_alike(
            backend.state_dict(target, kind),
            backend.state_dict(saved, kind),
            f"{where}: loaded model vs the trained model it was saved from",
            device,
        )
        inputs = batch(iteration=1)
        with torch.no_grad():
            output, expected_output = target(*inputs), saved(*inputs)
        torch.testing.assert_close(
            output,
            expected_output,
            **FORWARD_TOLERANCE,
            msg=lambda m, where=where: f"{where}: forward of the loaded model differs from the saved model\n{m}",
        )


@pytest.mark.world_size(min=2, default=[2, 4], exclude=lean_round_trip_world_sizes)
@pytest.mark.parametrize("strategy", list(ShardingStrategy), ids=lambda s: s.name)
@param_offload_axis
@pytest.mark.parametrize("kind", list(StateDictKind), ids=lambda k: k.value)
@pytest.mark.parametrize("wrap", ["auto", "none"])
def test_optim_state_dict_round_trip(
    backend: BackendAdapter,
    wrap: str,
    kind: StateDictKind,
    param_offload: bool,
    strategy: ShardingStrategy,
    world_size: int,
    rank: int,
    device: torch.device,
) -> None:
    """Optimizer state survives get -> load into a fresh model and optimizer -> get.

    The optimizer state dict is keyed by the original parameter FQNs; the one read back after
    loading equals the saved one bit for bit; one more Adam step on the original and on the
    restored pair gives the same parameters. ``param_offload``: shards and Adam's state on CPU.
    ``strategy``: optimizer state is what every strategy but NO_SHARD partitions, and the only
    thing SHARD_OPTIM_STATE (ZeRO-1) partitions, so each one round-trips its own layout.
    ``wrap``: every ``Unit`` auto-wrapped, or the whole model one unit (``none``: the plan of
    a backend without units; world size 2, parameters on the device).
    """
    require(backend, Capability.OPTIM_STATE_DICT)
    require(backend, Capability.for_state_dict(kind))
    spec = spec_with_mesh(  # everything required before a HYBRID_SHARD mesh is built
        backend,
        world_size,
        device,
        strategy=strategy,
        offload_params=param_offload,
        **unit_plan_fields(wrap),
    )
    label = f"{strategy.name}, {wrap} units, param_offload={param_offload}"
    _optim_round_trip(backend, spec, kind, label, rank, device)


@pytest.mark.world_size(min=2, default=2)
@pytest.mark.parametrize("strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD], ids=lambda s: s.name)
@pytest.mark.parametrize("kind", list(StateDictKind), ids=lambda k: k.value)
def test_optim_state_dict_round_trip_flat_params(
    backend: BackendAdapter,
    kind: StateDictKind,
    strategy: ShardingStrategy,
    rank: int,
    device: torch.device,
) -> None:
    """test_optim_state_dict_round_trip with flat parameters (``use_orig_params=False``): the
    optimizer holds one flat parameter per unit, so the state dict must be assembled per
    original FQN from flat state, and gathering it must leave the live optimizer able to step
    (the round trip steps the original pair after reading its state). A sharded and an
    unsharded strategy; a backend that supports optimizer state dicts only with flat parameters
    declares ``{OPTIM_STATE_DICT, SpecCondition.ORIGINAL_PARAMETERS}`` unsupported and is
    checked here."""
    require(backend, Capability.OPTIM_STATE_DICT)
    require(backend, Capability.for_state_dict(kind))
    spec = ShardingSpec(strategy=strategy, auto_wrap_classes=(fixtures.Unit,), use_orig_params=False)
    require_all(backend, spec.feature_capabilities())
    _optim_round_trip(backend, spec, kind, f"{strategy.name}, flat parameters", rank, device)


@pytest.mark.world_size(min=2, default=2)
@pytest.mark.parametrize(
    "strategy",
    [
        ShardingStrategy.FULL_SHARD,
        ShardingStrategy.SHARD_GRAD_OP,
        ShardingStrategy.SHARD_OPTIM_STATE,
        ShardingStrategy.SHARD_GRAD_AND_OPTIM_STATE,
    ],
    ids=lambda s: s.name,
)
def test_native_checkpoint_round_trip(
    backend: BackendAdapter, strategy: ShardingStrategy, rank: int, device: torch.device
) -> None:
    """The backend's own sharded checkpoint, opaque to the suite, checked by what it must do:
    two identical sharded models and optimizers train two steps; one saves, steps once more
    (parameters and optimizer state move on), loads. It then holds the other's parameters bit
    for bit (read through ``unshard``), and one more step on both gives the same parameters,
    so the optimizer state came back too. One directory, shared by the ranks. Units where the
    strategy shards parameters; the whole model one unit where it keeps them whole (ZeRO-1/2)."""
    require(backend, Capability.NATIVE_CHECKPOINT)
    require(backend, Capability.UNSHARD)
    shards_parameters = storage_claim(strategy).parameters[Phase.AT_REST] is Holding.SHARDED
    spec = ShardingSpec(strategy=strategy, auto_wrap_classes=(fixtures.Unit,) if shards_parameters else ())
    require_all(backend, spec.feature_capabilities())
    model_cls = fixtures.CompositeModel
    make_optim = functools.partial(torch.optim.Adam, lr=1e-2)
    for form in backend.forms():
        where = f"rank {rank}: {form.value}, {strategy.name}, native checkpoint"
        local = fixtures.build(model_cls, current_seed(), device, dim=16)
        saved = backend.shard(copy.deepcopy(local), spec, form)
        twin = backend.shard(copy.deepcopy(local), spec, form)
        saved_optim, twin_optim = backend.make_optimizer(saved, make_optim), backend.make_optimizer(twin, make_optim)
        for iteration in range(2):
            _train_step(backend, saved, saved_optim, local, iteration, rank, device)
            _train_step(backend, twin, twin_optim, local, iteration, rank, device)
        with _shared_directory() as directory:
            backend.save_checkpoint(saved, saved_optim, directory)
            _train_step(backend, saved, saved_optim, local, 7, rank, device)  # move on, then go back
            backend.load_checkpoint(saved, saved_optim, directory)
        _assert_same_state(_unsharded(backend, saved), _unsharded(backend, twin), f"{where}: parameters after loading")
        _train_step(backend, saved, saved_optim, local, 2, rank, device)
        _train_step(backend, twin, twin_optim, local, 2, rank, device)
        found = differences(_unsharded(backend, saved), _unsharded(backend, twin), STEP_TOLERANCE)
        with check("one step after loading the native checkpoint"):
            assert not found, f"{where}: one step after loading, parameters differ from the twin never saved: {found}"


@contextlib.contextmanager
def _shared_directory() -> Iterator[str]:
    """A fresh directory every rank of this host uses (rank 0 makes it and removes it)."""
    made = [tempfile.mkdtemp(prefix="conformance-checkpoint-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(made, src=0)
    try:
        yield str(made[0])
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(str(made[0]), ignore_errors=True)


def _unsharded(backend: BackendAdapter, model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value, by original FQN, read through a discarding unshard."""
    with backend.unshard(model, writeback=False):
        return {declared_fqn(backend, name): p.detach().clone() for name, p in model.named_parameters()}


def _optim_round_trip(
    backend: BackendAdapter, spec: ShardingSpec, kind: StateDictKind, case: str, rank: int, device: torch.device
) -> None:
    """Train two steps, save model and optimizer state, load both into a fresh pair, read the
    optimizer state back (equal), step both pairs once more (equal parameters)."""
    model_cls = fixtures.CompositeModel
    make_optim = functools.partial(torch.optim.Adam, lr=1e-2)

    for form in backend.forms():
        where = f"rank {rank}: {form.value}, {case}, {kind.value} optimizer state dict"
        loss_model = fixtures.build(model_cls, current_seed(), device, dim=16)
        param_fqns = {name for name, _ in loss_model.named_parameters()}
        trained = backend.shard(loss_model, spec, form)
        optim = backend.make_optimizer(trained, make_optim)
        for iteration in range(2):
            _train_step(backend, trained, optim, loss_model, iteration, rank, device)
        model_checkpoint = copy.deepcopy(backend.state_dict(trained, kind))
        optim_checkpoint = copy.deepcopy(backend.optim_state_dict(trained, optim, kind))
        keys = set(optim_checkpoint.get("state", {}))
        with check("optimizer state keyed by parameter FQNs"):
            assert keys == param_fqns, (
                f"{where}: optimizer state keyed by {sorted(keys)}, expected the parameter FQNs {sorted(param_fqns)}"
            )
        _assert_reading_kept_the_optimizer(backend, trained, optim, kind, optim_checkpoint, where, device)

        restored = backend.shard(fixtures.build(model_cls, current_seed() + 1, device, dim=16), spec, form)
        restored_optim = backend.make_optimizer(restored, make_optim)
        backend.load_state_dict(restored, model_checkpoint, kind)
        # A copy: optimizers may adopt the loaded tensors, and the checkpoint must stay intact.
        backend.load_optim_state_dict(restored, restored_optim, copy.deepcopy(optim_checkpoint), kind)
        _assert_stores_alike(
            backend.optim_state_dict(restored, restored_optim, kind),
            optim_checkpoint,
            f"{where}: optimizer state read back after loading",
            device,
        )

        _train_step(backend, trained, optim, loss_model, 2, rank, device)
        _train_step(backend, restored, restored_optim, loss_model, 2, rank, device)
        _assert_stores_alike(
            backend.state_dict(restored, kind),
            backend.state_dict(trained, kind),
            f"{where}: parameters after one more step, restored vs original model+optimizer",
            device,
            STEP_TOLERANCE,
        )


# -- helpers ------------------------------------------------------------------------------


def _assert_reading_kept_the_optimizer(
    backend: BackendAdapter,
    model: nn.Module,
    optim: Any,
    kind: StateDictKind,
    first_read: Any,
    where: str,
    device: torch.device,
) -> None:
    """``optim_state_dict`` must not modify the live optimizer: read again right after the
    first read (``first_read``, a copy), the state is the same bit for bit. A read that
    converts the state in place, resets it or changes a hyperparameter fails here, naming
    that contract, instead of later as a step that differs from the restored pair's (which
    its own read would have changed alike)."""
    _assert_stores_alike(
        backend.optim_state_dict(model, optim, kind),
        first_read,
        f"{where}: optim_state_dict must not modify the live optimizer: a second read differs from the first",
        device,
    )


def _train_step(
    backend: BackendAdapter,
    model: nn.Module,
    optim: Any,
    loss_model: nn.Module,
    iteration: int,
    rank: int,
    device: torch.device,
) -> None:
    """One step through the adapter's training-loop hooks (``optim`` from make_optimizer)."""
    inputs = fixtures.local_batch(
        loss_model,
        seed=current_seed(),
        iteration=iteration,
        rank=rank,
        batch_size=LOCAL_BATCH,
        device=device,
    )
    backend.zero_grad(model, optim)
    backend.backward(model, loss_model.loss(model(*inputs)))
    backend.step(model, optim)


def _make_nonzero(model: nn.Module) -> None:
    """Give all-zero tensors (fresh biases, counters) a value, so a load that skips them shows."""
    with torch.no_grad():
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            if torch.count_nonzero(tensor) == 0:
                tensor.add_(1)


def _zero_local_storage(backend: BackendAdapter, model: nn.Module) -> None:
    """Zero what each rank holds (its shards, replicated tensors, buffers); no collective.

    Parameters through the adapter's storage accessors (under ZeRO-3 ``param`` is an empty
    placeholder and the rank's part lives elsewhere); buffers are plain tensors of the module.
    """
    for name, _ in model.named_parameters():
        fqn = backend.original_fqn(name)
        backend.set_local_shard(model, fqn, torch.zeros_like(backend.local_shard(model, fqn)))
    with torch.no_grad():
        for buffer in model.buffers():
            buffer.zero_()


def _under(fqn: str, modules: tuple[str, ...]) -> bool:
    return any(fqn.startswith(f"{module}.") for module in modules)


def _detached(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in state.items()}


def _is_sharded(value: Any) -> bool:
    """A DTensor, or a ShardedTensor (which exposes ``local_shards``; torch FSDP1 uses it)."""
    return isinstance(value, DTensor) or hasattr(value, "local_shards")


def _gathered(state: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """Every sharded value replaced by the full tensor (a collective: same key order on all)."""
    return {name: _full(value, device) for name, value in state.items()}


def _full(value: Any, device: torch.device) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor()
    if hasattr(value, "local_shards"):
        # ShardedTensor: place this rank's shards into zeros, then sum over ranks. Shards are
        # disjoint, so each element is its owner's value plus exact zeros.
        dtype = value.metadata().tensor_properties.dtype
        full = torch.zeros(value.size(), dtype=dtype, device=device)
        for shard in value.local_shards():
            index = tuple(
                slice(offset, offset + size)
                for offset, size in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes)
            )
            full[index] = shard.tensor.to(device)
        dist.all_reduce(full)
        return full
    return value


@check("a full state dict holds no sharded value")
def _assert_plain(state: Mapping[str, Any], where: str) -> None:
    sharded = sorted(name for name, value in state.items() if _is_sharded(value))
    assert not sharded, f"{where}: full state dict holds sharded values for {sharded}"


@check("the state dict's kind")
def _assert_kind(
    state: Mapping[str, Any],
    kind: StateDictKind,
    local: nn.Module,
    ignored_params: set[str],
    where: str,
) -> None:
    """FULL: nothing sharded. SHARDED: managed parameters sharded, ignored ones plain and full."""
    if kind is StateDictKind.FULL:
        _assert_plain(state, where)
        return
    for name, param in local.named_parameters(remove_duplicate=False):
        value = state.get(name)
        if value is None:
            continue  # missing keys are reported by the key comparison
        if name in ignored_params:
            assert not _is_sharded(value) and value.shape == param.shape, (
                f"{where}: ignored parameter {name} should be a plain {tuple(param.shape)} "
                f"tensor, got {type(value).__name__} {tuple(value.shape)}"
            )
        else:
            assert _is_sharded(value), (
                f"{where}: sharded state dict holds {name} as {type(value).__name__}, not as a sharded tensor"
            )


@check("the same state")
def _assert_same_state(actual: Mapping[str, Any], expected: Mapping[str, torch.Tensor], where: str) -> None:
    missing = sorted(expected.keys() - actual.keys())
    extra = sorted(actual.keys() - expected.keys())
    assert not missing and not extra, f"{where}: keys missing {missing}, unexpected {extra}"
    for name, want in expected.items():
        got = actual[name]
        assert got.shape == want.shape and got.dtype == want.dtype, (
            f"{where}: {name} is {got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}"
        )
        assert torch.equal(got.detach().cpu(), want.detach().cpu()), (
            f"{where}: {name}: {describe_difference(got, want)}"
        )


@check("zeroing took effect")
def _assert_all_zero(state: Mapping[str, torch.Tensor], where: str) -> None:
    """The zeroing took effect everywhere, so a later match proves the load wrote every value."""
    nonzero = sorted(name for name, value in state.items() if torch.count_nonzero(value))
    assert not nonzero, f"{where}: still nonzero after zeroing every rank's storage: {nonzero}"


def _stored(value: Any) -> torch.Tensor:
    """What this rank stores of a state-dict value: a DTensor's local tensor, a ShardedTensor's
    local shards (flattened, in order), or the plain tensor itself."""
    if isinstance(value, DTensor):
        return value.to_local()
    if hasattr(value, "local_shards"):
        shards = [shard.tensor.reshape(-1) for shard in value.local_shards()]
        dtype = value.metadata().tensor_properties.dtype
        return torch.cat(shards) if shards else torch.empty(0, dtype=dtype)
    return value


def _leaves(tree: Any, path: str = "") -> dict[str, Any]:
    """Every leaf of nested dicts/lists by its path ("state / unit1.inp.weight / exp_avg")."""
    if isinstance(tree, Mapping):
        items = [(str(key), tree[key]) for key in sorted(tree, key=str)]
    elif isinstance(tree, (list, tuple)):
        items = [(str(index), item) for index, item in enumerate(tree)]
    else:
        return {path: tree}
    leaves: dict[str, Any] = {}
    for key, item in items:
        leaves.update(_leaves(item, f"{path} / {key}" if path else key))
    return leaves


@check("no rank found a difference")
def _fail_together(problems: list[str], where: str, device: torch.device) -> None:
    """Assert on every rank at once that no rank found a problem (one all-reduce), so a rank
    that found none does not run on into collectives its failed peer never issues."""
    found = torch.tensor([len(problems)], device=device)
    dist.all_reduce(found)
    here = "\n  ".join(problems) if problems else "none on this rank (see the other ranks)"
    assert found.item() == 0, f"{where}: {found.item()} differences over all ranks; here:\n  {here}"


def _assert_stores_alike(
    actual: Any,
    expected: Any,
    where: str,
    device: torch.device,
    tolerance: Tolerance = EXACT,
) -> None:
    """Two state dicts (or optimizer state dicts) of the same kind and layout hold the same
    values: every rank compares what it stores of each value, so no value is gathered, and a
    value stored differently (another shape or layout) counts as a difference."""
    got, want = _leaves(actual), _leaves(expected)
    problems = [f"missing {key}" for key in sorted(want.keys() - got.keys())]
    problems += [f"unexpected {key}" for key in sorted(got.keys() - want.keys())]
    tensors_got, tensors_want = {}, {}
    for key in sorted(want.keys() & got.keys()):
        if isinstance(want[key], torch.Tensor):
            if not isinstance(got[key], torch.Tensor):
                problems.append(f"{key}: {got[key]!r} is not a tensor")
                continue
            tensors_got[key], tensors_want[key] = _stored(got[key]), _stored(want[key])
        elif got[key] != want[key]:
            problems.append(f"{key}: {got[key]!r} differs from {want[key]!r}")
    problems += differences(tensors_got, tensors_want, tolerance)
    _fail_together(problems, where, device)


def _assert_model_parity(
    backend: BackendAdapter,
    loaded: nn.Module,
    saved: nn.Module,
    unsharded: nn.Module,
    where: str,
    device: torch.device,
) -> None:
    """The seed's model parity: both models list the same raw parameter names in the same
    order, and each rank stores bit-equal values of every parameter (``local_shard``, padding
    left out: its content is unspecified; no gather, so a shard loaded off by one ulp, or put
    into another rank's place, shows). ``unsharded`` gives each parameter's size."""
    names = [name for name, _ in loaded.named_parameters()]
    wanted = [name for name, _ in saved.named_parameters()]
    problems = [] if names == wanted else [f"parameters are named {names}, the saved model's {wanted}"]
    if not problems:
        numels = {name: p.numel() for name, p in unsharded.named_parameters()}
        got, want = {}, {}
        for fqn in (backend.original_fqn(name) for name in names):
            got[fqn] = _real_part(backend, backend.local_shard(loaded, fqn), numels[fqn])
            want[fqn] = _real_part(backend, backend.local_shard(saved, fqn), numels[fqn])
        problems += differences(got, want, EXACT)
    _fail_together(problems, where, device)


def _real_part(backend: BackendAdapter, stored: torch.Tensor, numel: int) -> torch.Tensor:
    """What a rank stores of a parameter of ``numel`` elements, without padding: only a
    PER_PARAMETER layout pads an original parameter's part (at the end of the flat whole), and
    a whole parameter (a replicated or ignored one) has none."""
    if type(backend).SHARD_LAYOUT is not ShardLayout.PER_PARAMETER or stored.numel() == numel:
        return stored
    chunk, rank = stored.numel(), dist.get_rank()
    return stored.reshape(-1)[: max(0, min(chunk, numel - rank * chunk))]


def _assert_stored_zero(state: Mapping[str, Any], where: str, device: torch.device) -> None:
    """Every rank's stored part of every value is zero (the zeroing took effect everywhere)."""
    nonzero = sorted(name for name, value in state.items() if torch.count_nonzero(_stored(value)))
    _fail_together([f"{name} is not zero" for name in nonzero], where, device)
