"""Per-test isolation inside a warm rank: what a test may change is put back afterwards.

A warm worker runs many tests; each must start from the same state a fresh process would
give it, or results would depend on test order.
"""

from __future__ import annotations

import os
import random
import sys
import warnings
from contextlib import ExitStack
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.device_mesh as device_mesh
import torch.distributed.distributed_c10d as c10d

_current_seed = 0


def current_seed() -> int:
    """The seed the running test started with."""
    return _current_seed


def seed_everything(seed: int) -> None:
    """Same seed on every rank: ranks build identical models unless a test asks otherwise."""
    global _current_seed
    _current_seed = seed
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


def _clear_dtensor_caches() -> None:
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # older torch: no such cache to clear
        return
    _clear_sharding_prop_cache()


class TestIsolation:
    """Snapshot taken once per worker; `enter` before and `exit` after every test."""

    def __init__(self) -> None:
        self._debug_level = dist.get_debug_level()
        self._environ = dict(os.environ)
        self._cwd = os.getcwd()
        self._default_dtype = torch.get_default_dtype()
        self._groups_before: set[Any] = set()
        self._stack = ExitStack()

    def enter(self, seed: int) -> None:
        self._groups_before = set(c10d._world.pg_map)
        seed_everything(seed)
        torch.set_default_dtype(self._default_dtype)
        torch.set_grad_enabled(True)
        torch.use_deterministic_algorithms(False)
        dist.set_debug_level(self._debug_level)
        self._stack.enter_context(warnings.catch_warnings())
        warnings.resetwarnings()
        warnings.simplefilter("default")

    def exit(self) -> tuple[int, int]:
        """Undo the test's changes; return the sync state the parent compares across ranks."""
        self._stack.close()
        for group in [g for g in c10d._world.pg_map if g not in self._groups_before]:
            dist.destroy_process_group(group)
        _clear_dtensor_caches()  # a new mesh equal to a destroyed one must not resolve to its dead groups
        mesh_resources = getattr(device_mesh, "_mesh_resources", None)
        if mesh_resources is not None and hasattr(mesh_resources, "mesh_stack"):
            mesh_resources.mesh_stack.clear()
        if os.environ != self._environ:
            os.environ.clear()
            os.environ.update(self._environ)
        if os.getcwd() != self._cwd:
            os.chdir(self._cwd)
        # Both counters only grow over the worker's life, so ranks that report equal values have
        # issued as many default-group collectives and created as many groups as each other.
        default_group = c10d._get_default_group()
        return default_group._get_sequence_number_for_group(), c10d._world.group_count
