"""Backend facts: what a backend declares where backends legitimately differ, checked exactly.

Where the upstream tests leave a backend a choice, an adapter declares what its backend does
(:class:`BackendFacts`, with the seeds', i.e. torch FSDP1's, defaults) and the scenarios hold it to
exactly that (docs/writing-an-adapter.md, "Backend facts"): how each :class:`Misuse` is refused
(:class:`Refusal`, :data:`SEED_REFUSALS`), what ``unshard()`` shows under mixed precision
(:class:`MixedPrecisionUnshard`), how parameters are split over the ranks (:class:`ShardLayout`,
with :func:`expected_local_numel` and :func:`expected_unsharded_numel`), the names a backend
shows (``WRAPPER_COMPONENTS``, ``FLAT_PARAMETER_NAME``, ``UNSHARDED_NAME_PREFIX``) and where its
library's code lives (``BACKEND_MODULES``, for the call sites of the collective trace). The functions
at the end read a backend's declarations the way scenarios must: :func:`declared_fqn`,
:func:`unsharded_name`, :func:`flat_param_fqn`, :func:`declared_refusal`, :func:`refused`.
"""

from __future__ import annotations

import contextlib
import enum
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from conformance.protocol.vocabulary import Misuse
from harness import strip_path_components


@dataclass(frozen=True)
class Refusal:
    """How a backend refuses a misuse: an exception of one of ``types`` whose message matches
    the regular expression ``pattern`` (``re.search``)."""

    types: tuple[type[BaseException], ...]
    pattern: str

    def __post_init__(self) -> None:
        if not self.types:
            raise ValueError("Refusal.types names no exception type; give the type(s) the backend raises")
        re.compile(self.pattern)  # a bad pattern fails where it is declared, not in every scenario

    def mismatch(self, error: BaseException) -> str | None:
        """What differs between ``error`` and this declaration, or None when it matches."""
        if isinstance(error, self.types) and re.search(self.pattern, str(error)):
            return None
        return f"raised {type(error).__name__}: {error}; expected {self}"

    def __str__(self) -> str:
        return f"{' or '.join(t.__name__ for t in self.types)} matching {self.pattern!r}"


@dataclass(frozen=True)
class Permitted:
    """A misuse the backend allows: the call goes on, and the scenario checks that it gives the
    right values (the forward's output, the parameters afterwards) instead of a refusal. A claim
    like any declared fact: back it with a proof on the library that the call returns the right
    values (``FactProofs``, fact ``REFUSALS.<MISUSE>``). ``reason``: why it is safe there."""

    reason: str

    def __post_init__(self) -> None:
        if not self.reason.strip():
            raise ValueError("Permitted needs its reason: why the backend can allow the misuse")

    def __str__(self) -> str:
        return f"permitted ({self.reason})"


_UNSHARD_IN_COMPUTE = Refusal((AssertionError,), "Cannot manually unshard parameters during forward/backward")
_NOT_SUPPORTED = Refusal((NotImplementedError,), "is not supported")

# The upstream seeds' refusals, verbatim (test_fsdp_summon_full_params.py, test_fsdp_tp_integration.py):
# what a backend that declares no REFUSALS of its own is held to, and what the torch adapters declare.
SEED_REFUSALS: Mapping[Misuse, Refusal] = {
    Misuse.UNSHARD_DURING_FORWARD: _UNSHARD_IN_COMPUTE,
    Misuse.UNSHARD_DURING_BACKWARD: _UNSHARD_IN_COMPUTE,
    Misuse.UNSHARD_RANK0_ONLY_WITH_WRITEBACK: _NOT_SUPPORTED,
    Misuse.UNSHARD_OFFLOAD_TO_CPU_NO_SHARD: _NOT_SUPPORTED,
    Misuse.TENSOR_PARALLEL_OUTER_MESH_DIM: Refusal(
        (RuntimeError,), r"Found TP device_mesh on the \d dimension of its parent mesh"
    ),
}


