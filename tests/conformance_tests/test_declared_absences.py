"""Every capability a built-in adapter declares missing is really missing from its backend.

"Unsupported" is a claim about a backend, so each one is backed by a proof: a test that tries the
feature on the real backend and shows it absent, refused or broken. Without this, an adapter
could skip whatever it finds inconvenient and the matrix would call it a backend gap. The
meta-test below fails when an adapter declares a new gap without a proof, or when a proof is left
behind after the gap was closed (then delete the proof).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

import fixtures
from conformance.adapters.torch_fsdp1 import OFFLOAD_TO_CPU_BROKEN_ON_CPU
from conformance.adapters.torch_fsdp2 import HAS_IGNORED_PARAMS
from conformance.protocol import (
    AbsenceProofs,
    ApiForm,
    BackendAdapter,
    BackendEnv,
    Capability,
    ShardingSpec,
    ShardingStrategy,
    declared_missing,
)
from conformance.protocol.proofs import DEVICE_KINDS
from conformance.suite import gate, registry
from conformance.test_divergence import training_step
from harness import current_seed

Proof = Callable[[int, int, torch.device], None]
PROOFS = AbsenceProofs()
DEVICES = DEVICE_KINDS
proves = PROOFS.proves


def _declared_missing(backend: str, device: str) -> set[Capability]:
    """What the adapter declares missing on ``device``, without running its constructor."""
    return set(declared_missing(registry.load(backend), device))


def _two_linears(device: torch.device) -> nn.Sequential:
    return fixtures.build(lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), current_seed(), device)


# -- optimizer-state-only sharding (ZeRO-1) -----------------------------------------------------


def _local_numel(value: torch.Tensor) -> int:
    local = value.to_local() if hasattr(value, "to_local") else value  # DTensor: this rank's part
    return local.numel()


def _no_strategy_shards_only_optimizer_state(backend_name: str, list_strategies: Callable[[], set[str]]) -> Proof:
    """A proof that ``backend_name`` has no ZeRO-1 layout: ``list_strategies`` reads the
    backend's own list of strategies (its enum or options) from the real library and fails
    on one the proof does not know; every strategy the adapter maps is run through one Adam
    step: afterwards each either stores less than the whole model on this rank (parameters
    sharded, optimizer state with them) or holds the optimizer state of every parameter in
    full (replicated). SHARD_OPTIM_STATE
    would be the third case: whole parameters beside a partial optimizer state."""

    def proof(rank: int, world_size: int, device: torch.device) -> None:
        from conformance.protocol import ShardingSpec, ShardingStrategy
        from conformance.test_runtime import OPTIMIZERS

        strategies = list_strategies()
        assert strategies, f"{backend_name}: found no strategies in the library"
        backend = registry.load(backend_name)(BackendEnv(rank, world_size, device))
        observed = []
        for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
            model = _two_linears(device)
            full = sum(p.numel() for p in model.parameters())
            names = [name for name, _ in model.named_parameters()]
            sharded = backend.shard(model, ShardingSpec(strategy=strategy), backend.forms()[0])
            optimizer = backend.make_optimizer(sharded, OPTIMIZERS["adam"])
            backend.zero_grad(sharded, optimizer)
            backend.backward(sharded, sharded(torch.ones(2, 4, device=device)).sum())
            backend.step(sharded, optimizer)
            stored = sum(backend.local_shard(sharded, name).numel() for name in names)
            moments = sum(  # Adam's elementwise states (exp_avg, exp_avg_sq): 2 per element
                _local_numel(value)
                for state in optimizer.state.values()
                for value in state.values()
                if torch.is_tensor(value) and value.dim() > 0
            )
            observed.append(f"{strategy.name}: parameters {stored}/{full}, Adam state {moments}/{2 * full}")
            assert stored < full or moments >= 2 * full, (
                f"{backend_name} {strategy.name} keeps whole parameters beside a partial optimizer "
                f"state (ZeRO-1): {observed[-1]}"
            )
        print(f"{backend_name} strategies {sorted(strategies)}; " + "; ".join(observed))

    return proof


def _fsdp1_strategies() -> set[str]:
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy

    names = {member.name for member in TorchStrategy}
    # HYBRID_SHARD / _HYBRID_SHARD_ZERO2 are FULL_SHARD / SHARD_GRAD_OP inside a shard group,
    # replicated across groups: the layouts checked above, per group. A new member fails here.
    assert names <= {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"}, names
    return names


def _fsdp2_strategies() -> set[str]:
    from torch.distributed.fsdp import fully_shard

    # fully_shard's only layout knob is reshard_after_forward (when, not whether, to shard);
    # NO_SHARD / HYBRID_SHARD come from the mesh (replicate dimension), not from an option.
    options = set(inspect.signature(fully_shard).parameters)
    assert not {"sharding_strategy", "shard_optimizer_state", "zero_stage"} & options, options
    return {"reshard_after_forward", "mesh"} & options


for _backend, _strategies in (
    ("torch-fsdp1", _fsdp1_strategies),
    ("torch-fsdp2", _fsdp2_strategies),
):
    proves(_backend, Capability.SHARD_OPTIM_STATE)(_no_strategy_shards_only_optimizer_state(_backend, _strategies))


# -- DeepSpeed (optional: proven where it is installed) -------------------------------------------


def _deepspeed(rank: int, world_size: int, device: torch.device) -> tuple[BackendAdapter, Any]:
    """The deepspeed adapter (it sets the rank environment DeepSpeed reads and imports it with
    the right accelerator) and the deepspeed module."""
    adapter = registry.load("deepspeed")(BackendEnv(rank, world_size, device))
    import deepspeed

    return adapter, deepspeed


def _ds_engine(deepspeed: Any, model: nn.Module, stage: int, **zero: Any) -> Any:
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
    }
    ds_engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config
    )
    return ds_engine


class _RootWithOwnParameter(nn.Module):
    """A root holding a parameter of its own beside a child unit."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.child = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child(x * self.scale)


@proves("deepspeed", Capability.COMPOSABLE)
def _deepspeed_only_wraps(rank: int, world_size: int, device: torch.device) -> None:
    _, deepspeed = _deepspeed(rank, world_size, device)
    model = _two_linears(device)
    ds_engine = _ds_engine(deepspeed, model, stage=3)
    assert ds_engine is not model and isinstance(ds_engine, deepspeed.DeepSpeedEngine)
    assert ds_engine.module is model and not isinstance(model, deepspeed.DeepSpeedEngine)


