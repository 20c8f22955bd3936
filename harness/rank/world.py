"""Joining the world, in a rank: its device, and its default process group on that device.

Both ways of running ranks use it: a pool rank (`harness.rank.worker`, rendezvous through the
pool's FileStore) and a torchrun worker (`harness.session.torchrun_session`, `env://`). Which device kind
a world gets is decided before any rank exists (`harness.config.devices`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from harness.messages import DeviceKind, comm_backend


def rank_device(kind: DeviceKind, local_rank: int) -> torch.device:
    """The device of the rank with this index on its host: its own GPU, or the CPU."""
    return torch.device(f"cuda:{local_rank}") if kind == "cuda" else torch.device("cpu")


def join_world(device: torch.device, collective_timeout_s: float, **rendezvous: Any) -> None:
    """Initialise this rank's default process group on `device`: NCCL bound to its GPU (made the
    current device first, and passed as `device_id` so NCCL connects eagerly), gloo on CPU.

    `rendezvous`: how the ranks find each other (`store=`, `rank=`, `world_size=` for a pool's
    FileStore; `init_method="env://"` under torchrun), passed to `init_process_group` as is. A
    process that joined already (a torchrun script's own code before pytest) keeps its group; only
    the current device is set.
    """
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    if dist.is_initialized():
        return
    dist.init_process_group(
        comm_backend(device.type),
        timeout=timedelta(seconds=collective_timeout_s),
        **rendezvous,
        **kwargs,
    )
