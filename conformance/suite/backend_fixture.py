"""Rank-side fixtures of the conformance suite (listed in ``rank_fixture_modules``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

from conformance.protocol import BackendAdapter, BackendEnv
from conformance.suite import registry
from conformance.suite.vacuity import ShardWatch
from harness import RankContext, rank_fixture, register_label_provider


def _skip_adapter_call_sites(module: str) -> None:
    """Call sites in the trace name the scenario's line, not the adapter's nor the protocol's (the
    template methods and default hooks between a scenario and its backend, e.g. the default
    `backward`): the same on every rank, and the line a user can act on."""
    from harness import skip_call_sites_in

    skip_call_sites_in("conformance.protocol", module)
    if module.startswith("conformance.adapters."):
        skip_call_sites_in("conformance.adapters")


@rank_fixture
def backend(ctx: RankContext) -> Iterator[BackendAdapter]:
    """The adapter for this test's backend, built fresh for every test in every rank.

    For the test's duration the adapter's ``collective_label`` names the collectives in the
    harness's trace; afterwards its ``close`` runs (before the harness destroys the test's
    process groups) and the label provider is removed. A test that passed without making the
    adapter shard anything, or (world size > 1) without any sign that the backend sharded,
    fails (``conformance.suite.vacuity``).
    """
    selection = ctx.params.get("backend")
    if selection is None:
        raise LookupError(
            "this test takes `backend` but was not parametrized with one: load "
            "conformance.suite.backend_plugin (root conftest pytest_plugins) so --backend applies"
        )
    adapter_cls = registry.load(selection)
    _skip_adapter_call_sites(adapter_cls.__module__)
    adapter = adapter_cls(
        BackendEnv(rank=ctx.rank, world_size=ctx.world_size, device=ctx.device, local_rank=ctx.local_rank)
    )
    watch = ShardWatch(adapter)
    unregister = register_label_provider(adapter.collective_label)
    try:
        yield adapter
        # The runner finalises fixtures while the body's exception (a failure, a skip) is being
        # handled: none means the body passed.
        vacuous = watch.finding(body_passed=sys.exc_info()[1] is None)
    finally:
        try:
            adapter.close()
        finally:
            unregister()
    if vacuous is not None:
        raise vacuous