@proves("deepspeed", Capability.EXEC_ORDER_CHECK)
def _deepspeed_does_not_check_the_order(rank: int, world_size: int, device: torch.device) -> None:
    # Ranks run two same-sized units in opposite orders under ZeRO-3: nothing raises.
    adapter, _ = _deepspeed(rank, world_size, device)
    training_step(adapter, adapter.forms()[0], rank, device, crossed=True)


@proves("deepspeed", Capability.FLAT_PARAMETERS)
def _deepspeed_keeps_the_original_parameters(rank: int, world_size: int, device: torch.device) -> None:
    _, deepspeed = _deepspeed(rank, world_size, device)
    assert not {"use_orig_params", "flat_parameters"} & set(inspect.signature(deepspeed.initialize).parameters)
    for stage in (1, 3):
        model = _two_linears(device)
        shapes = {name: p.shape for name, p in model.named_parameters()}
        ds_engine = _ds_engine(deepspeed, model, stage=stage)
        shown = {name: getattr(p, "ds_shape", p.shape) for name, p in ds_engine.module.named_parameters()}
        assert shown == shapes, f"stage {stage}: {shown} != {shapes}"


@proves("deepspeed", Capability.HYBRID_SHARD)
def _deepspeed_removed_mics(rank: int, world_size: int, device: torch.device) -> None:
    # MiCS (mics_shard_size: shard within groups, replicate across) was DeepSpeed's hybrid
    # sharding; ZeRO++'s zero_hpz_partition_size only adds a secondary copy of the parameters
    # for backward's gathers, while the primary partition and optimizer state stay world-wide.
    _, deepspeed = _deepspeed(rank, world_size, device)
    from deepspeed.runtime.config import DeepSpeedConfigError

    with pytest.raises(DeepSpeedConfigError, match="MiCS ZeRO-3 sharding has been removed"):
        _ds_engine(deepspeed, _two_linears(device), stage=3, mics_shard_size=1)


def _deepspeed_manages_every_parameter(rank: int, world_size: int, device: torch.device) -> None:
    _, deepspeed = _deepspeed(rank, world_size, device)
    options = set(inspect.signature(deepspeed.initialize).parameters)
    assert not {"ignored_modules", "ignored_params", "ignored_states"} & options, options
    model = fixtures.build(_RootWithOwnParameter, current_seed(), device)
    ds_engine = _ds_engine(deepspeed, model, stage=3)
    not_partitioned = [
        name
        for name, p in ds_engine.module.named_parameters()
        if getattr(p, "ds_status", None) != deepspeed.zero.ZeroParamStatus.NOT_AVAILABLE
    ]
    assert not not_partitioned, f"left unpartitioned: {not_partitioned}"


proves("deepspeed", Capability.IGNORED_MODULES)(_deepspeed_manages_every_parameter)
proves("deepspeed", Capability.UNMANAGED_ROOT)(_deepspeed_manages_every_parameter)


@proves("deepspeed", Capability.INTROSPECT_UNIT_FQNS)
def _deepspeed_partitions_each_parameter(rank: int, world_size: int, device: torch.device) -> None:
    _, deepspeed = _deepspeed(rank, world_size, device)
    ds_engine = _ds_engine(deepspeed, _two_linears(device), stage=3)
    for name, param in ds_engine.module.named_parameters():
        expected = -(-param.ds_numel // world_size)  # its own partition, not a unit's
        assert param.ds_tensor.numel() == expected, (name, param.ds_tensor.numel(), expected)


@proves("deepspeed", Capability.INTROSPECT_EVENTS)
def _deepspeed_has_no_fetch_events(rank: int, world_size: int, device: torch.device) -> None:
    _, deepspeed = _deepspeed(rank, world_size, device)
    engine_only = {
        name for name in dir(deepspeed.DeepSpeedEngine) if not name.startswith("_") and name not in dir(nn.Module)
    }
    hooks = sorted(n for n in engine_only if any(w in n for w in ("hook", "event", "callback")))
    assert not hooks, f"DeepSpeedEngine has public hooks now: {hooks}"


@proves("deepspeed", Capability.MIXED_STRATEGIES)
def _deepspeed_has_one_stage(rank: int, world_size: int, device: torch.device) -> None:
    _, deepspeed = _deepspeed(rank, world_size, device)
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    with pytest.raises(ValueError):  # pydantic's ValidationError: a stage per module is no stage
        DeepSpeedZeroConfig(stage={"0": 3, "1": 1})
    ds_engine = _ds_engine(deepspeed, _two_linears(device), stage=3)
    assert ds_engine.zero_optimization_stage() == 3


@proves("deepspeed", Capability.SHARDED_STATE_DICT)
def _deepspeed_state_dict_is_not_sharded(rank: int, world_size: int, device: torch.device) -> None:
    from torch.distributed.tensor import DTensor

    _, deepspeed = _deepspeed(rank, world_size, device)
    ds_engine = _ds_engine(deepspeed, _two_linears(device), stage=3)
    state = ds_engine.module.state_dict()
    assert not any(isinstance(v, DTensor) or type(v).__name__ == "ShardedTensor" for v in state.values())
    # The partitioned parameters' entries are ZeRO-3's empty placeholders.
    assert all(v.numel() == 0 for v in state.values()), {k: v.shape for k, v in state.items()}


@proves("deepspeed", Capability.TENSOR_PARALLEL)
def _deepspeed_refuses_dtensor_parameters(rank: int, world_size: int, device: torch.device) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    _, deepspeed = _deepspeed(rank, world_size, device)
    mesh = init_device_mesh(device.type, (world_size,))
    for stage in (1, 3):
        model = fixtures.build(fixtures.ThreeLayerMLP, current_seed(), device)
        parallelize_module(model, mesh, {"net1": ColwiseParallel(), "net2": RowwiseParallel()})
        with pytest.raises(RuntimeError, match="Couldn't swap"):
            _ds_engine(deepspeed, model, stage=stage)


def _deepspeed_gather_lacks(option: str) -> Proof:
    def proof(rank: int, world_size: int, device: torch.device) -> None:
        _, deepspeed = _deepspeed(rank, world_size, device)
        assert option not in inspect.signature(deepspeed.zero.GatheredParameters).parameters
        ds_engine = _ds_engine(deepspeed, _two_linears(device), stage=3)
        with pytest.raises(TypeError, match=option):
            deepspeed.zero.GatheredParameters(list(ds_engine.module.parameters()), **{option: True})

    return proof


for _option, _capability in (
    ("rank0_only", Capability.UNSHARD_RANK0_ONLY),
    ("offload_to_cpu", Capability.UNSHARD_OFFLOAD_TO_CPU),
    ("with_grads", Capability.UNSHARD_WITH_GRADS),
):
    proves("deepspeed", _capability)(_deepspeed_gather_lacks(_option))


# Combinations of capabilities an adapter declares unsupported together
# (``UNSUPPORTED_COMBINATIONS``), proven like single capabilities.
COMBINATION_PROOFS: dict[tuple[str, frozenset[Capability]], Proof] = {}


def _deepspeed_stage0_ignores_offload(rank: int, world_size: int, device: torch.device) -> None:
    # NO_SHARD is stage 0: DeepSpeed accepts offload_optimizer in the config, then, below
    # stage 1, steps the client's torch optimizer itself (no ZeRO optimizer, nothing on the host).
    _, deepspeed = _deepspeed(rank, world_size, device)
    model = _two_linears(device)
    client = torch.optim.SGD(model.parameters(), lr=0.1)
    ds_engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=client,
        config={
            "train_micro_batch_size_per_gpu": 1,
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
            "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}},
        },
    )
    assert ds_engine.zero_cpu_offload(), "the offload setting was not taken"
    assert ds_engine.optimizer is client, type(ds_engine.optimizer).__name__


