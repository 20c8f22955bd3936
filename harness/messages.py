"""Typed messages between the pytest parent and its rank workers.

The parent and a worker talk over a pair of pipes with pickled instances of these classes and
nothing else, so the whole protocol is visible in this one module.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

RankStatus = Literal["passed", "failed", "skipped", "xfailed"]


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a fresh worker needs to join its world; sent once, first thing."""

    rank: int
    world_size: int
    local_rank: int
    device_kind: Literal["cpu", "cuda"]
    store_host: str
    store_port: int
    collective_timeout_s: float
    run_dir: str
    sys_path: list[str]
    rank_fixture_modules: tuple[str, ...]
    label_providers: tuple[str, ...] = ()


@dataclass(frozen=True)
class WorkerReady:
    """A worker's answer to its config: the process group is up."""

    rank: int
    pid: int
    device: str


@dataclass(frozen=True)
class TestTask:
    """One distributed test to run on every rank of the pool."""

    nodeid: str
    module_name: str
    module_file: str
    qualname: str
    call_kwargs: dict[str, Any]
    rank_fixture_names: tuple[str, ...]
    params: dict[str, Any]
    seed: int
    options: dict[str, Any]
    sys_path: list[str]


@dataclass
class RankOutcome:
    """What one rank reports after running a task.

    `sync_state` is (default-group collective sequence number, process groups created so far):
    when every rank reports the same pair, no collective is left half-issued and the pool can
    be reused even after a failure.
    """

    rank: int
    status: RankStatus
    duration_s: float
    summary: str = ""
    traceback: str = ""
    sync_state: tuple[int, int] = (0, 0)
    injected_faults: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Shutdown:
    """Ask a worker to leave its process group and exit."""
