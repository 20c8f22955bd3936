"""Same-shape divergence must not pass silently.

When ranks run sharded units in different orders and the units have equal flat sizes, every
all-gather and reduce-scatter still pairs up with one of the same size: no shape or size check
in the collective library fires, and each rank quietly receives pieces of the wrong parameters.

Contract of :func:`test_same_shape_divergence_is_not_silent`, for every backend, with nothing
asked of it beyond sharding (``check_exec_order`` left off, so this is what a user gets by
default):

* the backend raises ``RuntimeError("Forward order differs across ranks ...")`` on every
  rank (the error :mod:`conformance.test_exec_order` requires of an order check): **pass**;
* the step completes: the harness diffs the ranks' collective traces and **fails** the test
  with "ranks issued divergent collectives: collective #k ...". This scenario is deliberately
  *not* marked ``expect_divergence``: the trace diff is the detector of last resort;
* anything else (another error, a rank raising alone and the others timing out): **fail**.

A backend whose users are exposed to this records the failure in its expectations file.

:func:`test_unequal_shape_divergence_is_not_silent` runs the seed's own model
(:class:`fixtures.UnequalTwoPathModel`), where the two units' collectives differ in size once a
backend pads or aligns per parameter: a backend without a first-iteration check then issues
mismatched collectives, gloo aborts the process, and the harness turns the crash into this
test's failure (with the trace diff naming the collective). World size 2 only: each such crash
costs a pool restart, and a second world size adds nothing the first does not show.
"""

from __future__ import annotations

import re
from typing import ClassVar

import pytest
import torch
import torch.nn as nn

import fixtures
from conformance.protocol import ApiForm, BackendAdapter, ShardingSpec
from fixtures.models import SumLossMixin
from harness import current_seed

ORDER_ERROR = r"^Forward order differs across ranks"


class SwappableUnits(SumLossMixin, nn.Module):
    """A root ``stem`` and two units of 36 elements each, run in the order ``order`` says."""

    UNIT_FQNS: ClassVar[tuple[str, ...]] = ("first", "second")

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 6)
        self.first = nn.Linear(6, 6, bias=False)
        self.second = nn.Linear(6, 6, bias=False)
        self.order: tuple[str, ...] = self.UNIT_FQNS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        for name in self.order:
            x = torch.relu(getattr(self, name)(x))
        return x

    def example_input(self, generator: torch.Generator, batch_size: int) -> tuple[torch.Tensor]:
        return (torch.randn(batch_size, 6, generator=generator),)


def training_step(backend: BackendAdapter, form: ApiForm, rank: int, device: torch.device, *, crossed: bool) -> None:
    """One forward + backward of :class:`SwappableUnits` sharded by ``backend`` in ``form``.

    ``crossed``: rank 0 runs ``first`` then ``second``, every other rank ``second`` then
    ``first`` (same-sized units in a rank-dependent order); otherwise every rank runs
    ``first`` then ``second``.
    """
    model = fixtures.build(SwappableUnits, current_seed(), device)
    sharded = backend.shard(model, ShardingSpec(manual_units=SwappableUnits.UNIT_FQNS), form)
    if crossed and rank != 0:
        model.order = tuple(reversed(SwappableUnits.UNIT_FQNS))
    inputs = fixtures.local_batch(model, seed=current_seed(), iteration=0, rank=rank, batch_size=4, device=device)
    backend.backward(sharded, model.loss(sharded(*inputs)))


def _raise_unless_order_error(error: RuntimeError) -> None:
    if not re.match(ORDER_ERROR, str(error)):
        raise error


@pytest.mark.world_size(min=2, default=[2, 4])
def test_same_shape_divergence_is_not_silent(backend: BackendAdapter, rank: int, device: torch.device) -> None:
    """Ranks running equal-sized units in different orders are stopped or reported, per form.

    Passes when every rank raises the order error; a step that completes is failed by the
    harness's trace diff (see the module docstring for the full contract).
    """
    for form in backend.forms():
        try:
            training_step(backend, form, rank, device, crossed=True)
        except RuntimeError as error:
            _raise_unless_order_error(error)


@pytest.mark.world_size(min=2, default=2)
def test_unequal_shape_divergence_is_not_silent(backend: BackendAdapter, rank: int, device: torch.device) -> None:
    """The seed's model, default configuration: rank 0 runs ``path_a``, rank 1 ``path_b`` in
    the first step. Passes when every rank raises the order error before any mismatched
    collective; a crash or a hang fails it (module docstring)."""
    for form in backend.forms():
        model = fixtures.build(fixtures.UnequalTwoPathModel, current_seed(), device)
        sharded = backend.shard(model, ShardingSpec(manual_units=fixtures.UnequalTwoPathModel.UNIT_FQNS), form)
        if rank != 0:
            model.flip_path()
        inputs = fixtures.local_batch(model, seed=current_seed(), iteration=0, rank=rank, batch_size=4, device=device)
        try:
            backend.backward(sharded, model.loss(sharded(*inputs)))
        except RuntimeError as error:
            _raise_unless_order_error(error)
