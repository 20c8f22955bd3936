"""The suite catches broken backends: every mutation of ``mutant_backends`` fails its scenarios.

For each built-in backend and each mutation, the scenarios that must catch the mutation run in
the ranks, called directly with the mutant adapter (no inner session, no extra pool): each must
fail, on at least one rank, with a message naming a parameter and the size of its difference.
Scenarios run at world size 2 with FULL_SHARD over auto-wrapped units (reduce-scatter and
all-gather both in use), so a mutant costs about what one scenario costs. The unmutated
backends pass the same scenarios in the suite itself (``conformance/test_runtime.py``), which
is what makes the failures here the mutation's.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import mutant_backends  # tests/conformance_tests/mutant_backends.py
import pytest
import torch
import torch.distributed as dist

import conformance.test_runtime as runtime  # a module, so its tests are not collected here
import fixtures
from conformance.protocol import BackendAdapter, BackendEnv, ShardingStrategy
from conformance.suite import registry

Scenario = Callable[..., None]
SCENARIO_ARGS = {"wrap": "auto", "strategy": ShardingStrategy.FULL_SHARD, "param_offload": False}
TRAINING = (
    "test_training[ws2-auto-FULL_SHARD-sgd]",
    functools.partial(runtime.test_training, optimizer="sgd", **SCENARIO_ARGS),
)
AFTER_TRAINING = (
    "test_unshard_after_training[ws2-auto-FULL_SHARD-no_param_offload]",
    functools.partial(runtime.test_unshard_after_training, **SCENARIO_ARGS),
)
# The scenarios that must catch each mutation (every one of them must fail).
CATCHERS: dict[str, tuple[tuple[str, Scenario], ...]] = {
    "sum_grads": (TRAINING,),
    "doubled_reduce_scatter": (TRAINING,),
    "swapped_all_gather": (TRAINING, AFTER_TRAINING),
    "zeroed_all_gather": (TRAINING,),
    "stale_shard": (TRAINING, AFTER_TRAINING),
    "stale_unshard_view": (AFTER_TRAINING,),
}
PARAMETERS = frozenset(name for name, _ in fixtures.CompositeModel(dim=4).named_parameters())
# "  unit2.out.bias: max abs difference 0.0123 (relative 0.5) at index (3,)"
DIFFERENCE = re.compile(r"^\s+(?P<name>[\w.]+): max abs difference (?P<size>[0-9.e+-]+)", re.MULTILINE)
assert set(CATCHERS) == set(mutant_backends.MUTATIONS), "every mutation needs its catchers"


def _failure(scenario: Scenario, adapter: BackendAdapter, **kwargs: object) -> str | None:
    """The scenario's assertion message on this rank, or None when it passed here."""
    try:
        scenario(backend=adapter, **kwargs)
    except AssertionError as error:
        return str(error)
    return None


# Not named `backend`: the conformance plugin parametrizes every test taking that argument.
@pytest.mark.world_size(2)
@pytest.mark.parametrize("mutation", list(CATCHERS))
@pytest.mark.parametrize("backend_name", list(registry.BUILTIN))
def test_mutant_fails_naming_parameter_and_difference(
    backend_name: str, mutation: str, rank: int, world_size: int, device: torch.device
) -> None:
    mutant_cls = mutant_backends.mutant(registry.load(backend_name), mutation)
    failures = {}
    try:
        for name, scenario in CATCHERS[mutation]:
            adapter = mutant_cls(BackendEnv(rank, world_size, device))
            failures[name] = _failure(scenario, adapter, world_size=world_size, rank=rank, device=device)
    finally:
        mutant_backends.remove_step_hooks()  # a stale-shard hook must not outlive this test
    per_rank: list[dict[str, str | None]] = [{} for _ in range(world_size)]
    dist.all_gather_object(per_rank, failures)

    what = f"{backend_name} with {mutant_backends.MUTATIONS[mutation]}"
    for name, _ in CATCHERS[mutation]:
        texts = [found[name] for found in per_rank if found[name] is not None]
        assert texts, f"{name} passed on every rank for {what}"
        named = [
            (found["name"], float(found["size"]))
            for text in texts
            for found in DIFFERENCE.finditer(text)
            if found["name"] in PARAMETERS
        ]
        assert named and all(size > 0 for _, size in named), (
            f"{name} failed for {what} without naming a parameter and its difference:\n" + "\n".join(texts)[-4000:]
        )
