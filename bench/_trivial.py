"""The trivial distributed test both sides of bench/harness_overhead.py run (and the `TestTask` that
dispatches it, which bench/spmd_call_overhead.py also runs as its anchor), and the no-op function
bench/spmd_call_overhead.py calls."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from harness.messages import TestTask


def trivial_test(rank: int) -> None:
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    assert tensor.item() == dist.get_world_size()


def noop() -> None:
    """The function bench/spmd_call_overhead.py calls on every rank: all its cost is the harness's."""


def trivial_task() -> TestTask:
    """`trivial_test` as the pytest plugin hands a test to `WorkerPool.run`, with this process's sys.path."""
    # Imported here, in the parent: the ranks import this module for `trivial_test` alone.
    from harness.messages import TestTask

    return TestTask(
        nodeid="bench::trivial_test",
        module_name="_trivial",
        module_file=str(Path(__file__).resolve()),
        qualname="trivial_test",
        call_kwargs={},
        rank_fixture_names=("rank",),
        params={},
        seed=0,
        options={},
        sys_path=list(sys.path),
    )
