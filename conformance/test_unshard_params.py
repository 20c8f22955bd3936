"""Unshard-params scenarios: the ``unshard()`` context and every option it takes.

Contract checked here (backend-neutral; see docs/scenarios.md):

* Inside ``unshard()`` the unit's parameters are plain, full-shape, full-precision tensors with
  the original names, equal to an unsharded copy of the model.
* ``writeback=True`` keeps in-place changes made inside; ``writeback=False`` discards them when
  the unit is sharded. A unit that is *not* sharded (one rank) and keeps its parameters on the
  device shows its stored parameters directly, so changes persist regardless of ``writeback``
  (documented torch FSDP1 behaviour, kept as the contract).
* Padding a backend adds to make shards even never shows up in, or leaks into, real values.
* Unsharding outside forward/backward does not change what the strategy keeps gathered between
  forward and backward, except under mixed precision, where the full-precision view replaces the
  low-precision gathered copy (so the unit is resharded and backward gathers again).
* Refusals: unsharding during forward or backward raises ``RuntimeError`` or ``AssertionError``
  whose message says ``unshard`` and ``forward`` or ``backward``; an option combination the
  backend cannot honour (``rank0_only`` with ``writeback``, ``offload_to_cpu`` with
  ``NO_SHARD``) raises ``NotImplementedError`` or ``ValueError`` whose message names the
  option(s) and says "not supported" or "unsupported". Matching on these few words, not on a
  backend's full sentence, keeps the contract neutral.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn as nn
from harness import current_seed
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import fixtures
from conformance.protocol import (
    ApiForm,
    BackendAdapter,
    Capability,
    ShardingSpec,
    ShardingStrategy,
    require,
)

# Gathering and copying move values bit for bit: every comparison of parameters is exact.
EXACT = {"rtol": 0.0, "atol": 0.0}
# Gradients against DDP: both average the same per-rank gradients, but autograd runs on
# differently laid-out tensors (flat-parameter views vs plain parameters), so fp32 accumulation
# order may differ in the last bits; torch's default fp32 tolerances (rtol 1.3e-6, atol 1e-5)
# bound that, while a missing or wrong reduction is off by a factor (>= 1e-1 relative).
GRAD_TOLERANCE = {"rtol": 1.3e-6, "atol": 1e-5}
WRITEBACK_FACTOR = 2.0  # gradients are scaled by this inside the context to test writeback

MISUSE_ERRORS = (RuntimeError, AssertionError)
REFUSAL_ERRORS = (NotImplementedError, ValueError)
REFUSAL_WORDS = re.compile(r"not supported|unsupported", re.IGNORECASE)


class TwoLayer(nn.Sequential):
    """5 -> 5 -> 3 without biases: with unit ``0`` each unit owns exactly one weight."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(5, 5, bias=False), nn.Linear(5, 3, bias=False))


class Singleton(nn.Sequential):
    """One 1-element weight: at two ranks or more every rank but 0 holds only padding."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(1, 1, bias=False))


class PairOfPairs(nn.Sequential):
    """Two ``nn.Sequential`` children of two 16x16 linears each: auto-wrap makes both units."""

    def __init__(self) -> None:
        super().__init__(
            nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)),
            nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)),
        )


class PartlyUsed(nn.Module):
    """Forward uses ``used`` only: ``unused`` shares the root unit, unit ``idle`` gets nothing."""

    UNIT_FQNS = ("idle",)

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)
        self.idle = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


class CallsBackInForward(nn.Module):
    """Runs ``during_forward`` inside its forward: how a scenario reaches into forward."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(5))
        self.during_forward: Callable[[], None] = lambda: None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.during_forward()
        return (self.weight * x).sum()


def _flag(name: str) -> Callable[[bool], str]:
    """Readable ids for a bool axis: ``name`` / ``no_name``."""
    return lambda value: name if value else f"no_{name}"


writeback_axis = pytest.mark.parametrize("writeback", [True, False], ids=_flag("writeback"))
mixed_precision_axis = pytest.mark.parametrize(
    "mixed_precision", [True, False], ids=["fp16", "fp32"]
)
param_offload_axis = pytest.mark.parametrize(
    "param_offload", [True, False], ids=_flag("param_offload")
)
orig_params_axis = pytest.mark.parametrize(
    "use_orig_params", [True, False], ids=["orig_params", "flat_params"]
)
rank0_only_axis = pytest.mark.parametrize("rank0_only", [True, False], ids=_flag("rank0_only"))
offload_to_cpu_axis = pytest.mark.parametrize(
    "offload_to_cpu", [True, False], ids=_flag("offload_to_cpu")
)
grad_strategy_axis = pytest.mark.parametrize(
    "strategy",
    [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD],
    ids=lambda s: s.name,
)


