"""Storage scenarios: every rank stores what its strategy claims, at every phase of a step.

A strategy is a claim about memory (``conformance.protocol.storage.STORAGE_CLAIMS``): FULL_SHARD
keeps each rank's share of parameters, gradients and optimizer state; ZeRO-1 keeps parameters
and gradients whole and only the optimizer state sharded; NO_SHARD keeps everything whole. A
backend whose training is right but which replicates what it claims to shard (plain DDP with an
unsharded optimizer, declaring ZeRO-1) passes every oracle comparison; it fails here, with the
numbers.

For every strategy the backend declares, with a unit-less plan (the root is the only unit, as
ZeRO has it) and with auto-wrapped units where the backend has them, two Adam steps run through
the adapter and the claim is checked

- in forward (inside each leaf module's forward, read-only): what the module computes with is
  whole on this rank. Each of its parameters is either stored whole (``local_shard`` holds all
  of it: FSDP's and DeepSpeed's gathered parameters) or read whole by the forward (a tensor of
  the parameter's shape whose local part has all its elements is passed to a torch function
  while the forward runs: a backend that keeps the shard stored and computes with a gathered
  temporary, as a per-parameter DTensor design whose parametrization all-gathers does). A
  backend that computes with its shard (a sharded DTensor, a slice) shows neither and fails.
  For a strategy that shards parameters, the running unit's unsharded storage also holds at
  least the module's elements (``unsharded_storage_numel``, where the backend declares
  ``INTROSPECT_STORAGE``);
- between forward and backward, after backward and at rest after the step: parameters
  (``local_shard``), gradients (``local_grad_shard``, after backward and after the step) and
  optimizer state (``local_optim_state``, once the optimizer has stepped).

Per parameter (per state tensor), what the ranks of one shard group store together must be a
share, between ``numel`` and ``numel + group size - 1`` elements (``share_bounds``), or, for a
whole claim, all of it on every rank. Between forward and backward the claim is for units below
the root: a root unit may keep what it gathered for backward. Flat parameters
(``use_orig_params=False``) are left to the layout checks of ``test_unshard_params``, which
know each flat buffer's exact size; here every name is an original parameter.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import pytest
import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

import fixtures
from conformance.programs.storage_probe import StorageProbe
from conformance.protocol import (
    BackendAdapter,
    Capability,
    Holding,
    Phase,
    ShardingStrategy,
    Stored,
    declared_fqn,
    storage_claim,
    stored_elements,
)
from conformance.scenario_specs import spec_with_mesh
from harness import WorldShape, current_seed

STEPS = 2
LOCAL_BATCH = 2
# Adam: per-parameter state tensors (exp_avg, exp_avg_sq) for the optimizer-state claim.
OPTIMIZER = functools.partial(torch.optim.Adam, lr=1e-3)
DIM = 16  # small: the claim is about counts, not arithmetic
# A parameter read in forward is told by its shape: no activation may have DIM rows.
assert LOCAL_BATCH != DIM


def _world_sizes(world: WorldShape, params: Mapping[str, object]) -> str | None:
    """World size 2 for every strategy but HYBRID_SHARD, which needs two shard groups of two."""
    strategy = params.get("strategy")
    if strategy is ShardingStrategy.HYBRID_SHARD:
        return fixtures.hybrid_shard_exclusion(world.size, world.local_size)
    if world.size != 2:
        return "the claims of a world-sharded strategy show at world size 2"
    return None


def _spec(backend: BackendAdapter, plan: str, strategy: ShardingStrategy, world_size: int, device: torch.device):
    return spec_with_mesh(
        backend,
        world_size,
        device,
        strategy=strategy,
        auto_wrap_classes=(fixtures.Unit,) if plan == "units" else (),
    )


def _unit_of(module_fqn: str, plan: str) -> str:
    """The unit whose forward runs a module: its ``Unit`` ancestor with units, else the root."""
    if plan == "units":
        for unit in fixtures.CompositeModel.UNIT_FQNS:
            if module_fqn == unit or module_fqn.startswith(unit + "."):
                return unit
    return ""


@pytest.mark.world_size(min=2, default=[2, 4], exclude=_world_sizes)
@pytest.mark.parametrize("plan", ["whole_model", "units"])
@pytest.mark.parametrize("strategy", list(ShardingStrategy), ids=lambda s: s.name)
def test_storage_claim(
    backend: BackendAdapter,
    strategy: ShardingStrategy,
    plan: str,
    world_size: int,
    rank: int,
    device: torch.device,
) -> None:
    """Parameters, gradients and optimizer state are stored as the strategy claims, at every
    phase of two Adam steps, in every form (see the module docstring)."""
    spec = _spec(backend, plan, strategy, world_size, device)
    claim = storage_claim(strategy)
    forward_check = backend.supports(Capability.INTROSPECT_STORAGE)
    seed = current_seed()
    problems: list[str] = []
    for form in backend.forms():
        model = fixtures.build(fixtures.CompositeModel, seed, device, dim=DIM)
        numels = {name: param.numel() for name, param in model.named_parameters()}
        shapes = {name: tuple(param.shape) for name, param in model.named_parameters()}
        sharded = backend.shard(model, spec, form)
        names = {declared_fqn(backend, name) for name, _ in sharded.named_parameters()}
        assert set(numels) <= names, (
            f"{form.value} form: the sharded model lacks parameters {sorted(set(numels) - names)}; "
            f"it has {sorted(names)}"
        )
        where = f"{strategy.name} ({plan}, {form.value} form)"
        probe = StorageProbe(backend, sharded, spec, numels, rank=rank, world_size=world_size, where=where)
        in_forward: list[str] = []
        # Inside forward proper: the module's forward method is wrapped, so the check runs after
        # every pre-forward hook (where a backend such as DeepSpeed ZeRO-3 gathers) and before
        # every post-forward hook (where it frees).
        watched = [
            _watch_forward(
                module,
                functools.partial(
                    _check_in_forward,
                    backend,
                    sharded,
                    numels,
                    shapes,
                    declared_fqn(backend, name),
                    _unit_of(declared_fqn(backend, name), plan),
                    # A shard group of one rank (HYBRID_SHARD on a (2, 1) mesh) shards nothing.
                    forward_check and probe.group_size > 1 and claim.parameters[Phase.AT_REST] is Holding.SHARDED,
                    in_forward,
                    where,
                ),
            )
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear)
        ]
        units_below_root = frozenset(name for name in numels if _unit_of(name.rsplit(".", 1)[0], plan))
        root_params = frozenset(numels) - units_below_root
        optimizer = backend.make_optimizer(sharded, OPTIMIZER)
        probe.check(Stored.PARAMETERS, Phase.AT_REST)
        for step in range(STEPS):
            probe.step = step
            inputs = fixtures.local_batch(
                model, seed=seed, iteration=step, rank=rank, batch_size=LOCAL_BATCH, device=device
            )
            backend.zero_grad(sharded, optimizer)
            loss = model.loss(sharded(*inputs))
            probe.check(Stored.PARAMETERS, Phase.BETWEEN_FORWARD_AND_BACKWARD, exempt=root_params)
            backend.backward(sharded, loss)
            probe.check(Stored.PARAMETERS, Phase.AFTER_BACKWARD)
            probe.check(Stored.GRADIENTS, Phase.AFTER_BACKWARD)
            backend.step(sharded, optimizer)
            for stored in Stored:
                probe.check(stored, Phase.AT_REST, optimizer=optimizer)
        for module in watched:
            del module.forward  # the class's forward again
        problems += probe.problems + in_forward
    assert not problems, f"rank {rank}: storage differs from what the strategy claims:\n" + "\n".join(problems)


def _watch_forward(module: nn.Module, check: Callable[..., object]) -> nn.Module:
    """Run every call of ``module``'s own forward through ``check(module, run, inputs)``, which
    calls ``run()`` (the forward proper) and returns its output."""
    forward = module.forward

    def checked_forward(*args: object, **kwargs: object) -> object:
        return check(module, functools.partial(forward, *args, **kwargs), (args, kwargs))

    module.forward = checked_forward  # an instance attribute: nn.Module.__call__ calls it
    return module


def _local_numel(tensor: torch.Tensor) -> int:
    """Elements of ``tensor`` on this rank (a DTensor's local part)."""
    local = getattr(tensor, "_local_tensor", None)  # DTensor; an attribute read, no dispatch
    return (local if isinstance(local, torch.Tensor) else tensor).numel()


class ForwardReads(TorchFunctionMode):
    """What a forward computes with: the shape and local element count of every tensor passed
    to a torch function while the mode is active, the forward's own inputs left out.

    A function mode sees every ``torch.*`` / ``F.*`` call and tensor method, whatever tensor
    type takes part (plain, Parameter, DTensor), so a parameter a backend gathers into a
    temporary (a parametrization, a property, a pre-forward hook's plain tensor) is seen where
    the forward hands it to ``F.linear``."""

    def __init__(self, inputs: object) -> None:
        super().__init__()
        self._inputs = {id(leaf) for leaf in tree_leaves(inputs) if isinstance(leaf, torch.Tensor)}
        self.reads: set[tuple[tuple[int, ...], int]] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        # torch pops this mode while its handler runs: reading shapes here records nothing.
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and id(leaf) not in self._inputs:
                self.reads.add((tuple(leaf.shape), _local_numel(leaf)))
        return func(*args, **kwargs)


def _check_in_forward(
    backend: BackendAdapter,
    sharded: nn.Module,
    numels: dict[str, int],
    shapes: dict[str, tuple[int, ...]],
    module_fqn: str,
    unit: str,
    unit_storage_known: bool,
    problems: list[str],
    where: str,
    module: nn.Module,
    run: Callable[[], object],
    inputs: object,
) -> object:
    """Inside a leaf module's forward, this rank computes with the module's parameters whole,
    whatever the strategy keeps at rest: each is stored whole (``local_shard`` shows all of it)
    or read whole (a tensor of its shape with all its elements on this rank reaches a torch
    function during the forward: a gathered temporary). Where the backend reports its unsharded
    storage (``INTROSPECT_STORAGE``), the running unit also has at least those elements
    allocated (a unit of FSDP gathers all of its parameters, DeepSpeed ZeRO-3 those of the
    running module; either holds these). Reads only, no collective. Runs the forward (``run``)
    and returns its output.

    A tensor is told for a parameter by its shape, which is unambiguous in this scenario's
    model: every activation has the batch dimension (``LOCAL_BATCH`` rows, never ``DIM``)."""
    own = [f"{module_fqn}.{name}" for name, _ in module.named_parameters(recurse=False)]
    counts = stored_elements(backend, sharded, Stored.PARAMETERS, own)
    if unit_storage_known:
        needed = sum(numels[fqn] for fqn in own)
        allocated = backend.unsharded_storage_numel(sharded, unit)
        if allocated < needed:
            problems.append(
                f"{where}, {Phase.FORWARD.value} of {module_fqn!r}: unit {unit or '(root)'!r} has {allocated} "
                f"elements of unsharded storage allocated, fewer than the {needed} of the module's own "
                "parameters it is computing with"
            )
    with ForwardReads(inputs) as observed:
        output = run()
    for fqn, count in counts.items():
        expected, shape = numels[fqn], shapes[fqn]
        if count == expected or (shape, expected) in observed.reads:
            continue
        same_shape = sorted(local for read_shape, local in observed.reads if read_shape == shape)
        read = (
            f"tensors of its shape {list(shape)} with {same_shape} elements on this rank"
            if same_shape
            else f"no tensor of its shape {list(shape)}"
        )
        problems.append(
            f"{where}, {Phase.FORWARD.value} of {module_fqn!r}: this rank stores {count} of the {expected} "
            f"elements of {fqn!r} and its forward read {read}: it computes with a parameter it has not "
            "gathered whole (neither stored whole nor read whole as a temporary)"
        )
    return output
