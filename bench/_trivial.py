"""The trivial distributed test both sides of bench/harness_overhead.py run."""

import torch
import torch.distributed as dist


def trivial_test(rank: int) -> None:
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    assert tensor.item() == dist.get_world_size()
