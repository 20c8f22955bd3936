"""The unshard-params and checkpoint scenarios catch defects of their kind (``unshard_checkpoint_mutants``).

For each backend, one test runs every catcher scenario once with the clean adapter (it must
pass: the failures below are the mutation's, not the scenario's) and then with each mutant (it
must fail on some rank, with the message that names the defect). Scenarios are called directly
in the ranks, as in test_mutants.py: no inner session, one warm pool, world size 2.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import unshard_checkpoint_mutants  # tests/conformance_tests/unshard_checkpoint_mutants.py

import conformance.test_checkpoint as checkpoint  # modules, so their tests are not collected here
import conformance.test_unshard_params as unshard
from conformance.protocol import BackendAdapter, BackendEnv
from conformance.suite import registry

Scenario = Callable[..., None]
# The cheapest variant of each scenario that exercises the checks a mutation breaks.
RESPECTS_RESHARD = (
    "test_unshard_respects_reshard[ws2-no_rank0_only-no_offload_to_cpu-fp32-orig_params]",
    functools.partial(
        unshard.test_unshard_respects_reshard,
        rank0_only=False,
        offload_to_cpu=False,
        mixed_precision=False,
        use_orig_params=True,
    ),
)
WRITEBACK = (
    "test_unshard_writeback[ws2-writeback-outer-fp32-no_param_offload-orig_params]",
    functools.partial(
        unshard.test_unshard_writeback,
        writeback=True,
        unit="outer",
        mixed_precision=False,
        param_offload=False,
        use_orig_params=True,
    ),
)
FULL_STATE_DICT = (
    "test_full_state_dict[ws2-root-no_param_offload]",
    functools.partial(checkpoint.test_full_state_dict, layout="root", param_offload=False),
)
# mutation -> (its catcher, what the failure must say, the backends it applies to)
CATCHERS: dict[str, tuple[tuple[str, Scenario], str, tuple[str, ...]]] = {
    # FSDP1's resharded flag is its storage, so it fails on the flag; the others only on the size.
    "leaked_unshard_buffer": (
        RESPECTS_RESHARD,
        r"unsharded storage per unit holds|unsharded per unit",
        ("reference", "torch-fsdp1", "torch-fsdp2"),
    ),
    # FSDP2 has no writeback (declared absent), so it has nothing to lose.
    "writeback_ignored": (
        WRITEBACK,
        r"rank \d: stored outer value is [23]\.0 after the context, expected 0\.0",
        ("reference", "torch-fsdp1"),
    ),
    "loaded_one_ulp_off": (
        FULL_STATE_DICT,
        r"loaded model vs the model saved from: .*\n.*: max abs difference [0-9.e-]+",
        ("reference", "torch-fsdp1", "torch-fsdp2"),
    ),
    "renamed_state_dict_key": (
        FULL_STATE_DICT,
        r"full state dict vs the unsharded model: keys missing \['[\w.]+'\], unexpected \['[\w.]*_wrapped_module",
        ("reference", "torch-fsdp1", "torch-fsdp2"),
    ),
}
assert set(CATCHERS) == set(unshard_checkpoint_mutants.MUTATIONS), "every mutation needs its catcher"
BACKENDS = ("reference", "torch-fsdp1", "torch-fsdp2")


def _failure(scenario: Scenario, adapter: BackendAdapter, **kwargs: object) -> str | None:
    """The scenario's assertion message on this rank, or None when it passed here (``kwargs``:
    the rank fixtures, of which each scenario takes those it names)."""
    takes = inspect.signature(scenario).parameters
    try:
        scenario(backend=adapter, **{name: value for name, value in kwargs.items() if name in takes})
    except AssertionError as error:
        return str(error)
    return None


# Not named `backend`: the conformance plugin parametrizes every test taking that argument.
@pytest.mark.world_size(2)
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_unshard_and_checkpoint_mutants_are_caught(
    backend_name: str, rank: int, world_size: int, device: torch.device
) -> None:
    base = registry.load(backend_name)
    env = BackendEnv(rank, world_size, device)
    kwargs = {"rank": rank, "world_size": world_size, "device": device}
    runs: dict[str, str | None] = {}
    for mutation, ((catcher, scenario), _pattern, backends) in CATCHERS.items():
        if backend_name not in backends:
            continue
        if f"clean {catcher}" not in runs:
            runs[f"clean {catcher}"] = _failure(scenario, base(env), **kwargs)
        runs[mutation] = _failure(scenario, unshard_checkpoint_mutants.mutant(base, mutation)(env), **kwargs)
    per_rank: list[dict[str, str | None]] = [{} for _ in range(world_size)]
    dist.all_gather_object(per_rank, runs)

    for name in runs:
        texts = [found[name] for found in per_rank if found[name] is not None]
        if name.startswith("clean "):
            assert not texts, f"{backend_name}: {name} fails without a mutation:\n" + "\n".join(texts)[-3000:]
            continue
        (catcher, _), pattern, _ = CATCHERS[name]
        what = f"{catcher} on {backend_name} with {unshard_checkpoint_mutants.MUTATIONS[name]}"
        assert texts, f"{what}: passed on every rank"
        assert any(re.search(pattern, text) for text in texts), (
            f"{what}: failed without saying /{pattern}/:\n" + "\n".join(texts)[-3000:]
        )
