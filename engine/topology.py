"""Which ranks a unit shards over and which it replicates over."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from engine.config import ShardingStrategy


@dataclass
class Topology:
    """Process groups of one sharding application.

    `shard_group` is None when each rank holds every parameter (NO_SHARD, SHARD_OPTIM_STATE,
    SHARD_GRAD_AND_OPTIM_STATE, or a shard group of one); `replicate_group` is None when there is
    nothing to all-reduce across.  `optim_group` / `optim_size` / `optim_rank`: the ranks
    SHARD_OPTIM_STATE partitions optimizer state over, and SHARD_GRAD_AND_OPTIM_STATE its
    gradients too (None / 1 / 0 for every other strategy, whose state follows the parameters).
    """

    shard_group: dist.ProcessGroup | None
    replicate_group: dist.ProcessGroup | None
    shard_size: int
    shard_rank: int
    dp_world_size: int
    check_group: dist.ProcessGroup | None  # every data-parallel rank; for exec-order checks
    mesh: DeviceMesh | None  # (shard,) or (replicate, shard); built on demand for DTensors
    optim_group: dist.ProcessGroup | None = None
    optim_size: int = 1
    optim_rank: int = 0

    def shard_mesh(self, device: torch.device) -> DeviceMesh:
        """The mesh sharded state dicts are placed on."""
        if self.mesh is None:
            group = self.shard_group if self.shard_group is not None else self.check_group
            self.mesh = DeviceMesh.from_group(group or dist.group.WORLD, device.type)
        return self.mesh


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh `mesh` was sliced from (itself when it was not sliced)."""
    if hasattr(mesh, "_get_root_mesh"):
        return mesh._get_root_mesh()
    from torch.distributed.device_mesh import _mesh_resources  # torch < 2.13

    return _mesh_resources.get_root_mesh(mesh)


def check_tensor_parallel_mesh(tp_mesh: DeviceMesh, param_fqn: str) -> None:
    """Refuse a TP mesh sliced from any but the innermost dimension of its parent mesh.

    Why: the engine reduces gradients over the data-parallel dimension and lays 2-D state
    dicts out as (dp, tp); TP ranks must be the adjacent ones (the last mesh dimension), as
    on a node whose GPUs talk over the fastest links.
    """
    parent = root_mesh(tp_mesh)
    names = parent.mesh_dim_names
    if parent is tp_mesh or names is None or tp_mesh.mesh_dim_names is None:
        return
    dim = names.index(tp_mesh.mesh_dim_names[0])
    if dim != parent.ndim - 1:
        raise RuntimeError(
            f"{param_fqn} is tensor-parallel (TP) over mesh dimension {tp_mesh.mesh_dim_names[0]!r}, "
            f"which is dimension {dim} of its parent mesh {names}; TP must be the innermost "
            "(last) dimension: build the mesh with the TP dimension last, e.g. "
            "init_device_mesh(device_type, (dp, tp), mesh_dim_names=('dp', 'tp')), then "
            "parallelize over mesh['tp'] and shard over mesh['dp']"
        )


def _size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def build_topology(
    strategy: ShardingStrategy,
    device: torch.device,
    mesh: DeviceMesh | None,
    process_group: dist.ProcessGroup | None,
    shard_group_size: int | None,
) -> Topology:
    """Resolve the user's mesh / group arguments into shard and replicate groups."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call dist.init_process_group() before sharding")
    if strategy is ShardingStrategy.HYBRID_SHARD:
        return _hybrid(device, mesh, shard_group_size)
    if mesh is not None:
        if mesh.ndim != 1:
            raise ValueError(
                f"{strategy.name} takes a 1-D mesh, got {mesh.ndim}-D; use HYBRID_SHARD for a (replicate, shard) mesh"
            )
        process_group = mesh.get_group()
    group = process_group or dist.group.WORLD
    world = _size(group)
    if strategy.partitions_optimizer_state:
        # Parameters replicated like NO_SHARD; the optimizer partitions its state (and ZeRO-2 its
        # gradients) over the same ranks.
        if world == 1:
            return Topology(None, None, 1, 0, 1, group, mesh)
        return Topology(None, group, 1, 0, world, group, mesh, group, world, dist.get_rank(group))
    if strategy is ShardingStrategy.NO_SHARD or world == 1:
        return Topology(None, group if world > 1 else None, 1, 0, world, group, mesh)
    return Topology(group, None, world, dist.get_rank(group), world, group, mesh)


def _hybrid(device: torch.device, mesh: DeviceMesh | None, shard_group_size: int | None) -> Topology:
    if mesh is None:
        world = dist.get_world_size()
        size = shard_group_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if size <= 0 or world % size:
            raise ValueError(
                f"HYBRID_SHARD cannot split world size {world} into shard groups of {size}: "
                "pass shard_group_size that divides the world size, or a 2-D DeviceMesh"
            )
        mesh = init_device_mesh(device.type, (world // size, size), mesh_dim_names=("replicate", "shard"))
    elif mesh.ndim != 2:
        raise ValueError(
            f"HYBRID_SHARD needs a 2-D (replicate, shard) DeviceMesh, got {mesh.ndim}-D; "
            "build one with init_device_mesh(device_type, (replicas, shard_size))"
        )
    replicate_group, shard_group = mesh.get_group(0), mesh.get_group(1)
    shard_size, replicas = _size(shard_group), _size(replicate_group)
    return Topology(
        shard_group if shard_size > 1 else None,
        replicate_group if replicas > 1 else None,
        shard_size,
        dist.get_rank(shard_group),
        shard_size * replicas,
        None,
        mesh,
    )