COMBINATION_PROOFS["deepspeed", frozenset({Capability.CPU_OFFLOAD, Capability.NO_SHARD})] = (
    _deepspeed_stage0_ignores_offload
)


def _fsdp1_refuses_grads_with_offload(rank: int, world_size: int, device: torch.device) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(_two_linears(device), device_id=device, use_orig_params=True)
    with (
        pytest.raises(NotImplementedError, match="offload_to_cpu=True is not supported yet"),
        FSDP.summon_full_params(model, with_grads=True, offload_to_cpu=True),
    ):
        pass


COMBINATION_PROOFS["torch-fsdp1", frozenset({Capability.UNSHARD_WITH_GRADS, Capability.UNSHARD_OFFLOAD_TO_CPU})] = (
    _fsdp1_refuses_grads_with_offload
)


def _fsdp1_no_shard_of_a_tensor_parallel_model_fails(rank: int, world_size: int, device: torch.device) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if world_size % 2:
        pytest.skip(reason="a (dp, tp=2) mesh needs an even world size")
    mesh = init_device_mesh(device.type, (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(_two_linears(device), mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    sharded = FSDP(
        model,
        device_mesh=mesh["dp"],
        sharding_strategy=ShardingStrategy.NO_SHARD,
        device_id=device,
        use_orig_params=True,
    )
    with pytest.raises(RuntimeError, match="Cannot writeback when the parameter shape changes"):
        sharded(torch.randn(2, 4, device=device))


COMBINATION_PROOFS["torch-fsdp1", frozenset({Capability.TENSOR_PARALLEL, Capability.NO_SHARD})] = (
    _fsdp1_no_shard_of_a_tensor_parallel_model_fails
)


def _fsdp1_refuses_grads_with_flat_parameters(rank: int, world_size: int, device: torch.device) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(_two_linears(device), device_id=device, use_orig_params=False)
    with (
        pytest.raises(NotImplementedError, match="use_orig_params=False"),
        FSDP.summon_full_params(model, with_grads=True),
    ):
        pass


COMBINATION_PROOFS["torch-fsdp1", frozenset({Capability.UNSHARD_WITH_GRADS, Capability.FLAT_PARAMETERS})] = (
    _fsdp1_refuses_grads_with_flat_parameters
)


def _fsdp1_flat_parameter_fuses_every_group(rank: int, world_size: int, device: torch.device) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(_two_linears(device), device_id=device, use_orig_params=False)
    exposed = list(model.named_parameters())
    # One parameter for the unit's weights and biases alike: an optimizer sees it whole, so no
    # parameter group can give a bias another option than its weight.
    assert len(exposed) == 1 and exposed[0][0].endswith("_flat_param"), [name for name, _ in exposed]
    assert sorted(exposed[0][1]._fqns) == ["0.bias", "0.weight", "1.bias", "1.weight"]


COMBINATION_PROOFS["torch-fsdp1", frozenset({Capability.PARAMETER_GROUPS, Capability.FLAT_PARAMETERS})] = (
    _fsdp1_flat_parameter_fuses_every_group
)


# -- torch FSDP1 ---------------------------------------------------------------------------------


@proves("torch-fsdp1", Capability.COMPOSABLE)
def _fsdp1_has_no_composable_form(rank: int, world_size: int, device: torch.device) -> None:
    import torch.distributed._composable as composable

    with pytest.raises(ImportError):
        from torch.distributed._composable import fully_shard  # noqa: F401
    assert not hasattr(composable, "fully_shard"), "torch ships FSDP1's composable fully_shard again"


@proves("torch-fsdp1", Capability.CPU_OFFLOAD)
def _fsdp1_cannot_offload_on_cpu(rank: int, world_size: int, device: torch.device) -> None:
    from torch.distributed.fsdp import CPUOffload
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    assert "pin_memory" not in inspect.signature(CPUOffload).parameters
    model = FSDP(_two_linears(device), cpu_offload=CPUOffload(offload_params=True), device_id=device)
    # The words differ by torch build: "Cannot access accelerator device when none is available"
    # (2.13 CPU wheel), "CPU device type not an accelerator." (2.6 CUDA build), "Found no NVIDIA
    # driver on your system" (2.14.1 CUDA build on a machine without a GPU).
    no_accelerator = (
        r"Cannot access accelerator device when none is available|CPU device type not an accelerator"
        r"|Found no NVIDIA driver on your system"
    )
    with pytest.raises(RuntimeError, match=no_accelerator):
        model(torch.ones(1, 4, device=device))


def _fsdp1_offload_to_cpu_is_broken_on_cpu(strategy_name: str) -> Proof:
    """On a CPU device, summon_full_params(offload_to_cpu=True) of a unit it gathers (every
    strategy but NO_SHARD, which refuses it before touching memory) exposes freed memory."""

    def proof(rank: int, world_size: int, device: torch.device) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy

        kwargs: dict[str, Any] = {"sharding_strategy": ShardingStrategy[strategy_name]}
        if strategy_name == "HYBRID_SHARD":  # shard within each (one-rank-group) row: (replicate, shard)
            kwargs["device_mesh"] = init_device_mesh(device.type, (1, world_size))
        # Flat parameters raise; with use_orig_params=True the views point at freed memory and
        # the process may crash instead, so only the flat case is shown here.
        model = FSDP(_two_linears(device), device_id=device, use_orig_params=False, **kwargs)
        with (
            pytest.raises(RuntimeError, match=r"setStorage: .* out of bounds for storage of size 0"),
            FSDP.summon_full_params(model, offload_to_cpu=True, writeback=False),
        ):
            pass

    return proof


if OFFLOAD_TO_CPU_BROKEN_ON_CPU:  # declared where seen (torch < 2.14); 2.14.1 gives the right values
    for _strategy in (Capability.FULL_SHARD, Capability.SHARD_GRAD_OP, Capability.HYBRID_SHARD):
        COMBINATION_PROOFS["torch-fsdp1", frozenset({Capability.UNSHARD_OFFLOAD_TO_CPU, _strategy})] = (
            _fsdp1_offload_to_cpu_is_broken_on_cpu(_strategy.name)
        )


# -- the reference engine ------------------------------------------------------------------------


def _engine_zero_refuses_tensor_parallel(strategy: str) -> Proof:
    def proof(rank: int, world_size: int, device: torch.device) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        import engine

        model = _two_linears(device)
        parallelize_module(model, init_device_mesh(device.type, (world_size,)), {"0": ColwiseParallel()})
        with pytest.raises(NotImplementedError, match="does not partition tensor-parallel parameters"):
            engine.fully_shard(model, strategy=engine.ShardingStrategy[strategy])

    return proof


for _zero in (Capability.SHARD_OPTIM_STATE, Capability.SHARD_GRAD_AND_OPTIM_STATE):
    COMBINATION_PROOFS["reference", frozenset({Capability.TENSOR_PARALLEL, _zero})] = (
        _engine_zero_refuses_tensor_parallel(_zero.name)
    )


# -- torch FSDP2 ---------------------------------------------------------------------------------


@proves("torch-fsdp2", Capability.WRAPPER)
def _fsdp2_shards_in_place(rank: int, world_size: int, device: torch.device) -> None:
    from torch.distributed.fsdp import FSDPModule, fully_shard

    model = _two_linears(device)
    children = list(model.children())
    assert fully_shard(model) is model, "fully_shard returned a wrapper"
    assert isinstance(model, FSDPModule) and list(model.children()) == children


def _fsdp2_one_dimensional_mesh_always_shards(rank: int, world_size: int, device: torch.device) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    # The 2-D scenarios' (dp, tp) mesh: a NO_SHARD model over its dp dimension is a 1-D mesh.
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    model = _two_linears(device)
    fully_shard(model, mesh=mesh)
    for param in model.parameters():
        assert param.placements == (Shard(0),), f"fully_shard over a 1-D mesh laid a parameter out {param.placements}"
        assert param.to_local().numel() < param.numel(), "fully_shard over a 1-D mesh kept a whole parameter"


COMBINATION_PROOFS["torch-fsdp2", frozenset({Capability.TENSOR_PARALLEL, Capability.NO_SHARD})] = (
    _fsdp2_one_dimensional_mesh_always_shards
)


def _fsdp2_cannot_clip_units_on_two_meshes(rank: int, world_size: int, device: torch.device) -> None:
    # The adapter's own sharding of a mixed model: unit "0" NO_SHARD (its replicate mesh), the root
    # FULL_SHARD (the 1-D mesh); torch's clip then refuses the two meshes' norms.
    backend = registry.load("torch-fsdp2")(BackendEnv(rank, world_size, device))
    spec = ShardingSpec(manual_units=("0",), strategy_overrides={"0": ShardingStrategy.NO_SHARD})
    model = backend.shard(_two_linears(device), spec, ApiForm.COMPOSABLE)
    model(torch.randn(2, 4, device=device)).sum().backward()
    with pytest.raises(RuntimeError, match="same mesh"):
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)


COMBINATION_PROOFS[
    "torch-fsdp2", frozenset({Capability.GRADIENT_CLIPPING, Capability.MIXED_STRATEGIES, Capability.NO_SHARD})
] = _fsdp2_cannot_clip_units_on_two_meshes


@proves("torch-fsdp2", Capability.FLAT_PARAMETERS)
def _fsdp2_has_no_flat_parameters(rank: int, world_size: int, device: torch.device) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    assert "use_orig_params" not in inspect.signature(fully_shard).parameters
    model = _two_linears(device)
    names = [name for name, _ in model.named_parameters()]
    fully_shard(model)
    assert [name for name, _ in model.named_parameters()] == names
    assert all(isinstance(p, DTensor) for p in model.parameters())


@proves("torch-fsdp2", Capability.EXEC_ORDER_CHECK)
def _fsdp2_does_not_check_the_order(rank: int, world_size: int, device: torch.device) -> None:
    from torch.distributed.fsdp import fully_shard

    assert not {"check_exec_order", "forward_prefetch"} & set(inspect.signature(fully_shard).parameters)
    # Ranks run two same-sized units in opposite orders: the step completes, nothing raises.
    backend = registry.load("torch-fsdp2")(BackendEnv(rank, world_size, device))
    training_step(backend, backend.forms()[0], rank, device, crossed=True)


@proves("torch-fsdp2", Capability.UNSHARD_WRITEBACK)
def _fsdp2_drops_changes_made_while_unsharded(rank: int, world_size: int, device: torch.device) -> None:
    from torch.distributed.fsdp import fully_shard

    model = _two_linears(device)
    fully_shard(model)
    before = [p.to_local().clone() for p in model.parameters()]
    model.unshard()
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    model.reshard()
    after = [p.to_local() for p in model.parameters()]
    assert any(b.count_nonzero() for b in before)
    assert all(torch.equal(a, b) for a, b in zip(after, before)), "the zeros persisted"


def _fsdp2_unshard_lacks(option: str) -> Proof:
    def proof(rank: int, world_size: int, device: torch.device) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        assert option not in inspect.signature(FSDPModule.unshard).parameters
        model = _two_linears(device)
        fully_shard(model)
        with pytest.raises(TypeError, match=option):
            model.unshard(**{option: True})

    return proof


for _option, _capability in (
    ("rank0_only", Capability.UNSHARD_RANK0_ONLY),
    ("offload_to_cpu", Capability.UNSHARD_OFFLOAD_TO_CPU),
    ("with_grads", Capability.UNSHARD_WITH_GRADS),
):
    proves("torch-fsdp2", _capability)(_fsdp2_unshard_lacks(_option))


def _fsdp2_cannot_ignore_parameters(rank: int, world_size: int, device: torch.device) -> None:
    from torch.distributed.fsdp import fully_shard

    assert not {"ignored_params", "ignored_modules", "ignored_states"} & set(inspect.signature(fully_shard).parameters)
    model = _two_linears(device)
    with pytest.raises(TypeError, match="ignored_params"):
        fully_shard(model, ignored_params=set(model[0].parameters()))


# A gap of older torch only (torch_fsdp2.HAS_IGNORED_PARAMS): proven where the running torch has it.
if not HAS_IGNORED_PARAMS:
    proves("torch-fsdp2", Capability.IGNORED_MODULES)(_fsdp2_cannot_ignore_parameters)
# Proofs that never run the backend's sharded model, so they also hold on a device or torch where the
# backend is refused (conformance.suite.gate): torch 2.6's fully_shard refuses ignored_params at once.
RUN_NOTHING = frozenset({Capability.IGNORED_MODULES})


# -- torch-zero: DistributedDataParallel + ZeroRedundancyOptimizer -------------------------------


def _zero_step(device: torch.device) -> tuple[nn.Module, Any, Any]:
    """A DDP-wrapped model after one ZeroRedundancyOptimizer (Adam) step: the model, DDP, ZeRO."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = _two_linears(device)
    ddp = DistributedDataParallel(model, device_ids=None if device.type == "cpu" else [device])
    optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
    ddp(torch.full((2, 4), float(dist.get_rank() + 1), device=device)).sum().backward()
    optimizer.step()
    return model, ddp, optimizer


def _equal_on_every_rank(tensor: torch.Tensor) -> bool:
    import torch.distributed as dist

    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor.contiguous())
    return all(torch.equal(other, gathered[0]) for other in gathered)


def _ddp_options() -> set[str]:
    from torch.nn.parallel import DistributedDataParallel

    return set(inspect.signature(DistributedDataParallel).parameters)


def _ddp_replicates_every_parameter(rank: int, world_size: int, device: torch.device) -> None:
    # No option shards anything; after a ZeRO-1 step every rank holds every parameter whole, the
    # same values everywhere (ZeroRedundancyOptimizer broadcast each from its owner).
    assert not {"sharding_strategy", "reshard_after_forward", "shard_parameters", "zero_stage"} & _ddp_options()
    model, _ddp, _optimizer = _zero_step(device)
    numels = {name: p.numel() for name, p in _two_linears(device).named_parameters()}
    for name, param in model.named_parameters():
        assert param.numel() == numels[name], f"{name}: {param.numel()} of {numels[name]} elements here"
        assert _equal_on_every_rank(param.detach()), f"{name} differs between ranks"


for _capability in (
    Capability.FULL_SHARD,
    Capability.SHARD_GRAD_OP,
    Capability.HYBRID_SHARD,
    Capability.UNSHARD_RANK0_ONLY,
):
    proves("torch-zero", _capability)(_ddp_replicates_every_parameter)


@proves("torch-zero", Capability.SHARD_GRAD_AND_OPTIM_STATE)
def _zero_keeps_every_gradient_whole(rank: int, world_size: int, device: torch.device) -> None:
    # ZeroRedundancyOptimizer's options partition nothing but the state (parameters_as_bucket_view
    # packs parameters, overlap_with_ddp steps from DDP's all-reduce hook); after backward every
    # rank holds the whole, all-reduced gradient of every parameter, also of those whose state
    # another rank owns.
    from torch.distributed.optim import ZeroRedundancyOptimizer

    options = set(inspect.signature(ZeroRedundancyOptimizer).parameters)
    assert options == {
        "params",
        "optimizer_class",
        "process_group",
        "parameters_as_bucket_view",
        "overlap_with_ddp",
        "defaults",
    }, options
    model, _ddp, optimizer = _zero_step(device)
    owned = {id(p) for group in optimizer.optim.param_groups for p in group["params"]}
    others = [name for name, p in model.named_parameters() if id(p) not in owned]
    assert others, "this rank owns every parameter's state: nothing to show"
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.shape == param.shape, f"{name}: {param.grad}"
        assert _equal_on_every_rank(param.grad), f"{name}'s gradient differs between ranks (not all-reduced)"


def _ddp_has_no_units(rank: int, world_size: int, device: torch.device) -> None:
    # Nothing names submodules, and in forward every submodule finds its parameters whole, in
    # the storage they had at rest: there is nothing to gather or free per submodule.
    from torch.nn.parallel import DistributedDataParallel

    assert not {"auto_wrap_policy", "ignored_modules", "sharding_strategy"} & _ddp_options()
    model = _two_linears(device)
    at_rest = {name: (p.data_ptr(), p.numel()) for name, p in model.named_parameters()}
    ddp = DistributedDataParallel(model, device_ids=None if device.type == "cpu" else [device])
    seen: dict[str, tuple[int, int]] = {}

    def record(prefix: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            for name, param in module.named_parameters(prefix=prefix):
                seen[name] = (param.data_ptr(), param.numel())

        return hook

    for prefix, child in model.named_children():
        child.register_forward_pre_hook(record(prefix))
    ddp(torch.ones(2, 4, device=device)).sum().backward()
    assert seen == at_rest, f"in forward {seen}, at rest {at_rest}"


for _capability in (
    Capability.AUTO_WRAP,
    Capability.UNITS,
    Capability.UNMANAGED_ROOT,
    Capability.MIXED_STRATEGIES,
    Capability.INTROSPECT_UNSHARDED,
    Capability.INTROSPECT_UNIT_FQNS,
    Capability.INTROSPECT_EVENTS,
    Capability.INTROSPECT_STORAGE,
):
    proves("torch-zero", _capability)(_ddp_has_no_units)


def _ddp_mixed_precision_is_private(rank: int, world_size: int, device: torch.device) -> None:
    # The only mixed-precision knob is DDP's mixed_precision argument, typed with a private class
    # that neither torch.nn.parallel nor its distributed module exports.
    import torch.nn.parallel
    import torch.nn.parallel.distributed as ddp_module

    public = {name for name in (*dir(torch.nn.parallel), *ddp_module.__all__) if "precision" in name.lower()}
    assert not public, f"torch exports {sorted(public)} now"
    if "mixed_precision" in _ddp_options():
        assert hasattr(ddp_module, "_MixedPrecision") and not hasattr(ddp_module, "MixedPrecision")


proves("torch-zero", Capability.MIXED_PRECISION)(_ddp_mixed_precision_is_private)
proves("torch-zero", Capability.REDUCE_DTYPE)(_ddp_mixed_precision_is_private)


def _ddp_keeps_the_modules_own_parameters(rank: int, world_size: int, device: torch.device) -> None:
    # No option moves, flattens or gathers parameters, and DDP has no unshard of any kind: the
    # parameters it trains are the module's own objects, original shapes, on the model's device.
    from torch.nn.parallel import DistributedDataParallel

    assert not {"cpu_offload", "offload_policy", "use_orig_params", "flatten_parameters"} & _ddp_options()
    own = {name for name in dir(DistributedDataParallel) if name not in dir(nn.Module)}
    assert not {"summon_full_params", "unshard", "reshard"} & own
    model, ddp, _optimizer = _zero_step(device)
    original = dict(_two_linears(device).named_parameters())
    for name, param in ddp.named_parameters():
        inner = name.removeprefix("module.")
        assert param is model.get_parameter(inner), f"{name} is not the module's own parameter"
        assert param.shape == original[inner].shape and param.device == device, (name, param.shape, param.device)


for _capability in (Capability.CPU_OFFLOAD, Capability.FLAT_PARAMETERS, Capability.UNSHARD_OFFLOAD_TO_CPU):
    proves("torch-zero", _capability)(_ddp_keeps_the_modules_own_parameters)


@proves("torch-zero", Capability.IGNORED_MODULES)
def _ddp_cannot_ignore_modules_publicly(rank: int, world_size: int, device: torch.device) -> None:
    from torch.nn.parallel import DistributedDataParallel

    assert not {"ignored_modules", "ignored_params", "ignored_states"} & _ddp_options()
    own = {name for name in dir(DistributedDataParallel) if name not in dir(nn.Module)}
    ignoring = sorted(name for name in own if "ignore" in name.lower())
    assert ignoring and all(name.startswith("_") for name in ignoring), f"DDP's ignore methods: {ignoring}"


@proves("torch-zero", Capability.SHARDED_STATE_DICT)
def _ddp_state_dicts_are_whole(rank: int, world_size: int, device: torch.device) -> None:
    # Its own state dict and torch.distributed.checkpoint's sharded one both hold plain, whole tensors.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    model, ddp, _optimizer = _zero_step(device)
    whole = {name: value.shape for name, value in model.state_dict().items()}
    for state in (ddp.module.state_dict(), get_model_state_dict(ddp, options=StateDictOptions(full_state_dict=False))):
        assert not any(isinstance(v, DTensor) or hasattr(v, "local_shards") for v in state.values())
        assert {name: value.shape for name, value in state.items()} == whole


@proves("torch-zero", Capability.EXEC_ORDER_CHECK)
def _ddp_does_not_check_the_order(rank: int, world_size: int, device: torch.device) -> None:
    # Ranks run two same-sized submodules in opposite orders: the step completes, nothing raises.
    from torch.nn.parallel import DistributedDataParallel

    from conformance.test_divergence import SwappableUnits

    assert not {"check_exec_order", "forward_prefetch"} & _ddp_options()
    model = fixtures.build(SwappableUnits, current_seed(), device)
    ddp = DistributedDataParallel(model, device_ids=None if device.type == "cpu" else [device])
    if rank != 0:
        model.order = tuple(reversed(SwappableUnits.UNIT_FQNS))
    inputs = fixtures.local_batch(model, seed=current_seed(), iteration=0, rank=rank, batch_size=4, device=device)
    model.loss(ddp(*inputs)).backward()


@proves("torch-zero", Capability.TENSOR_PARALLEL)
def _ddp_refuses_dtensor_parameters(rank: int, world_size: int, device: torch.device) -> None:
    # DDP's construction broadcasts the parameters: with every parameter a DTensor the broadcast
    # has no DTensor rule (torch 2.6's dispatcher asserts it finds no mesh for c10d.broadcast_);
    # beside plain ones (a 2-D model's usual mix), the coalescing refuses.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    mesh = init_device_mesh(device.type, (world_size,))
    every = fixtures.build(lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), current_seed(), device)
    parallelize_module(every, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    some = fixtures.build(fixtures.ThreeLayerMLP, current_seed(), device)
    parallelize_module(some, mesh, {"net1": ColwiseParallel(), "net2": RowwiseParallel()})
    for model, refusal in (
        (every, "does not have a sharding strategy registered|found no DeviceMesh from dtensor args"),
        (some, "got mixed torch.Tensor and DTensor"),
    ):
        with pytest.raises((NotImplementedError, RuntimeError, AssertionError), match=refusal):
            DistributedDataParallel(model, device_ids=None if device.type == "cpu" else [device])


@proves("torch-zero", Capability.NATIVE_CHECKPOINT)
def _zero_saves_only_consolidated_state(rank: int, world_size: int, device: torch.device) -> None:
    # Neither class has a save / load of its own, and ZeroRedundancyOptimizer refuses to give its
    # state at all until consolidate_state_dict gathered the whole of it onto the asking rank.
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    for cls, base in ((DistributedDataParallel, nn.Module), (ZeroRedundancyOptimizer, torch.optim.Optimizer)):
        own = {name for name in dir(cls) if name not in dir(base) and not name.startswith("_")}
        assert not {name for name in own if "save" in name or "checkpoint" in name}, (cls.__name__, own)
    _model, _ddp, optimizer = _zero_step(device)
    with pytest.raises(RuntimeError, match="has not been consolidated on this rank"):
        optimizer.state_dict()


# -- DeepSpeed, protocol 5 (storage, units, gradient accumulation) --------------------------------


def _deepspeed_step(ds_engine: Any, device: torch.device, between: Callable[[], None] = lambda: None) -> None:
    loss = ds_engine(torch.ones(2, 4, device=device)).sum()
    between()
    ds_engine.backward(loss)
    ds_engine.step()


@proves("deepspeed", Capability.SHARD_GRAD_OP)
def _deepspeed_has_no_reshard_after_backward_only(rank: int, world_size: int, device: torch.device) -> None:
    """SHARD_GRAD_OP: parameters sharded at rest, gathered from forward until backward. Stage 2
    never shards parameters; stage 3's only knob for keeping gathered parameters,
    stage3_max_reuse_distance (here its maximum), reads the module trace recorded in the first
    step: in that step every parameter is released between forward and backward, in the next
    one kept. No ZeRO option names the choice itself."""
    _, deepspeed = _deepspeed(rank, world_size, device)
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    fields = getattr(DeepSpeedZeroConfig, "model_fields", None) or DeepSpeedZeroConfig.__fields__
    assert not [name for name in fields if "reshard" in name], sorted(fields)
    stage2 = _ds_engine(deepspeed, _two_linears(device), stage=2)
    assert all(not hasattr(p, "ds_tensor") and p.numel() > 0 for p in stage2.module.parameters())

    status = deepspeed.zero.ZeroParamStatus
    stage3 = _ds_engine(deepspeed, _two_linears(device), stage=3, stage3_max_reuse_distance=2**62)
    gathered: list[list[bool]] = []

    def record() -> None:
        gathered.append([p.ds_status == status.AVAILABLE for p in stage3.module.parameters()])

    for _ in range(2):
        _deepspeed_step(stage3, device, record)
    assert not any(gathered[0]), f"first step: gathered between forward and backward {gathered[0]}"
    assert all(gathered[1]), f"second step (trace recorded): gathered {gathered[1]}"


def _deepspeed_stage_has_no_units(stage: int) -> Proof:
    """Stages 0-2 install no hooks on submodules (ZeRO-3 fetches through one per module; the
    engine's own hook on the root serves every stage) and leave every parameter whole; stages 1-2
    partition one flat buffer per optimizer param group, holding every parameter of the model,
    over all ranks; stage 0 steps the client's torch optimizer itself."""

    def proof(rank: int, world_size: int, device: torch.device) -> None:
        _, deepspeed = _deepspeed(rank, world_size, device)
        model = _two_linears(device)
        ds_engine = _ds_engine(deepspeed, model, stage=stage)
        hooked = {
            name: (len(m._forward_pre_hooks), len(m._forward_hooks))
            for name, m in model.named_modules()
            if name and (m._forward_pre_hooks or m._forward_hooks)
        }
        assert not hooked, f"ZeRO stage {stage} hooks submodules: {hooked}"
        assert not any(hasattr(p, "ds_id") for p in model.parameters())
        if stage == 0:
            assert isinstance(ds_engine.optimizer, torch.optim.SGD), type(ds_engine.optimizer).__name__
            return
        zero = ds_engine.optimizer
        assert len(zero.bit16_groups) == 1 and {id(p) for p in zero.bit16_groups[0]} == {
            id(p) for p in model.parameters()
        }
        assert len(zero.parallel_partitioned_bit16_groups[0]) == world_size

    return proof


def _deepspeed_refuses_no_sync(stage: int) -> Proof:
    def proof(rank: int, world_size: int, device: torch.device) -> None:
        _, deepspeed = _deepspeed(rank, world_size, device)
        ds_engine = _ds_engine(deepspeed, _two_linears(device), stage=stage)
        message = f"no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage {stage}"
        with pytest.raises(AssertionError, match=message), ds_engine.no_sync():
            pass

    return proof


_DEEPSPEED_PROTOCOL5_COMBINATIONS: dict[frozenset[Capability], Proof] = {
    frozenset({Capability.UNITS, Capability.NO_SHARD}): _deepspeed_stage_has_no_units(0),
    frozenset({Capability.UNITS, Capability.SHARD_OPTIM_STATE}): _deepspeed_stage_has_no_units(1),
    frozenset({Capability.UNITS, Capability.SHARD_GRAD_AND_OPTIM_STATE}): _deepspeed_stage_has_no_units(2),
    frozenset({Capability.NO_SYNC, Capability.SHARD_GRAD_AND_OPTIM_STATE}): _deepspeed_refuses_no_sync(2),
    frozenset({Capability.NO_SYNC, Capability.FULL_SHARD}): _deepspeed_refuses_no_sync(3),
}
for _combination, _proof in _DEEPSPEED_PROTOCOL5_COMBINATIONS.items():
    COMBINATION_PROOFS["deepspeed", _combination] = _proof


# -- torch FSDP1 / FSDP2 have no ZeRO-2 layout (SHARD_GRAD_AND_OPTIM_STATE) ---------------------


def _zero2_layout(stored: int, grads: int, full: int) -> bool:
    """ZeRO-2 at rest: every parameter whole on this rank, its gradient only partly."""
    return stored == full and grads < full


@proves("torch-fsdp1", Capability.SHARD_GRAD_AND_OPTIM_STATE)
def _fsdp1_has_no_zero2_layout(rank: int, world_size: int, device: torch.device) -> None:
    """Every FSDP1 strategy, after one SGD step: parameters at rest either sharded (each original
    parameter a view of this rank's flat shard, the unsharded flat buffer freed: SHARD_GRAD_OP and
    _HYBRID_SHARD_ZERO2 skip only the reshard after forward) or whole beside whole gradients
    (NO_SHARD); none keeps whole parameters beside a partial gradient."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy

    observed = []
    for name in sorted(_fsdp1_strategies()):
        kwargs: dict[str, Any] = {"sharding_strategy": TorchStrategy[name]}
        if "HYBRID" in name:  # (replicate, shard) with one group of every rank: sharding shows
            kwargs["device_mesh"] = init_device_mesh(device.type, (1, world_size))
        model = _two_linears(device)
        full = sum(p.numel() for p in model.parameters())
        sharded = FSDP(model, device_id=device, use_orig_params=True, **kwargs)
        optimizer = torch.optim.SGD(sharded.parameters(), lr=0.1)
        sharded(torch.ones(2, 4, device=device)).sum().backward()
        optimizer.step()
        stored = sum(p.numel() for p in sharded.parameters())
        grads = sum(p.grad.numel() for p in sharded.parameters() if p.grad is not None)
        padded = sharded._handle.flat_param._full_param_padded if sharded._handle.uses_sharded_strategy else None
        held = 0 if padded is None else padded.untyped_storage().size()
        observed.append(f"{name}: parameters {stored}/{full} (unsharded buffer {held} bytes), gradients {grads}/{full}")
        assert not _zero2_layout(stored, grads, full) and held == 0, f"FSDP1 {observed[-1]} is ZeRO-2"
    print("; ".join(observed))


@proves("torch-fsdp2", Capability.SHARD_GRAD_AND_OPTIM_STATE)
def _fsdp2_has_no_zero2_layout(rank: int, world_size: int, device: torch.device) -> None:
    """fully_shard's layouts (reshard_after_forward True / False on a 1-D mesh; a (world, 1)
    replicate mesh, NO_SHARD), after one SGD step: parameters are DTensors holding a shard of
    each parameter (Shard(0)), or whole beside whole gradients (replicate); none keeps whole
    parameters beside a partial gradient. Its only placement hook, shard_placement_fn, picks a
    Shard dimension: a parameter cannot be declared replicated on a shard mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    options = _fsdp2_strategies()
    assert "reshard_after_forward" in options, options
    placement_hook = inspect.signature(fully_shard).parameters.get("shard_placement_fn")  # torch >= 2.7
    annotation = "" if placement_hook is None else str(placement_hook.annotation)
    assert "Replicate" not in annotation, f"shard_placement_fn may return a Replicate now: {annotation}"
    layouts: list[tuple[str, dict[str, Any]]] = [
        ("reshard_after_forward=True", {"reshard_after_forward": True}),
        ("reshard_after_forward=False", {"reshard_after_forward": False}),
        (
            "replicate mesh",
            {"mesh": init_device_mesh(device.type, (world_size, 1), mesh_dim_names=("replicate", "shard"))},
        ),
    ]
    observed = []
    for name, kwargs in layouts:
        model = _two_linears(device)
        full = sum(p.numel() for p in model.parameters())
        for layer in model:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(2, 4, device=device)).sum().backward()
        optimizer.step()
        stored = sum(_local_numel(p) for p in model.parameters())
        grads = sum(_local_numel(p.grad) for p in model.parameters() if p.grad is not None)
        observed.append(f"{name}: parameters {stored}/{full}, gradients {grads}/{full}")
        assert not _zero2_layout(stored, grads, full), f"fully_shard {observed[-1]} is ZeRO-2"
    print("; ".join(observed))


# -- the tests -----------------------------------------------------------------------------------


def _installed_builtins() -> list[str]:
    """The built-ins, and the optional built-ins whose library is installed here."""
    return [
        *registry.BUILTIN,
        *(
            name
            for name, (library, _target, _install) in registry.OPTIONAL_BUILTIN.items()
            if importlib.util.find_spec(library) is not None
        ),
    ]


def test_every_declared_absence_has_a_proof(monkeypatch: pytest.MonkeyPatch) -> None:
    # The DeepSpeed adapter's declarations import deepspeed here, in pytest's process: named, its
    # accelerator is not probed through torch.cuda (tests/support/cuda_runtime_guard.py).
    monkeypatch.setenv("DS_ACCELERATOR", os.environ.get("DS_ACCELERATOR", "cpu"))
    declared = {
        (backend, capability)
        for backend in _installed_builtins()
        for device in DEVICES
        for capability in _declared_missing(backend, device)
    }
    missing_proofs = sorted(f"{b}: {c.name}" for b, c in declared - PROOFS.proofs.keys())
    leftover_proofs = sorted(f"{b}: {c.name}" for b, c in PROOFS.proofs.keys() - declared if b in _installed_builtins())
    assert not missing_proofs, f"declared unsupported without a proof here: {missing_proofs}"
    assert not leftover_proofs, f"proofs of gaps no longer declared (delete them): {leftover_proofs}"


def _declared_combinations() -> set[tuple[str, frozenset[Capability]]]:
    declared = set()
    for backend in _installed_builtins():
        adapter_cls = registry.load(backend)
        for device in DEVICES:
            adapter = adapter_cls.__new__(adapter_cls)
            BackendAdapter.__init__(adapter, BackendEnv(rank=0, world_size=2, device=torch.device(device)))
            declared |= {(backend, combination) for combination in adapter.unsupported_combinations()}
    return declared


def test_every_declared_combination_has_a_proof() -> None:
    declared = _declared_combinations()
    missing = sorted(f"{b}: {sorted(c.name for c in cs)}" for b, cs in declared - COMBINATION_PROOFS.keys())
    leftover = sorted(
        f"{b}: {sorted(c.name for c in cs)}"
        for b, cs in COMBINATION_PROOFS.keys() - declared
        if b in _installed_builtins()
    )
    assert not missing, f"combinations declared unsupported without a proof here: {missing}"
    assert not leftover, f"proofs of combinations no longer declared (delete them): {leftover}"


@pytest.mark.world_size(2)
@pytest.mark.parametrize(
    ("backend_name", "combination"),
    [
        pytest.param(b, cs, id=f"{b}-{'+'.join(sorted(c.name for c in cs))}")
        for b, cs in sorted(COMBINATION_PROOFS, key=lambda key: (key[0], sorted(c.name for c in key[1])))
    ],
)
def test_declared_combination_absence_is_real(
    backend_name: str,
    combination: frozenset[Capability],
    rank: int,
    world_size: int,
    device: torch.device,
) -> None:
    if backend_name not in _installed_builtins():
        library, _target, install = registry.OPTIONAL_BUILTIN[backend_name]
        pytest.skip(f"{library} is not installed here ({install}): its absences are proven where it is")
    cannot_run = gate.unsupported(registry.load(backend_name), device.type, torch.__version__)
    if cannot_run is not None:
        pytest.skip(reason=f"{backend_name}: {cannot_run} (its proofs run where it does)")
    adapter = registry.load(backend_name)(BackendEnv(rank, world_size, device))
    if combination not in adapter.unsupported_combinations():
        pytest.skip(f"{backend_name} supports {sorted(c.name for c in combination)} on {device.type}")
    COMBINATION_PROOFS[backend_name, combination](rank, world_size, device)


def _proof_params() -> list:
    params = []
    for backend, capability in sorted(PROOFS.proofs, key=lambda key: (key[0], key[1].name)):
        # The order proof runs two units in opposite orders on purpose.
        marks = [pytest.mark.expect_divergence] if capability is Capability.EXEC_ORDER_CHECK else []
        params.append(pytest.param(backend, capability, marks=marks, id=f"{backend}-{capability.name}"))
    return params


@pytest.mark.world_size(2)
@pytest.mark.parametrize(("backend_name", "capability"), _proof_params())
def test_declared_absence_is_real(
    backend_name: str, capability: Capability, rank: int, world_size: int, device: torch.device
) -> None:
    if backend_name not in _installed_builtins():
        library, _target, install = registry.OPTIONAL_BUILTIN[backend_name]
        pytest.skip(f"{library} is not installed here ({install}): its absences are proven where it is")
    cannot_run = gate.unsupported(registry.load(backend_name), device.type, torch.__version__)
    if cannot_run is not None and capability not in RUN_NOTHING:
        pytest.skip(reason=f"{backend_name}: {cannot_run} (its proofs run where it does)")
    adapter = registry.load(backend_name)(BackendEnv(rank, world_size, device))
    if adapter.supports(capability):
        pytest.skip(f"{backend_name} supports {capability.value} on {device.type}: nothing to prove")
    PROOFS.proofs[backend_name, capability](rank, world_size, device)
