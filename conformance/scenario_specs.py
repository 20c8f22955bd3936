"""ShardingSpec builders and world-size exclusions that several scenario modules share."""

from __future__ import annotations

from collections.abc import Mapping

import torch

import fixtures
from conformance.protocol import BackendAdapter, Capability, ShardingSpec, ShardingStrategy, require_all
from harness import WorldShape


def spec_with_mesh(backend: BackendAdapter, world_size: int, device: torch.device, **fields: object) -> ShardingSpec:
    """``ShardingSpec(**fields)``, with a (replicate, shard) mesh for HYBRID_SHARD, after
    requiring every capability it needs.

    Required before the mesh is built: building it creates process groups on every rank, and
    a rank that skips while another is still connecting to one of them leaves that rank
    failing in gloo's connectFullMesh instead of skipping with the others. A HYBRID_SHARD
    spec needs what the same spec under FULL_SHARD needs, with the strategy swapped."""
    strategy = fields.get("strategy", ShardingStrategy.FULL_SHARD)
    if strategy is ShardingStrategy.HYBRID_SHARD:
        stand_in = ShardingSpec(**{**fields, "strategy": ShardingStrategy.FULL_SHARD})
        require_all(backend, (stand_in.feature_capabilities() - {Capability.FULL_SHARD}) | {Capability.HYBRID_SHARD})
        spec = ShardingSpec(**fields, mesh=fixtures.hybrid_mesh(world_size, device))
    else:
        spec = ShardingSpec(**fields)
    require_all(backend, spec.feature_capabilities())
    return spec


def hybrid_fits(world: WorldShape, params: Mapping[str, object]) -> str | None:
    """``exclude=`` of the world-size marker: HYBRID_SHARD needs two shard groups or more."""
    if params.get("strategy") is ShardingStrategy.HYBRID_SHARD:
        return fixtures.hybrid_shard_exclusion(world.size, world.local_size)
    return None


def unit_plan_fields(plan: str) -> dict[str, object]:
    """The ``ShardingSpec`` fields of a unit plan over ``fixtures.CompositeModel``: ``auto`` (every
    ``Unit`` its own unit, then the root), ``manual`` (``unit2`` by FQN, then the root) or
    ``none`` (the whole model one unit, as ZeRO-1/2 and DDP have it: no units below the root,
    so a backend without units runs the scenario)."""
    if plan == "auto":
        return {"auto_wrap_classes": (fixtures.Unit,)}
    if plan == "manual":
        return {"manual_units": ("unit2",)}
    if plan == "none":
        return {}
    raise ValueError(f"unknown unit plan {plan!r}: use auto, manual or none")


def lean_unit_plans(world: WorldShape, params: Mapping[str, object]) -> str | None:
    """``exclude=`` of the world-size marker for scenarios with a ``wrap`` axis: HYBRID_SHARD
    needs two shard groups (:func:`hybrid_fits`); the unit-less plan (``none``) runs at world
    size 2 with parameters on the device, and at 4 only in SGD training (pairwise: the plans
    with units already cover offload, both optimizers and both sizes)."""
    reason = hybrid_fits(world, params)
    if reason is not None or params.get("wrap") != "none":
        return reason
    if params.get("param_offload"):
        return "the unit-less plan runs with parameters on the device (offload is covered with units)"
    if world.size != 2 and params.get("optimizer") != "sgd":
        return "the unit-less plan runs at world size 4 in SGD training only (pairwise)"
    return None


def lean_training_world_sizes(world: WorldShape, params: Mapping[str, object]) -> str | None:
    """``exclude=`` of the training families (``test_training``, ``test_unshard_after_training``):
    :func:`lean_unit_plans`, and at world size 4 the manual plan with plain SGD and parameters on
    the device only. Pairwise: world size 4 (uneven shard boundaries) meets every optimizer and
    offload setting under the auto plan, and every plan under SGD; HYBRID_SHARD, which needs
    world size 4, keeps every combination."""
    reason = lean_unit_plans(world, params)
    if reason is not None or world.size == 2 or params.get("strategy") is ShardingStrategy.HYBRID_SHARD:
        return reason
    if params.get("wrap") == "manual" and (params.get("param_offload") or params.get("optimizer", "sgd") != "sgd"):
        return "at world size 4 the manual plan runs with SGD, parameters on the device (pairwise)"
    return None


def lean_round_trip_world_sizes(world: WorldShape, params: Mapping[str, object]) -> str | None:
    """``exclude=`` of the optimizer round trip: :func:`lean_unit_plans`, and at world size 4
    parameters on the device only (pairwise: offload moves where the state lives, on every rank
    alike, and meets both state-dict kinds and every strategy at world size 2; world size 4 adds
    uneven shard boundaries, which do not depend on where the shards live). HYBRID_SHARD, which
    needs world size 4, keeps offload."""
    reason = lean_unit_plans(world, params)
    if reason is not None or world.size == 2 or params.get("strategy") is ShardingStrategy.HYBRID_SHARD:
        return reason
    if params.get("param_offload"):
        return "at world size 4 the optimizer round trip runs with parameters on the device (pairwise)"
    return None