def _require_unshard(
    backend: BackendAdapter,
    *,
    writeback: bool = False,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    recurse: bool = True,
    with_grads: bool = False,
) -> None:
    """Skip as unsupported unless the backend offers ``unshard()`` with these options."""
    require(backend, Capability.UNSHARD)
    for wanted, capability in (
        (writeback, Capability.UNSHARD_WRITEBACK),
        (rank0_only, Capability.UNSHARD_RANK0_ONLY),
        (offload_to_cpu, Capability.UNSHARD_OFFLOAD_TO_CPU),
        (not recurse, Capability.UNSHARD_NON_RECURSIVE),
        (with_grads, Capability.UNSHARD_WITH_GRADS),
    ):
        if wanted:
            require(backend, capability)


def _sharded_models(
    backend: BackendAdapter,
    model_cls: type[nn.Module],
    spec: ShardingSpec,
    device: torch.device,
) -> Iterator[tuple[ApiForm, nn.Module]]:
    """A freshly built and sharded ``model_cls`` for every form the backend has."""
    for capability in sorted(
        spec.needed_capabilities(ApiForm.WRAPPER) - {Capability.WRAPPER},
        key=lambda c: list(Capability).index(c),
    ):
        require(backend, capability)  # skip before building anything
    for form in backend.forms():
        model = fixtures.build(model_cls, current_seed(), device)
        yield form, backend.shard(model, spec, form)


