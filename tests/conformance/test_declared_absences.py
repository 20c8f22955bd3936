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
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

import fixtures
from conformance.adapters.torch_fsdp1 import OFFLOAD_TO_CPU_BROKEN_ON_CPU
from conformance.adapters.torch_fsdp2 import HAS_IGNORED_PARAMS
from conformance.protocol import BackendAdapter, BackendEnv, Capability
from conformance.suite import gate, registry
from conformance.test_divergence import training_step
from harness import current_seed

Proof = Callable[[int, int, torch.device], None]
PROOFS: dict[tuple[str, Capability], Proof] = {}
DEVICES = ("cpu", "cuda")


def proves(backend: str, capability: Capability) -> Callable[[Proof], Proof]:
    def register(proof: Proof) -> Proof:
        PROOFS[backend, capability] = proof
        return proof

    return register


def _declared_missing(backend: str, device: str) -> set[Capability]:
    """What the adapter declares missing on ``device``, without running its constructor."""
    adapter_cls = registry.load(backend)
    adapter = adapter_cls.__new__(adapter_cls)
    BackendAdapter.__init__(adapter, BackendEnv(rank=0, world_size=2, device=torch.device(device)))
    return set(Capability) - adapter.capabilities()


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


# -- torch FSDP2 ---------------------------------------------------------------------------------


@proves("torch-fsdp2", Capability.WRAPPER)
def _fsdp2_shards_in_place(rank: int, world_size: int, device: torch.device) -> None:
    from torch.distributed.fsdp import FSDPModule, fully_shard

    model = _two_linears(device)
    children = list(model.children())
    assert fully_shard(model) is model, "fully_shard returned a wrapper"
    assert isinstance(model, FSDPModule) and list(model.children()) == children


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


def test_every_declared_absence_has_a_proof() -> None:
    declared = {
        (backend, capability)
        for backend in _installed_builtins()
        for device in DEVICES
        for capability in _declared_missing(backend, device)
    }
    missing_proofs = sorted(f"{b}: {c.name}" for b, c in declared - PROOFS.keys())
    leftover_proofs = sorted(f"{b}: {c.name}" for b, c in PROOFS.keys() - declared if b in _installed_builtins())
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
    adapter = registry.load(backend_name)(BackendEnv(rank, world_size, device))
    if combination not in adapter.unsupported_combinations():
        pytest.skip(f"{backend_name} supports {sorted(c.name for c in combination)} on {device.type}")
    COMBINATION_PROOFS[backend_name, combination](rank, world_size, device)


def _proof_params() -> list:
    params = []
    for backend, capability in sorted(PROOFS, key=lambda key: (key[0], key[1].name)):
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
    PROOFS[backend_name, capability](rank, world_size, device)


# == lane-mpacc: torch FSDP1 / FSDP2 have no ZeRO-2 layout (SHARD_GRAD_AND_OPTIM_STATE) =========
# Registered after test_declared_absence_is_real took its parameters (_proof_params() runs at
# import, above), so these proofs run through a test of their own, below; the meta-tests above
# see them in PROOFS.


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


ZERO2_PROOFS = (
    ("torch-fsdp1", Capability.SHARD_GRAD_AND_OPTIM_STATE),
    ("torch-fsdp2", Capability.SHARD_GRAD_AND_OPTIM_STATE),
)


@pytest.mark.world_size(2)
@pytest.mark.parametrize(("backend_name", "capability"), ZERO2_PROOFS, ids=lambda v: getattr(v, "name", v))
def test_declared_zero2_absence_is_real(
    backend_name: str, capability: Capability, rank: int, world_size: int, device: torch.device
) -> None:
    test_declared_absence_is_real(backend_name, capability, rank, world_size, device)


# == end lane-mpacc ===============================================================================
