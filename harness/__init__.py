"""Warm multi-process pytest harness for distributed (SPMD) tests.

Public API for test authors: the `world_size` marker (sizes or constraints; `WorldShape` is what its
`exclude=` predicate receives) and the `fresh_world` marker, the rank-side fixtures `rank`,
`world_size`, `device`, and `rank_fixture` / `RankContext` to add more. Backends name the
collectives they issue (for the cross-rank trace diff) with `register_label_provider`. For the trace
diff, `name_tensor` names a tensor (or a module's parameters) a collective carries, `asymmetric()`
marks rank-conditional code whose call sites and tensors differ on purpose, and
`skip_call_sites_in` leaves a backend's own frames out of call sites; `collectives_issued()` counts
what a rank issued so far in the test; `set_interceptor` sees (or replaces) each traced collective
(a `CollectiveRecord`) as a rank issues it; `strip_path_components` sees a name through the path
components wrappers insert. Report formats plug in through the hooks of `harness.hookspecs`.

Public API for checks a test goes on past: `check(what)` (a context manager and a decorator)
marks one check of a test; when a plugin expects the test to fail with a text
(`pytest_harness_known_failures`) and the check's assertion fails with it, the rank records it and
the test goes on, ending in `KnownFailuresSeen`; a later failure no expected text names fails as
`DefectBehindKnownFailure` (its text carries `DEFECT_BEHIND_KNOWN_FAILURE`). Without expected
texts a check does nothing (docs/harness.md, "Checks a test goes on past").

Public API for replica drift (ranks whose replicated parameters or buffers differ, with every
collective matched): the `check_replicas` marker and `--check-replicas` compare, after a test,
what its models keep replicated (without a collective: each rank digests locally, the parent
compares); `replicated(model, group)` names a plain model replicated for that check;
`check_replicas(model, group)` compares now, on every rank (one all-gather; in a test or a plain
torchrun script) and raises `ReplicaDrift` on every rank when replicas differ. For a caller that
collects the ranks' digests itself (through files): `replica_snapshot(modules, group)` is this
rank's `ReplicaSnapshot` (`to_dict()` / `ReplicaSnapshot.from_dict`), `compare_replicas({rank:
snapshot})` the `DriftReport` or None (docs/harness.md, "Replica drift").

Public API for parent-side SPMD calls (a test that runs in the pytest process, e.g. a Hypothesis
test, running a function on the ranks): the `spmd_world` fixture gives `spmd_world(n)`, an
`SpmdWorld` of n ranks on the session's device, served by the same warm pool as the distributed
tests of that size. `SpmdWorld.run(fn, args, kwargs, timeout_s=, trace=, isolate=, seed=)` calls a
module-level function on every rank and returns an `SpmdResult` (each rank's value or failure
text, the rank that failed first, the first divergent collective, whether the pool was restarted);
`SpmdWorld.call(fn, *args, **kwargs)` returns the values in rank order or raises `SpmdCallFailed`.
Inside the function, `call_context()` is the rank's `RankContext`. A call that fails, hangs or
kills a rank fails only that call, and the next call gets fresh ranks (docs/harness.md,
"Parent-side SPMD calls").

Public API for other pytest plugins (the conformance suite uses nothing else of the harness):
`run_context(item)` (the world size and device the harness chose for a test, a `RunContext`),
`world_device(config, world_size)` and `device_kinds(config)` (the same decision before any test
runs), `reports_dir(config)` (where reports go), `require_writable` (refuse, before the first test,
report paths that could not be written), `failure_reason` (one line that explains a failed test:
a `DistributedTestResult.reason`, else the first line of the failure's text) and
`incomplete_reason` (why a session stopped before running every selected test), and `Carried` /
`NotCarried` / `ReproPolicy` for the `pytest_harness_repro_options` hook, and `RankModules` for the
`pytest_harness_rank_modules` hook (the rank fixture, label provider and preload modules a plugin's
tests need in every rank, so that an installed plugin needs no ini lines). Report plugins receive a
`DistributedTestResult` per test (`pytest_harness_test_result`); `trace_cells` gives a trace
record's cells as the harness's trace tables show them, and `trace_report_file(config, nodeid)`
the trace file the harness wrote for a test.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

from harness.config.devices import RunContext
from harness.config.preflight import require_writable
from harness.config.rank_modules import RankModules
from harness.config.repro import Carried, NotCarried, ReproPolicy
from harness.config.world_sizes import WorldShape, world_size_of
from harness.rank.call_sites import asymmetric, skip_call_sites_in
from harness.rank.isolation import current_seed, seed_everything
from harness.rank.known_checks import DEFECT_BEHIND_KNOWN_FAILURE, DefectBehindKnownFailure, KnownFailuresSeen, check
from harness.rank.labels import register_label_provider
from harness.rank.rank_fixtures import RankContext, call_context, rank_fixture
from harness.rank.tensor_names import name_tensor, strip_path_components
from harness.report.results import DistributedTestResult, skip_reason
from harness.report.run_summary import failure_reason, incomplete_reason
from harness.report.trace_tables import written_trace_file
from harness.trace.checksums import DriftReport, ReplicaDrift, ReplicaReport, ReplicaSnapshot
from harness.trace.checksums import compare as compare_replicas
from harness.trace.divergence import trace_cells
from harness.trace.records import CollectiveRecord


def collectives_issued() -> int:
    """How many collectives this rank has issued (and the harness traced) in the running test so
    far; 0 outside a test. Compare two readings to learn whether the code between them
    communicated (the conformance suite's check that a backend did anything). Rank side only."""
    from harness.rank import tracing  # imported here: the pytest process never wraps torch.distributed

    return tracing.recorded_count()


if TYPE_CHECKING:
    from collections.abc import Iterable

    import pytest
    import torch
    import torch.distributed as dist

    from harness.rank.tracing import Interceptor
    from harness.session.spmd import SpmdCallFailed, SpmdResult, SpmdWorld

# Parent-side names reached lazily (`__getattr__`): ranks import this package, and never load the pool.
_SPMD_NAMES = ("SpmdCallFailed", "SpmdResult", "SpmdWorld")


# The plugin functions are reached lazily: ranks import this package, and never need the parent's
# plugin (which brings the pool and the reports along).
def run_context(item: pytest.Item) -> RunContext:
    """The world size and device the harness chose for `item`: the ones its ranks run with
    (`device` None when it lacks its GPUs and is skipped; `world_size` None without ranks)."""
    from harness import plugin

    return plugin.run_context(item)


def ranks_stderr(item: pytest.Item) -> dict[int, str]:
    """What each rank wrote to stderr while it ran `item` (the tail the harness captured), by rank;
    readable in a plugin's `pytest_runtest_makereport` of the call phase (empty for a test without
    ranks). A rank that died in C++ (a gloo abort) says why there, not in a Python exception."""
    from harness import plugin

    return plugin.ranks_stderr(item)


def world_device(config: pytest.Config, world_size: int | None = None) -> str | None:
    """The device kind ("cpu", "cuda") a world of `world_size` ranks gets in this session, None
    when it cannot be had; by default the session's smallest world (one rank; under torchrun the
    torchrun world). The same decision `run_context` reports per test."""
    from harness import plugin

    return plugin.world_device(config, world_size)


def device_kinds(config: pytest.Config) -> tuple[str, ...]:
    """Every device kind this session's worlds may get (`--device auto` with GPUs: both)."""
    from harness import plugin

    return plugin.device_kinds(config)


def reports_dir(config: pytest.Config) -> str:
    """The directory this session writes its reports to (`--reports-dir`, default `reports/` in the
    directory pytest was started from)."""
    from harness import plugin

    return plugin.reports_dir(config)


def set_interceptor(interceptor: Interceptor | None) -> None:
    """Install the one collective interceptor of this rank (None removes it): it sees each traced
    collective's `CollectiveRecord` before the call and returns None to let it run as usual (or
    a runner that issues it its own way; `harness.rank.faults` is built on it). Rank side only."""
    from harness.rank import tracing  # imported here: the pytest process never wraps torch.distributed

    tracing.set_interceptor(interceptor)


def __getattr__(name: str) -> ModuleType | type:
    """`from harness import faults`: fault injection for scenarios and users (`harness.rank.faults`),
    imported on first use because it sits in the rank-side trace wrapper, which the pytest
    process never loads. `SpmdWorld`, `SpmdResult`, `SpmdCallFailed` (`harness.session.spmd`):
    imported on first use because they bring the parent's pool along, which ranks never load."""
    if name == "faults":
        from harness.rank import faults

        return faults
    if name in _SPMD_NAMES:
        from harness.session import spmd

        found: type = getattr(spmd, name)
        return found
    raise AttributeError(f"module 'harness' has no attribute {name!r}")


def check_replicas(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> ReplicaReport:
    """Compare what `model` keeps replicated across the ranks of `group` (default: the world), now:
    call it on every rank. One all-gather of the ranks' digests; raises `ReplicaDrift` (the same
    message on every rank: each drifting tensor's FQN, each rank's value, the first optimizer step
    it differed at where known) or returns the `ReplicaReport`. Rank side (any process of a
    torch.distributed world)."""
    from harness.rank import replicas

    return replicas.check_replicas(model, group)


def replicated(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Name `model` replicated over `group` (default: the world) for the running test's replica
    check (`check_replicas` marker, `--check-replicas`): its plain parameters and buffers are then
    compared after the body. Does nothing where no check runs. Rank side."""
    from harness.rank import replicas

    replicas.replicated(model, group)


def replica_snapshot(
    modules: torch.nn.Module | Iterable[torch.nn.Module], group: dist.ProcessGroup | None = None
) -> ReplicaSnapshot:
    """This rank's digests of what `modules` keep replicated, locally (no collective): compare the
    ranks' snapshots with `compare_replicas` wherever they were collected. Rank side."""
    from harness.rank import replicas

    return replicas.snapshot(modules, group)


def trace_report_file(config: pytest.Config, nodeid: str) -> str | None:
    """The collective-trace file (`reports/traces/<test>.txt`) the harness wrote for `nodeid` in
    this session; None when it wrote none. Ask after the test's `pytest_harness_test_result`
    (e.g. in `pytest_harness_write_reports`)."""
    return written_trace_file(config, nodeid)


def rank_seed(offset: int = 0) -> int:
    """A seed that differs per rank, derived from the test's seed, for tests that want it."""
    import torch.distributed as dist

    return current_seed() + 1000 * dist.get_rank() + offset


__all__ = [
    "DEFECT_BEHIND_KNOWN_FAILURE",
    "Carried",
    "CollectiveRecord",
    "DefectBehindKnownFailure",
    "DistributedTestResult",
    "DriftReport",
    "KnownFailuresSeen",
    "NotCarried",
    "RankContext",
    "RankModules",
    "ReplicaDrift",
    "ReplicaReport",
    "ReplicaSnapshot",
    "ReproPolicy",
    "RunContext",
    "SpmdCallFailed",
    "SpmdResult",
    "SpmdWorld",
    "WorldShape",
    "asymmetric",
    "call_context",
    "check",
    "check_replicas",
    "collectives_issued",
    "compare_replicas",
    "current_seed",
    "device_kinds",
    "failure_reason",
    "incomplete_reason",
    "name_tensor",
    "rank_fixture",
    "rank_seed",
    "ranks_stderr",
    "register_label_provider",
    "replica_snapshot",
    "replicated",
    "reports_dir",
    "require_writable",
    "run_context",
    "seed_everything",
    "set_interceptor",
    "skip_call_sites_in",
    "skip_reason",
    "strip_path_components",
    "trace_cells",
    "trace_report_file",
    "world_device",
    "world_size_of",
]