def _named_params(backend: BackendAdapter, sharded: nn.Module) -> dict[str, nn.Parameter]:
    return {backend.original_fqn(name): p for name, p in sharded.named_parameters()}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank stores of a parameter or gradient (a DTensor's local shard)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _shows_full(tensor: torch.Tensor, shape: torch.Size) -> bool:
    """A full view is a plain tensor of the original shape (a shard is a DTensor or smaller)."""
    return not isinstance(tensor, DTensor) and tensor.shape == shape


def _unit_params(
    backend: BackendAdapter, sharded: nn.Module, inner: bool
) -> list[nn.Parameter]:
    """Parameters (flat or original) that unit ``0`` (inner) or the root (outer) manages."""
    chosen = [
        p for name, p in _named_params(backend, sharded).items() if name.startswith("0.") == inner
    ]
    assert chosen, f"no parameter of the {'inner' if inner else 'outer'} unit is visible"
    return chosen


def _full_values(backend: BackendAdapter, sharded: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value, read through a discarding unshard."""
    with backend.unshard(sharded, writeback=False):
        return {name: p.detach().clone() for name, p in _named_params(backend, sharded).items()}


def _assert_words(error: BaseException, *words: str, refusal: bool) -> None:
    message = str(error)
    missing = [w for w in words if w.lower() not in message.lower()]
    if refusal and not REFUSAL_WORDS.search(message):
        missing.append("'not supported' or 'unsupported'")
    assert not missing, (
        f"{type(error).__name__} message lacks {missing} (the backend-neutral contract): "
        f"{message!r}"
    )


# -- writeback ------------------------------------------------------------------------------


@pytest.mark.world_size([1, 2])
@writeback_axis
@pytest.mark.parametrize("unit", ["outer", "inner"])
@mixed_precision_axis
@param_offload_axis
@orig_params_axis
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
    _require_unshard(backend, writeback=writeback)
    spec = ShardingSpec(
        manual_units=("0",),
        param_dtype=torch.float16 if mixed_precision else None,
        offload_params=param_offload,
        use_orig_params=use_orig_params,
    )
    initial = dict(fixtures.build(TwoLayer, current_seed(), device).named_parameters())
    checked_name, other_name = ("0.weight", "1.weight") if unit == "inner" else ("1.weight", "0.weight")
    changes_persist = writeback or (world_size == 1 and not param_offload)
    for form, sharded in _sharded_models(backend, TwoLayer, spec, device):
        written = _unit_params(backend, sharded, inner=unit == "inner")
        with torch.no_grad():
            for param in written:
                _local(param).fill_(rank + 2)
        with backend.unshard(sharded, writeback=writeback), torch.no_grad():
            for param in sharded.parameters():
                param.zero_()

        first = _local(written[0]).reshape(-1)
        assert first.numel() > 0, f"{form.value}: rank {rank} stores nothing of the {unit} unit"
        expected = 0.0 if changes_persist else float(rank + 2)
        assert first[0].item() == expected, (
            f"{form.value}: rank {rank}: stored {unit} value is {first[0].item()} after the "
            f"context, expected {expected} (writeback={writeback}, world size {world_size})"
        )
        if param_offload:
            devices = {p.device.type for p in sharded.parameters()}
            assert devices == {"cpu"}, f"{form.value}: offloaded parameters live on {devices}"

        full = _full_values(backend, sharded)
        if changes_persist:
            for name, value in full.items():
                assert not value.any(), f"{form.value}: {name} lost the zeros written inside"
        else:
            values = set(full[checked_name].unique().tolist())
            assert values <= {float(r + 2) for r in range(world_size)}, (
                f"{form.value}: full {checked_name} holds {sorted(values)}, not only the values "
                "ranks wrote before the context"
            )
            torch.testing.assert_close(
                full[other_name], initial[other_name].to(full[other_name].device), **EXACT,
                msg=lambda m: f"{form.value}: {other_name} kept changes made inside\n{m}",
            )


# -- parameter data -------------------------------------------------------------------------


def _check_param_data(
    backend: BackendAdapter,
    rank0_only: bool,
    offload_to_cpu: bool,
    param_offload: bool,
    mixed_precision: bool,
    use_orig_params: bool,
    rank: int,
    device: torch.device,
) -> None:
    """Full parameters of a plain root over several sharded roots match an unsharded copy."""
    writeback = not rank0_only  # writeback with rank0_only is refused (test_rank0_only_...)
    _require_unshard(
        backend, writeback=writeback, rank0_only=rank0_only, offload_to_cpu=offload_to_cpu
    )
    if rank0_only:
        require(backend, Capability.INTROSPECT_UNSHARDED)
    spec = ShardingSpec(
        manual_units=fixtures.NestedModel.UNIT_FQNS,
        shard_root=False,
        param_dtype=torch.float16 if mixed_precision else None,
        offload_params=param_offload,
        use_orig_params=use_orig_params,
    )
    local = fixtures.build(fixtures.NestedModel, current_seed(), device)
    for form, sharded in _sharded_models(backend, fixtures.NestedModel, spec, device):
        with backend.unshard(
            sharded, rank0_only=rank0_only, writeback=writeback, offload_to_cpu=offload_to_cpu
        ):
            if rank0_only and rank != 0:
                for unit in fixtures.NestedModel.UNIT_FQNS:
                    assert not backend.is_unsharded(sharded, unit), (
                        f"{form.value}: rank {rank} holds unit {unit} unsharded under rank0_only"
                    )
                continue
            pairs = itertools.zip_longest(local.named_parameters(), sharded.named_parameters())
            for (name, expected), (seen_name, seen) in pairs:
                assert backend.original_fqn(seen_name) == name, (
                    f"{form.value}: parameter {seen_name!r} where {name!r} was expected"
                )
                assert isinstance(seen, nn.Parameter), f"{form.value}: {name} is {type(seen)}"
                assert _shows_full(seen, expected.shape), (
                    f"{form.value}: {name} shows {type(seen).__name__} {tuple(seen.shape)}, "
                    f"expected full {tuple(expected.shape)}"
                )
                managed = name not in fixtures.NestedModel.UNMANAGED_PARAMS
                want_device = torch.device("cpu") if offload_to_cpu and managed else device
                assert seen.device == want_device, (
                    f"{form.value}: {name} is on {seen.device}, expected {want_device}"
                )
                assert seen.dtype == expected.dtype, (
                    f"{form.value}: {name} shows {seen.dtype}: full parameters must be in the "
                    f"original {expected.dtype} even under mixed precision"
                )
                torch.testing.assert_close(
                    seen.detach(), expected.detach().to(seen.device), **EXACT,
                    msg=lambda m, name=name: f"{form.value}: full {name} differs\n{m}",
                )


@pytest.mark.world_size(2)
@rank0_only_axis
@offload_to_cpu_axis
@param_offload_axis
@mixed_precision_axis
@orig_params_axis
def test_unshard_param_data(
    backend: BackendAdapter,
    rank0_only: bool,
    offload_to_cpu: bool,
    param_offload: bool,
    mixed_precision: bool,
    use_orig_params: bool,
    rank: int,
    device: torch.device,
) -> None:
    """Plain root over three sharded units (two nested): every full parameter matches.

    Names, shapes, device (CPU for managed parameters with ``offload_to_cpu``), fp32 dtype
    under mixed precision and values equal an unsharded copy; with ``rank0_only`` the other
    ranks keep every unit sharded inside the context.
    """
    _check_param_data(
        backend, rank0_only, offload_to_cpu, param_offload, mixed_precision, use_orig_params,
        rank, device,
    )


@pytest.mark.world_size(1)
@rank0_only_axis
@param_offload_axis
@mixed_precision_axis
@orig_params_axis
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
    _check_param_data(
        backend, rank0_only, False, param_offload, mixed_precision, use_orig_params, rank, device
    )


# -- padding --------------------------------------------------------------------------------


@pytest.mark.world_size(2)
@orig_params_axis
def test_unshard_singleton_writeback(
    backend: BackendAdapter, use_orig_params: bool, rank: int, device: torch.device
) -> None:
    """A 1-element weight: padding written on rank 1 never reaches the real value.

    Every rank writes ``rank + 2`` into what it stores (on rank 1 that is padding, or nothing);
    the full weight then reads 2 (rank 0's). Zeroing it with writeback leaves rank 0's stored
    element and the full weight at 0. What happens to padding itself is not specified.
    """
    _require_unshard(backend, writeback=True)
    spec = ShardingSpec(use_orig_params=use_orig_params)
    for form, sharded in _sharded_models(backend, Singleton, spec, device):
        stored = [_local(p).reshape(-1) for p in sharded.parameters()]
        if not use_orig_params:
            assert [s.numel() for s in stored] == [1], (
                f"{form.value}: a flat parameter of one element should be padded to one element "
                f"per rank, rank {rank} stores {[s.numel() for s in stored]}"
            )
        with torch.no_grad():
            for part in stored:
                if part.numel():
                    part[0] = rank + 2
        assert _full_values(backend, sharded)["0.weight"].item() == 2.0, (
            f"{form.value}: padding written by another rank leaked into the full weight"
        )
        with backend.unshard(sharded, writeback=True), torch.no_grad():
            weight = _named_params(backend, sharded)["0.weight"]
            assert weight.shape == (1, 1), f"{form.value}: full weight has shape {weight.shape}"
            weight.zero_()
        if rank == 0:
            assert stored[0][0].item() == 0.0, f"{form.value}: rank 0 lost the written zero"
        assert _full_values(backend, sharded)["0.weight"].item() == 0.0, (
            f"{form.value}: the zero written inside did not persist"
        )


# -- reshard behaviour ----------------------------------------------------------------------


@pytest.mark.world_size(2)
@rank0_only_axis
@offload_to_cpu_axis
@mixed_precision_axis
@orig_params_axis
def test_unshard_respects_reshard(
    backend: BackendAdapter,
    rank0_only: bool,
    offload_to_cpu: bool,
    mixed_precision: bool,
    use_orig_params: bool,
    device: torch.device,
) -> None:
    """FULL_SHARD: forward leaves the root unsharded and unit ``0`` resharded, backward
    reshards both; an unshard between them or after backward changes none of that, except
    that under mixed precision the root is resharded by it (backward gathers again)."""
    _require_unshard(
        backend, writeback=not rank0_only, rank0_only=rank0_only, offload_to_cpu=offload_to_cpu
    )
    require(backend, Capability.INTROSPECT_UNSHARDED)
    spec = ShardingSpec(
        manual_units=("0",),
        param_dtype=torch.float16 if mixed_precision else None,
        use_orig_params=use_orig_params,
    )

    def check(sharded: nn.Module, root: bool, when: str) -> None:
        state = {unit: backend.is_unsharded(sharded, unit) for unit in ("", "0")}
        assert state == {"": root, "0": False}, f"{when}: unsharded per unit {state}"

    for form, sharded in _sharded_models(backend, TwoLayer, spec, device):
        where = f"{form.value}"
        output = sharded(torch.zeros(5, device=device))
        check(sharded, True, f"{where}: after forward")
        output.sum().backward()
        check(sharded, False, f"{where}: after backward")

        output = sharded(torch.zeros(5, device=device))
        with backend.unshard(
            sharded, rank0_only=rank0_only, writeback=not rank0_only, offload_to_cpu=offload_to_cpu
        ):
            pass
        check(sharded, not mixed_precision, f"{where}: after an unshard between forward and backward")
        output.sum().backward()
        with backend.unshard(
            sharded, rank0_only=rank0_only, writeback=not rank0_only, offload_to_cpu=offload_to_cpu
        ):
            pass
        check(sharded, False, f"{where}: after an unshard following backward")


