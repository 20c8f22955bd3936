"""Rank-side fixtures of the conformance suite (listed in ``rank_fixture_modules``)."""

from __future__ import annotations

from harness import RankContext, rank_fixture

from conformance import registry
from conformance.protocol import BackendAdapter, BackendEnv


@rank_fixture
def backend(ctx: RankContext) -> BackendAdapter:
    """The adapter for this test's backend, built fresh for every test in every rank."""
    selection = ctx.params.get("backend")
    if selection is None:
        raise LookupError(
            "this test takes `backend` but was not parametrized with one: load "
            "conformance.plugin (root conftest pytest_plugins) so --backend applies"
        )
    adapter_cls = registry.load(selection)
    return adapter_cls(BackendEnv(rank=ctx.rank, world_size=ctx.world_size, device=ctx.device))
