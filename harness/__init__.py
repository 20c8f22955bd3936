"""Warm multi-process pytest harness for distributed (SPMD) tests.

Public API for test authors: the `world_size` marker (sizes or constraints; `WorldShape` is what its
`exclude=` predicate receives) and the `fresh_world` marker, the rank-side fixtures `rank`,
`world_size`, `device`, and `rank_fixture` / `RankContext` to add more. Backends name the
collectives they issue (for the cross-rank trace diff) with `register_label_provider`. Report
formats plug in through the hooks of `harness.hookspecs`.
"""

from harness.isolation import current_seed, seed_everything
from harness.labels import register_label_provider
from harness.rank_fixtures import RankContext, rank_fixture
from harness.world_sizes import WorldShape


def rank_seed(offset: int = 0) -> int:
    """A seed that differs per rank, derived from the test's seed, for tests that want it."""
    import torch.distributed as dist

    return current_seed() + 1000 * dist.get_rank() + offset


__all__ = [
    "RankContext",
    "WorldShape",
    "current_seed",
    "rank_fixture",
    "rank_seed",
    "register_label_provider",
    "seed_everything",
]
