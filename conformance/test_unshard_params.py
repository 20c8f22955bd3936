"""Unshard-params scenarios: the ``unshard()`` context and every option it takes.

Contract checked here (backend-neutral; see docs/scenarios.md):

* Inside ``unshard()`` the unit's parameters are plain, full-shape tensors with the original
  names, equal to an unsharded copy of the model (float32; under mixed precision in the dtype
  the adapter declares, see below).
* ``writeback=True`` keeps in-place changes made inside; ``writeback=False`` discards them when
  the unit is sharded. A unit that is *not* sharded (one rank) and keeps its parameters on the
  device shows its stored parameters directly, so changes persist regardless of ``writeback``
  (documented torch FSDP1 behaviour, kept as the contract).
* Padding a backend adds to make shards even never shows up in, or leaks into, real values.
* Unsharding outside forward/backward does not change what the strategy keeps gathered between
  forward and backward. Under mixed precision the adapter declares what it does
  (``MIXED_PRECISION_UNSHARD``): parameters inside the context are float32 or in the compute
  dtype (``shows_compute_dtype``), and an unshard between forward and backward keeps the root
  unsharded or reshards it (``root_stays_unsharded``); each is checked as declared.
* Names: outside the context a unit with original parameters shows them under their original
  FQNs, one with flat parameters (``use_orig_params=False``) shows ``<unit FQN>._flat_param``
  (compared after removing only the adapter's declared ``WRAPPER_COMPONENTS``); inside, the
  sharded root lists exactly the unsharded model's names, raw, with only the adapter's declared
  ``UNSHARDED_NAME_PREFIX`` inserted (the seeds': none).
* Storage, exactly as the adapter's declared ``SHARD_LAYOUT`` gives it
  (``conformance.protocol.ShardLayout``): what each rank stores (``local_shard``) of a flat
  parameter (ceil(N / world size) elements for a unit of N, under any layout: a flat parameter
  is one flat buffer) or of a sharded original parameter (no rank shows the full tensor), and,
  where the adapter reports it (``INTROSPECT_STORAGE``), the elements a unit's unsharded storage
  holds: the padded size while unsharded, 0 once freed (the seed's ``numel * world_size`` /
  ``0``). Scenarios write into a rank's part only through ``set_local_shard`` (under DeepSpeed
  ZeRO-3 the parameter itself is an empty placeholder).
* Refusals: unsharding during forward or backward, ``rank0_only`` with ``writeback``, and
  ``offload_to_cpu`` with ``NO_SHARD`` each raise what the adapter declares in ``REFUSALS``
  (exception types and a message pattern; ``conformance.protocol.Misuse``), checked exactly. A
  backend that declares none is held to the seeds' (``SEED_REFUSALS``: ``AssertionError``
  "Cannot manually unshard parameters during forward/backward"; ``NotImplementedError`` "is not
  supported"), which the torch adapters declare.

This module holds the scenarios of values, names, storage and options; ``test_unshard_with_grads``
those with gradients, ``test_unshard_refusals`` a unit below the root and the refusals; what they
share is ``conformance.scenario_unshard``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fixtures
from conformance.protocol import (
    ApiForm,
    BackendAdapter,
    Capability,
    ShardingSpec,
    declared_fqn,
    expected_local_numel,
    expected_unsharded_numel,
    flat_param_fqn,
    mixed_precision_dtype,
    require,
    submodule,
    unsharded_name,
)
from conformance.scenario_unshard import (
    EXACT,
    Singleton,
    TwoLayer,
    fill_stored,
    flag_ids,
    full_values,
    mixed_precision_axis,
    named_params,
    offload_to_cpu_axis,
    orig_params_axis,
    param_offload_axis,
    rank0_only_axis,
    read_only_writeback,
    require_unshard,
    sharded_models,
    shown_dtype,
    shows_full,
    unit_param_names,
    writeback_axis,
)
from harness import check, current_seed


@pytest.mark.world_size(min=1, default=[1, 2])
@orig_params_axis
@param_offload_axis
@mixed_precision_axis
@pytest.mark.parametrize("unit", ["outer", "inner"])
@writeback_axis
def test_unshard_writeback(
    backend: BackendAdapter,
    writeback: bool,
    unit: str,
    mixed_precision: bool,
    param_offload: bool,
    use_orig_params: bool,
    rank: int,
    world_size: int,
    device: torch.device,
) -> None:
    """Zeroing every parameter inside the context persists iff the contract says so.

    Each rank first writes ``rank + 2`` into its stored part of one unit (root = outer, ``0`` =
    inner). After a context that zeroes everything, that part reads 0 with ``writeback`` or
    when the unit is not sharded and not offloaded (ws1), else still ``rank + 2``; a second,
    discarding unshard shows the full values agree (the other unit keeps its initial values
    when changes are discarded).
    """
    require_unshard(backend, writeback=writeback)
    spec = ShardingSpec(
        manual_units=("0",),
        param_dtype=mixed_precision_dtype(backend) if mixed_precision else None,
        offload_params=param_offload,
        use_orig_params=use_orig_params,
    )
    initial = dict(fixtures.build(TwoLayer, current_seed(), device).named_parameters())
    names = ("0.weight", "1.weight")
    checked_name, other_name = names if unit == "inner" else reversed(names)
    changes_persist = writeback or (world_size == 1 and not param_offload)
    for form, sharded in sharded_models(backend, TwoLayer, spec, device):
        written = unit_param_names(backend, sharded, inner=unit == "inner")
        for name in written:
            fill_stored(backend, sharded, name, rank + 2)
        with backend.unshard(sharded, writeback=writeback), torch.no_grad():
            for param in sharded.parameters():
                param.zero_()

        # A rank may store nothing of the unit (more ranks than a parameter has rows, or a
        # backend that places whole parameters on some ranks): it has nothing to check, but
        # some rank must store the unit.
        stored = [part for part in (backend.local_shard(sharded, name).reshape(-1) for name in written) if part.numel()]
        holders = torch.tensor([int(bool(stored))], device=device)
        dist.all_reduce(holders)
        assert holders.item() > 0, f"{form.value}: no rank stores anything of the {unit} unit"
        expected = 0.0 if changes_persist else float(rank + 2)
        if stored:
            with check("the stored value after the context"):
                assert stored[0][0].item() == expected, (
                    f"{form.value}: rank {rank}: stored {unit} value is {stored[0][0].item()} after "
                    f"the context, expected {expected} (writeback={writeback}, world size {world_size})"
                )
        if param_offload:
            devices = {p.device.type for p in sharded.parameters()}
            with check("offloaded parameters stay on the CPU"):
                assert devices == {"cpu"}, f"{form.value}: offloaded parameters live on {devices}"

        full = full_values(backend, sharded)
        dtypes = {name: value.dtype for name, value in full.items()}
        shown = shown_dtype(backend, spec.param_dtype)
        with check("the dtype the context shows"):
            assert set(dtypes.values()) == {shown}, (
                f"{form.value}: the context shows {dtypes}; full parameters must be in {shown} "
                f"(the original float32, or the compute dtype where MIXED_PRECISION_UNSHARD declares it)"
            )
        if changes_persist:
            for name, value in full.items():
                with check("zeros written inside persist"):
                    assert not value.any(), f"{form.value}: {name} lost the zeros written inside"
        else:
            values = set(full[checked_name].unique().tolist())
            with check("values outside the context unchanged"):
                assert values <= {float(r + 2) for r in range(world_size)}, (
                    f"{form.value}: full {checked_name} holds {sorted(values)}, not only the values "
                    "ranks wrote before the context"
                )
            torch.testing.assert_close(
                full[other_name],
                initial[other_name].to(full[other_name].device, shown),
                **EXACT,
                msg=lambda m: f"{form.value}: {other_name} kept changes made inside\n{m}",
            )


def _check_param_data(
    backend: BackendAdapter,
    rank0_only: bool,
    offload_to_cpu: bool,
    param_offload: bool,
    mixed_precision: bool,
    use_orig_params: bool,
    rank: int,
    world_size: int,
    device: torch.device,
) -> None:
    """Full parameters of a plain root over several sharded roots match an unsharded copy."""
    writeback = read_only_writeback(backend, rank0_only)
    require_unshard(backend, writeback=writeback, rank0_only=rank0_only, offload_to_cpu=offload_to_cpu)
    if rank0_only:
        require(backend, Capability.INTROSPECT_UNSHARDED)
    spec = ShardingSpec(
        manual_units=fixtures.NestedModel.UNIT_FQNS,
        shard_root=False,
        param_dtype=mixed_precision_dtype(backend) if mixed_precision else None,
        offload_params=param_offload,
        use_orig_params=use_orig_params,
    )
    local = fixtures.build(fixtures.NestedModel, current_seed(), device)
    for form, sharded in sharded_models(backend, fixtures.NestedModel, spec, device):
        outside = _shown_sizes(sharded)
        with backend.unshard(sharded, rank0_only=rank0_only, writeback=writeback, offload_to_cpu=offload_to_cpu):
            if rank0_only and rank != 0:
                _check_still_sharded(backend, sharded, outside, spec, form, rank, world_size)
            else:
                _check_param_data_inside(backend, sharded, local, spec, form, offload_to_cpu, device)
        _check_several_roots(backend, sharded, local, form, rank, world_size, device)


def _shown_sizes(sharded: nn.Module) -> dict[str, tuple[type, torch.Size]]:
    """What each parameter the model lists looks like from outside: its type and shape."""
    return {name: (type(param), param.shape) for name, param in sharded.named_parameters()}


def _nested_model_units() -> dict[str, list[str]]:
    """NestedModel sharded with its UNIT_FQNS: unit -> the parameters it manages (in
    registration order), each parameter going to the innermost unit that contains it."""
    units = fixtures.NestedModel.UNIT_FQNS
    managed: dict[str, list[str]] = {unit: [] for unit in units}
    for name, _ in fixtures.NestedModel().named_parameters():
        owners = [unit for unit in units if name.startswith(f"{unit}.")]
        if owners:
            managed[max(owners, key=len)].append(name)
    return managed


def _check_still_sharded(
    backend: BackendAdapter,
    sharded: nn.Module,
    outside: dict[str, tuple[type, torch.Size]],
    spec: ShardingSpec,
    form: ApiForm,
    rank: int,
    world_size: int,
) -> None:
    """Inside a ``rank0_only`` context, on a rank other than 0: every unit stays as it was
    outside, sharded (the seed: each flat parameter keeps its sharded size).

    The rank lists the parameters it listed outside, each of the same type and shape; no
    unit holds unsharded storage (``is_unsharded``; with ``INTROSPECT_STORAGE``, 0 elements of
    it); what the rank stores of each managed parameter is exactly what the declared
    ``SHARD_LAYOUT`` gives it (with flat parameters, ceil(N / world size) elements of each
    unit's ``_flat_param``), and an original parameter the rank stores only part of does not
    show its full shape. No collective: rank 0 is inside the context on its own.
    """
    shown = _shown_sizes(sharded)
    assert shown == outside, (
        f"{form.value}: rank {rank} lists {shown} inside a rank0_only context, "
        f"{outside} outside: ranks other than 0 must keep showing their shards"
    )
    params = named_params(backend, sharded)
    shapes = {name: p.shape for name, p in fixtures.NestedModel().named_parameters()}
    layout = type(backend).SHARD_LAYOUT
    for unit, names in _nested_model_units().items():
        assert not backend.is_unsharded(sharded, unit), (
            f"{form.value}: rank {rank} holds unit {unit} unsharded under rank0_only"
        )
        if backend.supports(Capability.INTROSPECT_STORAGE):
            held = backend.unsharded_storage_numel(sharded, unit)
            assert held == 0, (
                f"{form.value}: rank {rank} holds {held} elements of unit {unit}'s unsharded "
                "storage under rank0_only, expected 0"
            )
        unit_shapes = [shapes[name] for name in names]
        if not spec.use_orig_params:
            flat = flat_param_fqn(backend, unit)
            numel = sum(shape.numel() for shape in unit_shapes)
            stored = backend.local_shard(sharded, flat).numel()
            assert stored == -(-numel // world_size), (
                f"{form.value}: rank {rank} stores {stored} elements of {flat} inside a rank0_only "
                f"context; a unit of {numel} elements sharded {world_size} ways stores "
                f"ceil({numel}/{world_size}) = {-(-numel // world_size)}"
            )
            continue
        for index, name in enumerate(names):
            stored = backend.local_shard(sharded, name).numel()
            wanted = expected_local_numel(layout, unit_shapes, index, rank, world_size)
            assert stored == wanted, (
                f"{form.value}: rank {rank} stores {stored} elements of {name} "
                f"{tuple(shapes[name])} inside a rank0_only context; {layout.name} "
                f"({layout.value}) gives {wanted}"
            )
            # A flat unit's range may hold a small parameter whole: only a part must not look full.
            if wanted < shapes[name].numel():
                assert not shows_full(params[name], shapes[name]), (
                    f"{form.value}: rank {rank} shows {name} full ({type(params[name]).__name__} "
                    f"{tuple(params[name].shape)}) inside a rank0_only context, storing {stored} "
                    f"of its {shapes[name].numel()} elements"
                )


def _check_several_roots(
    backend: BackendAdapter,
    sharded: nn.Module,
    local: nn.Module,
    form: ApiForm,
    rank: int,
    world_size: int,
    device: torch.device,
) -> None:
    """The seed's root count, read from the backend once lazy initialisation is done.

    The plain root is no unit (``unit_fqns``, where the backend reports it). Then a forward
    through each unit under no other unit (``body.1``, ``body.2``; the whole model's forward
    would feed the plain root's own float32 layers a unit's low-precision output under mixed
    precision): a root keeps its parameters unsharded after forward, a unit nested in another
    reshards (FULL_SHARD; test_unshard_respects_reshard's contract), so the units
    ``is_unsharded`` reports afterwards are the roots the backend made. They must be exactly
    those outermost units: more than one root, as the seed counts. One rank shards nothing (no
    unit ever reshards), so there the roots cannot be read.
    """
    if backend.supports(Capability.INTROSPECT_UNIT_FQNS):
        units = set(backend.unit_fqns(sharded))
        assert "" not in units, f"{form.value}: the plain root (shard_root=False) is a unit: {sorted(units)}"
    if world_size == 1 or not backend.supports(Capability.INTROSPECT_UNSHARDED):
        return
    unit_names = fixtures.NestedModel.UNIT_FQNS
    outermost = sorted(u for u in unit_names if not any(u.startswith(f"{other}.") for other in unit_names))
    generator = torch.Generator().manual_seed(current_seed() + rank)
    for unit in outermost:
        features = next(local.get_submodule(unit).parameters()).shape[-1]
        submodule(sharded, unit)(torch.rand(2, features, generator=generator).to(device))
    roots = sorted(unit for unit in unit_names if backend.is_unsharded(sharded, unit))
    assert roots == outermost and len(roots) > 1, (
        f"{form.value}: after a forward the units {roots} kept their parameters unsharded, as "
        f"roots do; the roots must be the units under no other unit, {outermost} (more than one)"
    )


def _check_param_data_inside(
    backend: BackendAdapter,
    sharded: nn.Module,
    local: nn.Module,
    spec: ShardingSpec,
    form: ApiForm,
    offload_to_cpu: bool,
    device: torch.device,
) -> None:
    """Inside the context of :func:`_check_param_data`, on a rank that unshards: every
    parameter full, equal to the unsharded copy."""
    pairs = itertools.zip_longest(local.named_parameters(), sharded.named_parameters())
    for (name, expected), (seen_name, seen) in pairs:
        assert seen_name is not None and declared_fqn(backend, seen_name) == name, (
            f"{form.value}: parameter {seen_name!r} where {name!r} was expected"
        )
        assert isinstance(seen, nn.Parameter), f"{form.value}: {name} is {type(seen)}"
        assert shows_full(seen, expected.shape), (
            f"{form.value}: {name} shows {type(seen).__name__} {tuple(seen.shape)}, "
            f"expected full {tuple(expected.shape)}"
        )
        managed = name not in fixtures.NestedModel.UNMANAGED_PARAMS
        want_device = torch.device("cpu") if offload_to_cpu and managed else device
        assert seen.device == want_device, f"{form.value}: {name} is on {seen.device}, expected {want_device}"
        shown = shown_dtype(backend, spec.param_dtype) if managed else expected.dtype
        assert seen.dtype == shown, (
            f"{form.value}: {name} shows {seen.dtype}: full parameters must be in {shown} "
            f"(the original {expected.dtype}, or the compute dtype where MIXED_PRECISION_UNSHARD declares it)"
        )
        torch.testing.assert_close(
            seen.detach(),
            expected.detach().to(seen.device, shown),
            **EXACT,
            msg=lambda m, name=name: f"{form.value}: full {name} differs\n{m}",
        )


@pytest.mark.world_size(min=2, default=2)
@orig_params_axis
@mixed_precision_axis
@param_offload_axis
@offload_to_cpu_axis
@rank0_only_axis
def test_unshard_param_data(
    backend: BackendAdapter,
    rank0_only: bool,
    offload_to_cpu: bool,
    param_offload: bool,
    mixed_precision: bool,
    use_orig_params: bool,
    rank: int,
    world_size: int,
    device: torch.device,
) -> None:
    """Plain root over three sharded units (two nested): every full parameter matches.

    Names, shapes, device (CPU for managed parameters with ``offload_to_cpu``), fp32 dtype
    under mixed precision and values equal an unsharded copy; with ``rank0_only`` the other
    ranks keep every unit sharded inside the context, storing exactly their shards. After
    the context, a forward shows the roots the backend made: the two outermost units.
    """
    _check_param_data(
        backend,
        rank0_only,
        offload_to_cpu,
        param_offload,
        mixed_precision,
        use_orig_params,
        rank,
        world_size,
        device,
    )


@pytest.mark.world_size(1)
@orig_params_axis
@mixed_precision_axis
@param_offload_axis
@rank0_only_axis
def test_unshard_param_data_no_shard(
    backend: BackendAdapter,
    rank0_only: bool,
    param_offload: bool,
    mixed_precision: bool,
    use_orig_params: bool,
    rank: int,
    device: torch.device,
) -> None:
    """As test_unshard_param_data on one rank (nothing sharded); offload_to_cpu is refused there."""
    _check_param_data(backend, rank0_only, False, param_offload, mixed_precision, use_orig_params, rank, 1, device)


@pytest.mark.world_size(min=2, default=2)
@orig_params_axis
def test_unshard_singleton_writeback(
    backend: BackendAdapter, use_orig_params: bool, rank: int, world_size: int, device: torch.device
) -> None:
    """A 1-element weight: padding written on the other ranks never reaches the real value.

    Each rank stores exactly what the declared ``SHARD_LAYOUT`` gives (DeepSpeed's padded part:
    one element on every rank; otherwise the weight on rank 0 and nothing elsewhere), or with a
    flat parameter, one flat buffer under any layout: one element on every rank. Every rank
    writes ``rank + 2`` into what it stores (beyond rank 0 that is padding, or nothing); the
    full weight then reads 2 (rank 0's). Zeroing it with writeback
    leaves rank 0's stored element and the full weight at 0, and, as the seed checks, the
    padding the other ranks store keeps ``rank + 2``: writeback writes real elements only.
    """
    require_unshard(backend, writeback=True)
    spec = ShardingSpec(use_orig_params=use_orig_params)
    layout = type(backend).SHARD_LAYOUT
    for form, sharded in sharded_models(backend, Singleton, spec, device):
        names = list(named_params(backend, sharded))
        sizes = [backend.local_shard(sharded, name).numel() for name in names]
        index = 0 if use_orig_params else None
        wanted = [expected_local_numel(layout, [torch.Size([1, 1])], index, rank, world_size)]
        rule = f"{layout.name} ({layout.value})" if use_orig_params else "a flat parameter (one flat buffer per unit)"
        assert sizes == wanted, (
            f"{form.value}: rank {rank} stores {dict(zip(names, sizes))} elements of the 1-element "
            f"weight; {rule} gives {wanted}"
        )
        for name, size in zip(names, sizes):
            if size:
                part = backend.local_shard(sharded, name)
                part.reshape(-1)[0] = rank + 2
                backend.set_local_shard(sharded, name, part)
        shown = full_values(backend, sharded)["0.weight"].item()
        with check("the value the storing rank wrote"):
            assert shown == 2.0, (
                f"{form.value}: the full 0.weight reads {shown}, expected 2.0, the value rank 0 "
                f"wrote into the element it stores (each rank wrote rank + 2 into the first element "
                f"it stores; this rank, {rank}, stores {dict(zip(names, sizes))} elements)"
            )
        with backend.unshard(sharded, writeback=True), torch.no_grad():
            weight = named_params(backend, sharded)["0.weight"]
            assert weight.shape == (1, 1), f"{form.value}: full weight has shape {weight.shape}"
            weight.zero_()
        # Read everything (the full view is a collective) before any rank asserts alone.
        kept = backend.local_shard(sharded, names[0]).reshape(-1)[0].item() if sizes[0] else None
        shown = full_values(backend, sharded)["0.weight"].item()
        with check("a writeback context's zeros"):
            assert shown == 0.0, (
                f"{form.value}: the full 0.weight reads {shown} after a writeback context that zeroed it, expected 0.0"
            )
        # Rank 0 stores the real element; any other rank that stores something stores padding.
        want_kept = 0.0 if rank == 0 else float(rank + 2)
        with check("padding untouched by writeback"):
            assert kept in (None, want_kept), (
                f"{form.value}: rank {rank} stores {kept} for {names[0]} after a writeback context "
                f"that zeroed the full weight, expected {want_kept} "
                + ("(the real element)" if rank == 0 else "(padding it wrote before: writeback must not touch padding)")
            )


@pytest.mark.world_size(min=2, default=2)
@orig_params_axis
@mixed_precision_axis
@offload_to_cpu_axis
@rank0_only_axis
def test_unshard_respects_reshard(
    backend: BackendAdapter,
    rank0_only: bool,
    offload_to_cpu: bool,
    mixed_precision: bool,
    use_orig_params: bool,
    world_size: int,
    device: torch.device,
) -> None:
    """FULL_SHARD: forward leaves the root unsharded and unit ``0`` resharded, backward
    reshards both; an unshard between them or after backward changes none of that, except
    that under mixed precision an unshard between them reshards the root (backward gathers
    again) unless the adapter declares ``MIXED_PRECISION_UNSHARD.root_stays_unsharded``.
    With ``INTROSPECT_STORAGE`` each state is also read as the seed reads it, from the storage:
    exactly the layout's padded size while unsharded, 0 once freed."""
    writeback = read_only_writeback(backend, rank0_only)
    require_unshard(backend, writeback=writeback, rank0_only=rank0_only, offload_to_cpu=offload_to_cpu)
    require(backend, Capability.INTROSPECT_UNSHARDED)
    spec = ShardingSpec(
        manual_units=("0",),
        param_dtype=mixed_precision_dtype(backend) if mixed_precision else None,
        use_orig_params=use_orig_params,
    )

    @check("units unsharded as the reshard policy says")
    def check_state(sharded: nn.Module, root: bool, when: str) -> None:
        state = {unit: backend.is_unsharded(sharded, unit) for unit in ("", "0")}
        assert state == {"": root, "0": False}, f"{when}: unsharded per unit {state}"
        _check_unsharded_storage(backend, sharded, {"": root, "0": False}, use_orig_params, world_size, when)

    for form, sharded in sharded_models(backend, TwoLayer, spec, device):
        where = form.value
        output = sharded(torch.zeros(5, device=device))
        check_state(sharded, True, f"{where}: after forward")
        backend.backward(sharded, output.sum())
        check_state(sharded, False, f"{where}: after backward")

        output = sharded(torch.zeros(5, device=device))
        with backend.unshard(sharded, rank0_only=rank0_only, writeback=writeback, offload_to_cpu=offload_to_cpu):
            pass
        root_stays = not mixed_precision or type(backend).MIXED_PRECISION_UNSHARD.root_stays_unsharded
        check_state(sharded, root_stays, f"{where}: after an unshard before backward")
        backend.backward(sharded, output.sum())
        with backend.unshard(sharded, rank0_only=rank0_only, writeback=writeback, offload_to_cpu=offload_to_cpu):
            pass
        check_state(sharded, False, f"{where}: after an unshard following backward")


# TwoLayer sharded with manual unit "0" under a sharded root: what each unit manages.
_TWO_LAYER_UNITS = {"": ("1.weight",), "0": ("0.weight",)}


def _check_unsharded_storage(
    backend: BackendAdapter,
    sharded: nn.Module,
    unsharded: dict[str, bool],
    use_orig_params: bool,
    world_size: int,
    where: str,
) -> None:
    """Where the backend reports storage (``INTROSPECT_STORAGE``), each TwoLayer unit's allocated
    unsharded storage is exactly its padded size while unsharded (under the declared
    ``SHARD_LAYOUT``, or with flat parameters one flat buffer under any layout) and 0 once
    freed: a buffer left allocated, or freed only in part, fails (the seed's
    ``numel * world_size`` / ``0`` checks). Without it, ``is_unsharded`` is what there is."""
    if not backend.supports(Capability.INTROSPECT_STORAGE):
        return
    layout = type(backend).SHARD_LAYOUT
    flat = not use_orig_params
    shapes = {name: p.shape for name, p in TwoLayer().named_parameters()}
    seen, wanted = {}, {}
    for unit, names in _TWO_LAYER_UNITS.items():
        seen[unit] = backend.unsharded_storage_numel(sharded, unit)
        padded = expected_unsharded_numel(layout, [shapes[name] for name in names], world_size, flat_parameter=flat)
        wanted[unit] = padded if unsharded[unit] else 0
    rule = "a flat parameter (one flat buffer per unit)" if flat else layout.name
    assert seen == wanted, (
        f"{where}: unsharded storage per unit holds {seen} elements, expected {wanted} "
        f"({rule}: the padded size while unsharded, 0 once freed; unsharded units: "
        f"{sorted(u for u, state in unsharded.items() if state)})"
    )


def _check_names_and_storage(
    backend: BackendAdapter,
    sharded: nn.Module,
    unsharded: dict[str, bool],
    use_orig_params: bool,
    world_size: int,
    device: torch.device,
    where: str,
) -> None:
    """TwoLayer's parameter names and per-rank storage, given which units are unsharded.

    Unsharded unit: its original parameters, full shape. Sharded unit: with original parameters,
    no rank shows the full parameter, and each rank stores of it (``local_shard``) exactly what
    the declared ``SHARD_LAYOUT`` gives that rank; with flat parameters, ``<unit>._flat_param``
    of ceil(N / world size) elements on every rank. With ``INTROSPECT_STORAGE``, each unit's
    unsharded storage is exact too (:func:`_check_unsharded_storage`).
    Collective (one all-gather), so every rank calls it at the same point.
    """
    shapes = {name: p.shape for name, p in TwoLayer().named_parameters()}
    params = named_params(backend, sharded)
    wanted_names: set[str] = set()
    for unit, names in _TWO_LAYER_UNITS.items():
        if unsharded[unit] or use_orig_params:
            wanted_names.update(names)
        else:
            wanted_names.add(flat_param_fqn(backend, unit))
    assert set(params) == wanted_names, (
        f"{where}: parameters are named {sorted(params)}, expected {sorted(wanted_names)} "
        f"(unsharded units: {sorted(u for u, state in unsharded.items() if state)})"
    )
    partitioned = [
        name for unit, names in _TWO_LAYER_UNITS.items() if not unsharded[unit] and use_orig_params for name in names
    ]
    layout = type(backend).SHARD_LAYOUT
    local_sizes = torch.tensor(
        [backend.local_shard(sharded, name).numel() for name in partitioned],
        dtype=torch.int64,
        device=device,
    )
    per_rank = [torch.zeros_like(local_sizes) for _ in range(world_size)]
    dist.all_gather(per_rank, local_sizes)
    for index, name in enumerate(partitioned):
        seen = [int(sizes[index]) for sizes in per_rank]
        wanted = [expected_local_numel(layout, [shapes[name]], 0, r, world_size) for r in range(world_size)]
        assert not shows_full(params[name], shapes[name]), (
            f"{where}: sharded {name} shows {type(params[name]).__name__} "
            f"{tuple(params[name].shape)} on this rank, its full shape"
        )
        assert seen == wanted, (
            f"{where}: ranks 0..{world_size - 1} store {seen} elements of sharded {name} "
            f"{tuple(shapes[name])}; {layout.name} ({layout.value}) gives {wanted}"
        )
    _check_unsharded_storage(backend, sharded, unsharded, use_orig_params, world_size, where)
    for unit, names in _TWO_LAYER_UNITS.items():
        if unsharded[unit]:
            for name in names:
                assert shows_full(params[name], shapes[name]), (
                    f"{where}: {name} of unsharded unit {unit!r} shows "
                    f"{type(params[name]).__name__} {tuple(params[name].shape)}, expected full "
                    f"{tuple(shapes[name])}"
                )
        elif not use_orig_params:
            assert flat_param_fqn(backend, unit) in params, (
                f"{where}: sharded unit {unit!r} shows no {flat_param_fqn(backend, unit)}"
            )
            numel = sum(shapes[name].numel() for name in names)
            padded_shard = -(-numel // world_size)
            stored = backend.local_shard(sharded, flat_param_fqn(backend, unit)).numel()
            assert stored == padded_shard, (
                f"{where}: {flat_param_fqn(backend, unit)} holds {stored} elements on this "
                f"rank; a unit of {numel} elements sharded {world_size} ways holds "
                f"ceil({numel}/{world_size}) = {padded_shard}"
            )


@pytest.mark.world_size(min=2, default=2)
@orig_params_axis
def test_unshard_names_and_storage(
    backend: BackendAdapter, use_orig_params: bool, world_size: int, device: torch.device
) -> None:
    """Names and storage outside, inside and after a full unshard (module docstring).

    Unit ``0`` of TwoLayer under a sharded root. Before the context: original names
    (``orig_params``) or ``_flat_param``, ``0._flat_param`` (``flat_params``), with the
    contract's storage sizes; inside: exactly the unsharded model's names in its order, full
    shapes; after: as before. Only the adapter's declared wrapper components are removed from
    names, so a backend that leaks any other prefix fails.
    """
    require_unshard(backend)
    spec = ShardingSpec(manual_units=("0",), use_orig_params=use_orig_params)
    everything = {"": True, "0": True}
    nothing = {"": False, "0": False}
    for form, sharded in sharded_models(backend, TwoLayer, spec, device):
        where = f"{form.value}, {'original' if use_orig_params else 'flat'} parameters"
        _check_names_and_storage(backend, sharded, nothing, use_orig_params, world_size, device, f"{where}, before")
        with backend.unshard(sharded, writeback=False):
            names = [name for name, _ in sharded.named_parameters()]
            expected = [unsharded_name(backend, name) for name, _ in TwoLayer().named_parameters()]
            assert names == expected, f"{where}: inside the context {names}, expected {expected}"
            _check_names_and_storage(
                backend, sharded, everything, use_orig_params, world_size, device, f"{where}, inside"
            )
        _check_names_and_storage(backend, sharded, nothing, use_orig_params, world_size, device, f"{where}, after")


@pytest.mark.world_size(min=2, default=2)
@orig_params_axis
@mixed_precision_axis
@pytest.mark.parametrize("target", ["outer", "inner"])
@pytest.mark.parametrize("recurse", [True, False], ids=flag_ids("recurse"))
def test_unshard_recurse(
    backend: BackendAdapter,
    recurse: bool,
    target: str,
    mixed_precision: bool,
    use_orig_params: bool,
    world_size: int,
    device: torch.device,
) -> None:
    """Unsharding the root unshards unit ``0`` too only with ``recurse``; unsharding unit ``0``
    never unshards the root. Inside, unsharded units show full original parameters and sharded
    ones their shards, with the storage sizes of the module docstring (the seed's numel checks,
    padding included)."""
    require_unshard(backend, recurse=recurse)
    require(backend, Capability.INTROSPECT_UNSHARDED)
    spec = ShardingSpec(
        manual_units=("0",),
        param_dtype=mixed_precision_dtype(backend) if mixed_precision else None,
        use_orig_params=use_orig_params,
    )
    expected = {"": target == "outer", "0": recurse or target == "inner"}
    for form, sharded in sharded_models(backend, TwoLayer, spec, device):
        fqn = "" if target == "outer" else "0"
        with backend.unshard(sharded, fqn, recurse=recurse, writeback=False):
            state = {unit: backend.is_unsharded(sharded, unit) for unit in expected}
            assert state == expected, f"{form.value}: unsharded per unit {state}"
            _check_names_and_storage(
                backend,
                sharded,
                expected,
                use_orig_params,
                world_size,
                device,
                f"{form.value}: inside unshard({fqn!r}, recurse={recurse})",
            )


@pytest.mark.world_size(min=2, default=2)
@orig_params_axis
@pytest.mark.parametrize("recurse", [True, False], ids=flag_ids("recurse"))
@pytest.mark.parametrize("prefix", ["", "test_prefix"], ids=["no_prefix", "prefix"])
def test_unshard_named_parameters_and_buffers(
    backend: BackendAdapter, prefix: str, recurse: bool, use_orig_params: bool, device: torch.device
) -> None:
    """Inside the context the sharded root lists the same (name, tensor) pairs as the
    unsharded model, for ``named_parameters`` and ``named_buffers`` with ``prefix`` and
    ``recurse``. Names are compared raw, as the seed does: exactly the unsharded model's, with
    only the adapter's declared ``UNSHARDED_NAME_PREFIX`` inserted after ``prefix``. The extra
    buffer is registered on the module ``shard()`` returned, i.e. on what the user holds as the
    root, so its name has no such prefix."""
    require_unshard(backend)
    local = fixtures.build(fixtures.NestedModel, current_seed(), device)
    local.register_buffer("buffer", torch.ones(1, device=device))
    spec = ShardingSpec(use_orig_params=use_orig_params)
    own_buffer = f"{prefix}.buffer" if prefix else "buffer"
    for form, sharded in sharded_models(backend, fixtures.NestedModel, spec, device):
        sharded.register_buffer("buffer", torch.ones(1, device=device))
        with backend.unshard(sharded, writeback=False):
            for call in ("named_parameters", "named_buffers"):
                seen = list(getattr(sharded, call)(prefix=prefix, recurse=recurse))
                wanted = [
                    # the extra buffer is the returned root's own: no prefix of the adapter's
                    (name if name == own_buffer else unsharded_name(backend, name, prefix), tensor)
                    for name, tensor in getattr(local, call)(prefix=prefix, recurse=recurse)
                ]
                assert [n for n, _ in seen] == [n for n, _ in wanted], (
                    f"{form.value}: {call}(prefix={prefix!r}, recurse={recurse}) gives "
                    f"{[n for n, _ in seen]}, the unsharded model {[n for n, _ in wanted]}"
                )
                for (name, tensor), (_, expected) in zip(seen, wanted):
                    torch.testing.assert_close(
                        tensor.detach(),
                        expected.detach(),
                        **EXACT,
                        msg=lambda m, name=name: f"{form.value}: {call} {name} differs\n{m}",
                    )