@dataclass(frozen=True)
class MixedPrecisionUnshard:
    """What ``unshard()`` does under mixed precision (``ShardingSpec.param_dtype``), where the
    seeds leave a backend the choice. The defaults are torch FSDP1's (the seeds').

    ``shows_compute_dtype``: inside the context parameters are in ``param_dtype`` (FSDP2 and
    DeepSpeed gather the low-precision copy) rather than the original float32 (FSDP1).
    ``root_stays_unsharded``: an unshard between forward and backward leaves the root's
    gathered low-precision parameters in place (FSDP2) rather than replacing them with the
    full-precision view and resharding the root, so that backward gathers again (FSDP1).
    Without mixed precision neither applies: an unshard changes nothing a strategy keeps gathered.
    """

    shows_compute_dtype: bool = False
    root_stays_unsharded: bool = False


class ShardLayout(enum.Enum):
    """How a backend splits a unit's original parameters over the ranks (``SHARD_LAYOUT``): what
    each rank stores of a parameter (:meth:`BackendAdapter.local_shard`) and how many elements a
    unit's unsharded storage holds (:meth:`BackendAdapter.unsharded_storage_numel`), both exactly
    (:func:`expected_local_numel`, :func:`expected_unsharded_numel`).

    A flat parameter (``ShardingSpec.use_orig_params=False``) is one flat buffer per unit under
    every layout: each rank stores ceil(N / world size) of a unit's N elements, and the unit's
    unsharded storage holds that times the world size. So a backend that keeps flat parameters
    as flat units and original parameters otherwise (e.g. in rows) declares the layout of its
    original parameters; the flat rule applies by itself (``index`` None in
    :func:`expected_local_numel`, ``flat_parameter`` in :func:`expected_unsharded_numel`).

    FLAT_UNIT (torch FSDP1, the seeds', the default): a unit's parameters, flattened in
    registration order, form one buffer padded at its end to a multiple of the world size; rank r
    stores elements [r*c, (r+1)*c) with c = ceil(padded / world size); an original parameter's
    local shard is its part of that range (empty where it has none), the flat parameter's is c
    elements. ROWS (torch FSDP2): each parameter is split along dim 0 into chunks of
    ceil(rows / world size) rows, rank r holding chunk r unpadded (empty past the last row); the
    unsharded storage of a parameter holds ceil(rows / world size) x world size rows. PER_PARAMETER
    (DeepSpeed ZeRO-3): each parameter on its own, flattened and padded to a multiple of the world
    size; every rank stores ceil(numel / world size) elements, padding included.
    """

    FLAT_UNIT = "flat buffer per unit"
    ROWS = "dim-0 chunks per parameter"
    PER_PARAMETER = "flat padded buffer per parameter"


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def expected_local_numel(
    layout: ShardLayout, shapes: list[torch.Size], index: int | None, rank: int, world_size: int
) -> int:
    """Elements rank ``rank`` stores of parameter ``index`` of a unit whose parameters have
    ``shapes`` (registration order), or of the unit's flat parameter (``index`` None): one flat
    buffer whatever ``layout`` says of original parameters, ceil(N / world size) elements on
    every rank. FLAT_UNIT assumes no gaps between parameters: exact for one-parameter units,
    where the alignment padding a backend may insert between parameters cannot arise."""
    numels = [shape.numel() for shape in shapes]
    chunk = _ceil_div(sum(numels), world_size)
    if index is None:
        return chunk
    if layout is ShardLayout.FLAT_UNIT:
        start = sum(numels[:index])
        stop = start + numels[index]
        return max(0, min(stop, (rank + 1) * chunk) - max(start, rank * chunk))
    shape = shapes[index]
    if layout is ShardLayout.ROWS:
        rows = shape[0] if len(shape) else 1
        per_row = numels[index] // rows if rows else 0
        chunk = _ceil_div(rows, world_size)
        return max(0, min(rows, (rank + 1) * chunk) - rank * chunk) * per_row
    return _ceil_div(numels[index], world_size)


