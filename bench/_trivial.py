"""The trivial distributed test both sides of bench/harness_overhead.py run, and the no-op function
bench/spmd_call_overhead.py calls."""

import torch
import torch.distributed as dist


def trivial_test(rank: int) -> None:
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    assert tensor.item() == dist.get_world_size()


def noop() -> None:
    """The function bench/spmd_call_overhead.py calls on every rank: all its cost is the harness's."""
