"""What the unshard scenario modules (``test_unshard_params``, ``test_unshard_with_grads``,
``test_unshard_refusals``) share: their small models, the bounds they compare with, and the helpers
that shard a model in every form and read what it shows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fixtures
from conformance.protocol import (
    ApiForm,
    BackendAdapter,
    Capability,
    ShardingSpec,
    ShardingStrategy,
    declared_fqn,
    require_all,
    unshard_capabilities,
)
from harness import current_seed

# Gathering and copying move values bit for bit: every comparison of parameters is exact.
EXACT = {"rtol": 0.0, "atol": 0.0}


# Gradients against DDP: both average the same per-rank gradients, but autograd runs on
# differently laid-out tensors (flat-parameter views vs plain parameters), so fp32 accumulation
# order may differ in the last bits; torch's default fp32 tolerances (rtol 1.3e-6, atol 1e-5)
# bound that, while a missing or wrong reduction is off by a factor (>= 1e-1 relative).
GRAD_TOLERANCE = {"rtol": 1.3e-6, "atol": 1e-5}


WRITEBACK_FACTOR = 2.0  # gradients are scaled by this inside the context to test writeback


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


class TinyLinear(nn.Sequential):
    """The smallest model with a backward: one 2 -> 1 linear."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(2, 1))


class CallsBackInForward(nn.Module):
    """Runs ``during_forward`` inside its forward: how a scenario reaches into forward."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(5))
        self.during_forward: Callable[[], None] = lambda: None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.during_forward()
        return (self.weight * x).sum()


def flag_ids(name: str) -> Callable[[bool], str]:
    """Readable ids for a bool axis: ``name`` / ``no_name``."""
    return lambda value: name if value else f"no_{name}"


writeback_axis = pytest.mark.parametrize("writeback", [True, False], ids=flag_ids("writeback"))


mixed_precision_axis = pytest.mark.parametrize("mixed_precision", [True, False], ids=["mixed", "fp32"])


param_offload_axis = pytest.mark.parametrize("param_offload", [True, False], ids=flag_ids("param_offload"))


orig_params_axis = pytest.mark.parametrize("use_orig_params", [True, False], ids=["orig_params", "flat_params"])


rank0_only_axis = pytest.mark.parametrize("rank0_only", [True, False], ids=flag_ids("rank0_only"))


offload_to_cpu_axis = pytest.mark.parametrize("offload_to_cpu", [True, False], ids=flag_ids("offload_to_cpu"))


grad_strategy_axis = pytest.mark.parametrize(
    "strategy",
    [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD],
    ids=lambda s: s.name,
)


def require_unshard(backend: BackendAdapter, **options: bool) -> None:
    """Skip as unsupported unless the backend offers ``unshard()`` with these options."""
    require_all(backend, unshard_capabilities(**options))


def read_only_writeback(backend: BackendAdapter, rank0_only: bool) -> bool:
    """``writeback`` for a context whose body only reads: the seeds' ``not rank0_only`` where
    the backend has writeback (what is read cannot depend on it), else False, so a backend
    without writeback still runs every read-only check."""
    return not rank0_only and backend.supports(Capability.UNSHARD_WRITEBACK)


def sharded_models(
    backend: BackendAdapter,
    model_cls: type[nn.Module],
    spec: ShardingSpec,
    device: torch.device,
) -> Iterator[tuple[ApiForm, nn.Module]]:
    """A freshly built and sharded ``model_cls`` for every form the backend has."""
    require_all(backend, spec.feature_capabilities())  # skip before building anything
    for form in backend.forms():
        model = fixtures.build(model_cls, current_seed(), device)
        yield form, backend.shard(model, spec, form)


def named_params(backend: BackendAdapter, sharded: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters by name, only the adapter's declared wrapper components removed."""
    return {declared_fqn(backend, name): p for name, p in sharded.named_parameters()}


def shows_full(tensor: torch.Tensor, shape: torch.Size) -> bool:
    """A full view is a plain tensor of the original shape (a shard is a DTensor or smaller)."""
    return not isinstance(tensor, DTensor) and tensor.shape == shape


def unit_param_names(backend: BackendAdapter, sharded: nn.Module, inner: bool) -> list[str]:
    """Names (flat or original) of the parameters unit ``0`` (inner) or the root (outer)
    manages, as the storage accessors take them."""
    chosen = [name for name in named_params(backend, sharded) if name.startswith("0.") == inner]
    assert chosen, f"no parameter of the {'inner' if inner else 'outer'} unit is visible"
    return chosen


def fill_stored(backend: BackendAdapter, sharded: nn.Module, name: str, value: float) -> None:
    """Write ``value`` into every element this rank stores of parameter ``name``."""
    stored = backend.local_shard(sharded, name)
    backend.set_local_shard(sharded, name, torch.full_like(stored, value))


def shown_dtype(backend: BackendAdapter, param_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype parameters show inside ``unshard()``: float32, or under mixed precision the
    compute dtype where the adapter declares so (``MIXED_PRECISION_UNSHARD``)."""
    if param_dtype is not None and type(backend).MIXED_PRECISION_UNSHARD.shows_compute_dtype:
        return param_dtype
    return torch.float32


def full_values(backend: BackendAdapter, sharded: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value, read through a discarding unshard."""
    with backend.unshard(sharded, writeback=False):
        return {name: p.detach().clone() for name, p in named_params(backend, sharded).items()}