def expected_unsharded_numel(
    layout: ShardLayout, shapes: list[torch.Size], world_size: int, *, flat_parameter: bool = False
) -> int:
    """Elements of a unit's unsharded storage while it is allocated (padding included).
    ``flat_parameter``: the unit is sharded with a flat parameter (``use_orig_params=False``),
    one flat buffer whatever ``layout`` says of original parameters."""
    numels = [shape.numel() for shape in shapes]
    if layout is ShardLayout.FLAT_UNIT or flat_parameter:
        return _ceil_div(sum(numels), world_size) * world_size
    if layout is ShardLayout.ROWS:
        total = 0
        for shape, numel in zip(shapes, numels):
            rows = shape[0] if len(shape) else 1
            total += _ceil_div(rows, world_size) * world_size * (numel // rows if rows else 0)
        return total
    return sum(_ceil_div(numel, world_size) * world_size for numel in numels)


class BackendFacts:
    """The facts an adapter declares as class attributes, with the seeds' defaults.

    A base of :class:`~conformance.protocol.adapter.BackendAdapter`: an adapter overrides what its
    backend does differently, and proves each fact on the real library as
    tests/conformance_tests/test_declared_facts.py does.
    """

    # The backend's name (each adapter sets it): what messages about its declarations name.
    name: ClassVar[str]
    # Module path components the backend's *wrappers* insert between a module and its children
    # (torch FSDP1: "_fsdp_wrapped_module"). Scenarios compare parameter names after removing
    # exactly these and nothing else (see :func:`declared_fqn`): a backend that leaks any other
    # prefix into names fails. Declare them; there is no other way to have names cleaned.
    WRAPPER_COMPONENTS: ClassVar[frozenset[str]] = frozenset()
    # The name of a unit's flat parameter (with FLAT_PARAMETERS): "<unit FQN>.<name>".
    FLAT_PARAMETER_NAME: ClassVar[str] = "_flat_param"
    # How each misuse is refused; a misuse left out is held to the seeds' refusal.
    # A misuse the backend allows is declared Permitted(reason) (the scenario then checks values).
    REFUSALS: ClassVar[Mapping[Misuse, Refusal | Permitted]] = SEED_REFUSALS
    MIXED_PRECISION_UNSHARD: ClassVar[MixedPrecisionUnshard] = MixedPrecisionUnshard()
    # How original parameters are split over the ranks (protocol 4): local_shard sizes and, with
    # INTROSPECT_STORAGE, unsharded storage sizes are checked exactly against it. A flat
    # parameter is one flat buffer per unit under any layout (ShardLayout): declare the layout
    # of your original parameters.
    SHARD_LAYOUT: ClassVar[ShardLayout] = ShardLayout.FLAT_UNIT
    # What the module shard() returns puts in front of every original FQN in the names it lists
    # inside the unshard context (its own child attribute, for an adapter whose root wrapper does
    # not hide itself): "" (the seeds') means named_parameters() / named_buffers() list exactly
    # the unsharded model's names. Scenarios compare raw names with it, nothing stripped.
    UNSHARDED_NAME_PREFIX: ClassVar[str] = ""
    # With TENSOR_PARALLEL: where a sharded 2-D state dict puts the values tensor parallelism
    # left whole. "2-D" (the seed's, FSDP1): on the 2-D mesh, placements (Shard(0), Replicate());
    # "dp": on the dp mesh, (Shard(0),). Tensor-parallel values are always on the 2-D mesh.
    NON_TP_2D_STATE_DICT_MESH: ClassVar[str] = "2-D"
    # Import names of the packages (or modules) that hold the backend library's own code (e.g.
    # ("deepspeed",)), protocol 5. The collective trace names the line that issued each
    # collective; frames inside these are left out, so a collective the library issues is named
    # by the scenario line that called into it: the same on every rank, even where the library
    # itself takes rank-dependent paths (the owner of a parameter broadcasts it, the others
    # receive it) that issue matching collectives from different lines of its own. Without it,
    # such paths are reported as divergent collectives. The adapter's own module and the protocol
    # are always left out; torch's frames too, so a backend built into torch declares nothing.
    BACKEND_MODULES: ClassVar[tuple[str, ...]] = ()

    def original_fqn(self, name: str) -> str:
        """The original model's FQN for a name seen on a sharded model: the name without the
        declared :attr:`WRAPPER_COMPONENTS`. Scenarios use :func:`declared_fqn`, which an
        override of this method cannot widen."""
        return declared_fqn(self, name)


def declared_fqn(backend: BackendFacts, name: str) -> str:
    """``name`` without the path components ``backend`` declares in ``WRAPPER_COMPONENTS``."""
    return strip_path_components(name, type(backend).WRAPPER_COMPONENTS)


def unsharded_name(backend: BackendFacts, name: str, prefix: str = "") -> str:
    """The raw name ``backend`` must list inside the unshard context for the unsharded model's
    ``name`` (listed with ``prefix``): the declared ``UNSHARDED_NAME_PREFIX`` inserted after the
    caller's prefix, nothing else."""
    parts = [prefix, type(backend).UNSHARDED_NAME_PREFIX, name[len(prefix) + 1 :] if prefix else name]
    return ".".join(part for part in parts if part)


def flat_param_fqn(backend: BackendFacts, unit: str) -> str:
    """The name a unit's flat parameter must have: with ``use_orig_params=False`` the only
    parameter a unit shows outside the unshard context is ``<unit FQN>.<FLAT_PARAMETER_NAME>``
    (the name alone for the root), after removing the declared wrapper components; each rank's
    holds ceil(N / world size) elements for a unit managing N parameter elements (the flat
    buffer is padded at its end to split evenly)."""
    name = type(backend).FLAT_PARAMETER_NAME
    return f"{unit}.{name}" if unit else name


def declared_refusal(backend: BackendFacts | type[BackendFacts], misuse: Misuse) -> Refusal | Permitted:
    """How ``backend`` (an adapter or its class) declares it refuses ``misuse`` (the seeds'
    refusal where it declares none), or that it permits it."""
    adapter_cls = backend if isinstance(backend, type) else type(backend)
    return adapter_cls.REFUSALS.get(misuse, SEED_REFUSALS[misuse])


@contextlib.contextmanager
def refused(backend: BackendFacts, misuse: Misuse, where: str = "") -> Iterator[None]:
    """Expect the body to raise the refusal ``backend`` declares for ``misuse``; fail with what
    was raised (or ``DID NOT RAISE``) and what was declared otherwise. Where the backend declares
    the misuse :class:`Permitted`, the body must run through instead (the scenario then checks
    its values: :func:`permits`)."""
    declared = declared_refusal(backend, misuse)
    prefix = f"{where}: " if where else ""
    if isinstance(declared, Permitted):
        try:
            yield
        except Exception as error:
            raise AssertionError(
                f"{prefix}{misuse.value}: {backend.name} declares it {declared}, but it raised "
                f"{type(error).__name__}: {error}"
            ) from error
        return
    try:
        yield
    except Exception as error:
        problem = declared.mismatch(error)
        if problem is not None:
            raise AssertionError(f"{prefix}{misuse.value}: {backend.name} {problem}") from error
        return
    raise AssertionError(f"{prefix}{misuse.value}: DID NOT RAISE; {backend.name} declares {declared}")


def permits(backend: BackendFacts, misuse: Misuse) -> bool:
    """Whether ``backend`` declares ``misuse`` :class:`Permitted` (its values are then checked)."""
    return isinstance(declared_refusal(backend, misuse), Permitted)
