"""Rank-side fixtures of the conformance suite (listed in ``rank_fixture_modules``)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import torch

from conformance.protocol import BackendAdapter, BackendEnv
from conformance.suite import registry
from conformance.suite.vacuity import ShardWatch
from harness import RankContext, rank_fixture, register_label_provider, skip_call_sites_in

# The suite's own code: a backend declaring one of these would hide the scenarios' lines too.
_SUITE_PACKAGES = ("conformance", "harness", "fixtures")


def _skip_adapter_call_sites(adapter_cls: type[BackendAdapter]) -> None:
    """Call sites in the trace name the scenario's line, not the adapter's (its module and those of
    the adapter classes it builds on, e.g. the template's) nor the protocol's (the template
    methods and default hooks between a scenario and its backend, e.g. the default `backward`) nor
    the suite's watch on the adapter's calls (conformance.suite.vacuity): the same on every rank,
    and the line a user can act on. For every test of the rank's life."""
    modules = [klass.__module__ for klass in adapter_cls.__mro__ if klass not in BackendAdapter.__mro__]
    skip_call_sites_in("conformance.protocol", "conformance.suite.vacuity", *dict.fromkeys(modules))
    if any(module.startswith("conformance.adapters.") for module in modules):
        skip_call_sites_in("conformance.adapters")


def skip_backend_call_sites(adapter_cls: type[BackendAdapter]) -> Callable[[], None]:
    """Leave the backend library's declared packages (``BACKEND_MODULES``) out of call sites for
    one test, so a collective the library issues is named by the scenario line that called into
    it; returns what takes them back (the next test may run another backend in this rank)."""
    declared = tuple(adapter_cls.BACKEND_MODULES)
    covering = [name for name in declared if name.split(".")[0] in _SUITE_PACKAGES]
    if covering:
        raise ValueError(
            f"{adapter_cls.__name__}.BACKEND_MODULES names {covering}, the conformance suite's own code: "
            "its frames would hide the scenarios' lines from the collective trace; name only the "
            "packages of the backend library (e.g. ('deepspeed',))"
        )
    try:
        return skip_call_sites_in(*declared)
    except ValueError as error:
        raise ValueError(
            f"{adapter_cls.__name__}.BACKEND_MODULES = {declared!r}: {error} (declare the import names "
            "of the backend library's packages, e.g. ('deepspeed',))"
        ) from None


@contextlib.contextmanager
def opened_backend(
    selection: str, *, rank: int, world_size: int, device: torch.device, local_rank: int
) -> Iterator[tuple[BackendAdapter, ShardWatch]]:
    """The adapter of ``selection`` for one test or one generated program, with what the suite
    does around it: for its duration the adapter's ``collective_label`` names the collectives in
    the harness's trace and the library packages it declares (``BACKEND_MODULES``) are left out
    of their call sites; afterwards its ``close`` runs and both are taken back. The
    :class:`ShardWatch` says whether what ran was vacuous (``finding``, before the exit)."""
    adapter_cls = registry.adapter_class(selection)  # from its resolved target: no name looked up again
    _skip_adapter_call_sites(adapter_cls)
    take_back_backend_sites = skip_backend_call_sites(adapter_cls)
    try:
        adapter = adapter_cls(BackendEnv(rank=rank, world_size=world_size, device=device, local_rank=local_rank))
    except BaseException:
        take_back_backend_sites()
        raise
    watch = ShardWatch(adapter)
    unregister = register_label_provider(adapter.collective_label)
    try:
        yield adapter, watch
    finally:
        try:
            adapter.close()
        finally:
            unregister()
            take_back_backend_sites()


@rank_fixture
def backend(ctx: RankContext) -> Iterator[BackendAdapter]:
    """The adapter for this test's backend, built fresh for every test in every rank.

    For the test's duration the adapter's ``collective_label`` names the collectives in the
    harness's trace, and the library packages it declares (``BACKEND_MODULES``) are left out of
    their call sites; afterwards its ``close`` runs (before the harness destroys the test's
    process groups), and the label provider and the packages are taken back
    (:func:`opened_backend`). A test that passed without making the adapter shard anything, or
    (world size > 1) without any sign that the backend sharded, fails
    (``conformance.suite.vacuity``).
    """
    selection = ctx.params.get("backend")
    if selection is None:
        raise LookupError(
            "this test takes `backend` but was not parametrized with one: the conformance plugin "
            "(conformance.suite.backend_plugin, loaded by the installed package's pytest11 entry point) "
            "is disabled in this session; drop -p no:conformance.suite.backend_plugin so --backend applies"
        )
    vacuous = None
    with opened_backend(
        selection, rank=ctx.rank, world_size=ctx.world_size, device=ctx.device, local_rank=ctx.local_rank
    ) as (adapter, watch):
        yield adapter
        # The runner finalises fixtures while the body's exception (a failure, a skip) is being
        # handled: none means the body passed.
        vacuous = watch.finding(body_passed=sys.exc_info()[1] is None)
    if vacuous is not None:
        raise vacuous
