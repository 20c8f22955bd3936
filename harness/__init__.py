"""Warm multi-process pytest harness for distributed (SPMD) tests.

Public API for test authors: the `world_size` marker (sizes or constraints; `WorldShape` is what its
`exclude=` predicate receives) and the `fresh_world` marker, the rank-side fixtures `rank`,
`world_size`, `device`, and `rank_fixture` / `RankContext` to add more. Backends name the
collectives they issue (for the cross-rank trace diff) with `register_label_provider`. For the trace
diff, `name_tensor` names a tensor (or a module's parameters) a collective carries, `asymmetric()`
marks rank-conditional code whose call sites and tensors differ on purpose, and
`skip_call_sites_in` leaves a backend's own frames out of call sites; `collectives_issued()` counts
what a rank issued so far in the test. Report formats plug in through
the hooks of `harness.hookspecs`; `failure_reason` (one line that explains a failed test's text)
and `incomplete_reason` (why a session stopped before running every selected test) serve them.
"""

from harness.call_sites import asymmetric, skip_call_sites_in
from harness.isolation import current_seed, seed_everything
from harness.labels import register_label_provider
from harness.rank_fixtures import RankContext, rank_fixture
from harness.run_summary import incomplete_reason
from harness.run_summary import reason as failure_reason
from harness.tensor_names import name_tensor
from harness.world_sizes import WorldShape


def collectives_issued() -> int:
    """How many collectives this rank has issued (and the harness traced) in the running test so
    far; 0 outside a test. Compare two readings to learn whether the code between them
    communicated (the conformance suite's check that a backend did anything). Rank side only."""
    from harness import trace  # imported here: the pytest process never wraps torch.distributed

    return trace.recorded_count()


def rank_seed(offset: int = 0) -> int:
    """A seed that differs per rank, derived from the test's seed, for tests that want it."""
    import torch.distributed as dist

    return current_seed() + 1000 * dist.get_rank() + offset


__all__ = [
    "RankContext",
    "WorldShape",
    "asymmetric",
    "collectives_issued",
    "current_seed",
    "failure_reason",
    "incomplete_reason",
    "name_tensor",
    "rank_fixture",
    "rank_seed",
    "register_label_provider",
    "seed_everything",
    "skip_call_sites_in",
]
