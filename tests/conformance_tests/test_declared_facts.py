"""Every backend fact a built-in adapter declares is true of its real library.

A declared fact (``FLAT_PARAMETER_NAME``, ``REFUSALS``, ``MIXED_PRECISION_UNSHARD``,
``NON_TP_2D_STATE_DICT_MESH``; see
docs/writing-an-adapter.md, "Backend facts") changes what the scenarios accept, so each is a
claim about the backend, backed here by a proof that calls the library itself, not the adapter.
The meta-test fails when a built-in declares a fact without a proof, or a proof outlives its
declaration. The same pattern as test_declared_absences.py, for facts instead of gaps.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import re
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn

import conformance.test_unshard_params as unshard_scenarios  # a module, so its tests are not collected here
import fixtures
from conformance.protocol import (
    BackendAdapter,
    BackendEnv,
    Misuse,
    declared_refusal,
    expected_local_numel,
    expected_unsharded_numel,
)
from conformance.protocol.proofs import FactProofs, Proof, raises_declared
from conformance.suite import registry
from harness import current_seed
from tests.conformance_tests.layout_adapters import FlatUnitsOriginalRows, FlatUnitsOriginalRowsMisdeclared

# The built-ins' proofs; the registry and the fact helpers are public (conformance.protocol.proofs)
# so that an adapter package proves its own facts the same way.
REGISTRY = FactProofs()
proves = REGISTRY.proves


def _two_linears(device: torch.device) -> nn.Sequential:
    return fixtures.build(lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), current_seed(), device)


class _CallsBack(nn.Module):
    """Runs ``during_forward`` inside its forward (how a proof reaches into forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.during_forward: Callable[[], None] = lambda: None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.during_forward()
        return self.linear(x)


def _raises_declared(backend: str, misuse: Misuse) -> contextlib.AbstractContextManager[object]:
    """pytest.raises for exactly what the built-in ``backend`` declares for ``misuse``."""
    return raises_declared(registry.load(backend), misuse)


Unshard = Callable[..., contextlib.AbstractContextManager[object]]


def _unshard_in_compute_is_refused(
    backend: str, misuse: Misuse, wrap: Callable[[nn.Module], nn.Module], unshard: Unshard, device: torch.device
) -> None:
    """``unshard(model, writeback=False)`` from inside the forward (UNSHARD_DURING_FORWARD) or the
    backward of the model ``wrap`` shards raises what ``backend`` declares for ``misuse``. The
    library's own calls are passed in, so the proof stays one of the library, not of the adapter."""
    inner = fixtures.build(_CallsBack, current_seed(), device)
    model = wrap(inner)

    def unshard_now() -> None:
        with unshard(model, writeback=False):
            pass

    if misuse is Misuse.UNSHARD_DURING_FORWARD:
        inner.during_forward = unshard_now
        with _raises_declared(backend, misuse):
            model(torch.ones(1, 4, device=device))
    else:
        output = model(torch.ones(1, 4, device=device))
        output.register_hook(lambda grad: unshard_now())
        with _raises_declared(backend, misuse):
            output.sum().backward()


def _unshard_is_refused(
    backend: str, misuse: Misuse, unshard: Callable[[], contextlib.AbstractContextManager[object]]
) -> None:
    """Calling and entering ``unshard()`` raises what ``backend`` declares for ``misuse`` (the call
    is made inside pytest.raises: a library may refuse when it is called or when it is entered)."""
    with _raises_declared(backend, misuse), unshard():
        pass


# -- the reference engine ------------------------------------------------------------------------


@proves("reference", "FLAT_PARAMETER_NAME")
def _engine_names_its_flat_parameter(rank: int, world_size: int, device: torch.device) -> None:
    import engine

    model = engine.fully_shard(_two_linears(device), use_orig_params=False, device=device)
    name = registry.load("reference").FLAT_PARAMETER_NAME
    assert [n for n, _ in model.named_parameters()] == [name]


def _engine_refuses_in_compute(misuse: Misuse) -> Proof:
    def proof(rank: int, world_size: int, device: torch.device) -> None:
        import engine

        wrap = functools.partial(engine.fully_shard, device=device)
        _unshard_in_compute_is_refused("reference", misuse, wrap, engine.unshard_params, device)

    return proof


for _misuse in (Misuse.UNSHARD_DURING_FORWARD, Misuse.UNSHARD_DURING_BACKWARD):
    proves("reference", f"REFUSALS.{_misuse.name}")(_engine_refuses_in_compute(_misuse))


@proves("reference", "REFUSALS.UNSHARD_RANK0_ONLY_WITH_WRITEBACK")
def _engine_refuses_rank0_only_writeback(rank: int, world_size: int, device: torch.device) -> None:
    import engine

    model = engine.fully_shard(_two_linears(device), device=device)
    _unshard_is_refused(
        "reference",
        Misuse.UNSHARD_RANK0_ONLY_WITH_WRITEBACK,
        lambda: engine.unshard_params(model, rank0_only=True, writeback=True),
    )


@proves("reference", "REFUSALS.UNSHARD_OFFLOAD_TO_CPU_NO_SHARD")
def _engine_refuses_offload_no_shard(rank: int, world_size: int, device: torch.device) -> None:
    import engine

    model = engine.fully_shard(_two_linears(device), strategy=engine.ShardingStrategy.NO_SHARD, device=device)
    _unshard_is_refused(
        "reference",
        Misuse.UNSHARD_OFFLOAD_TO_CPU_NO_SHARD,
        lambda: engine.unshard_params(model, offload_to_cpu=True, writeback=False),
    )


@proves("reference", "REFUSALS.TENSOR_PARALLEL_OUTER_MESH_DIM")
def _engine_refuses_tp_on_the_outer_dim(rank: int, world_size: int, device: torch.device) -> None:
    import engine
    from conformance.test_2d import _mesh, _tensor_parallel

    mesh = _mesh(device, ("tp", "dp"))
    with _raises_declared("reference", Misuse.TENSOR_PARALLEL_OUTER_MESH_DIM):  # either step may refuse
        model = _tensor_parallel(fixtures.build(fixtures.ThreeLayerMLP, current_seed(), device), mesh["tp"])
        engine.fully_shard(model, mesh=mesh["dp"], device=device)


# -- torch FSDP1 ---------------------------------------------------------------------------------


@proves("torch-fsdp1", "FLAT_PARAMETER_NAME")
def _fsdp1_names_its_flat_parameter(rank: int, world_size: int, device: torch.device) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(_two_linears(device), use_orig_params=False, device_id=device)
    adapter_cls = registry.load("torch-fsdp1")
    names = [n for n, _ in model.named_parameters()]
    # The wrapper's own path component is what the adapter declares in WRAPPER_COMPONENTS.
    assert names == [f"{component}.{adapter_cls.FLAT_PARAMETER_NAME}" for component in adapter_cls.WRAPPER_COMPONENTS]


def _fsdp1_refuses_in_compute(misuse: Misuse) -> Proof:
    def proof(rank: int, world_size: int, device: torch.device) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        wrap = functools.partial(FSDP, device_id=device)
        _unshard_in_compute_is_refused("torch-fsdp1", misuse, wrap, FSDP.summon_full_params, device)

    return proof


for _misuse in (Misuse.UNSHARD_DURING_FORWARD, Misuse.UNSHARD_DURING_BACKWARD):
    proves("torch-fsdp1", f"REFUSALS.{_misuse.name}")(_fsdp1_refuses_in_compute(_misuse))


@proves("torch-fsdp1", "REFUSALS.UNSHARD_RANK0_ONLY_WITH_WRITEBACK")
def _fsdp1_refuses_rank0_only_writeback(rank: int, world_size: int, device: torch.device) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(_two_linears(device), device_id=device)
    _unshard_is_refused(
        "torch-fsdp1",
        Misuse.UNSHARD_RANK0_ONLY_WITH_WRITEBACK,
        lambda: FSDP.summon_full_params(model, rank0_only=True, writeback=True),
    )


@proves("torch-fsdp1", "REFUSALS.UNSHARD_OFFLOAD_TO_CPU_NO_SHARD")
def _fsdp1_refuses_offload_no_shard(rank: int, world_size: int, device: torch.device) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    model = FSDP(_two_linears(device), sharding_strategy=ShardingStrategy.NO_SHARD, device_id=device)
    _unshard_is_refused(
        "torch-fsdp1",
        Misuse.UNSHARD_OFFLOAD_TO_CPU_NO_SHARD,
        lambda: FSDP.summon_full_params(model, offload_to_cpu=True, writeback=False),
    )


# -- torch FSDP2 ---------------------------------------------------------------------------------


@proves("torch-fsdp2", "MIXED_PRECISION_UNSHARD")
def _fsdp2_unshards_in_the_compute_dtype_and_keeps_the_root(rank: int, world_size: int, device: torch.device) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    declared = registry.load("torch-fsdp2").MIXED_PRECISION_UNSHARD
    policy = MixedPrecisionPolicy(param_dtype=torch.float16)
    model = _two_linears(device)
    fully_shard(model[0], mp_policy=policy)
    fully_shard(model, mp_policy=policy, reshard_after_forward=True)
    model.unshard()
    shown = {p.dtype for p in model[1].parameters()}
    model.reshard()
    assert shown == {torch.float16 if declared.shows_compute_dtype else torch.float32}, shown
    # The root is not resharded after forward (backward needs it at once), so it holds the
    # low-precision parameters gathered; FSDPModule.unshard() then gathers nothing new and the
    # root stays unsharded into backward (torch's private group state: no public accessor).
    output = model(torch.ones(1, 4, device=device))
    model.unshard()
    state = model._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
    assert all(group.is_unsharded for group in groups) == declared.root_stays_unsharded
    assert {p.dtype for p in model[1].parameters()} == {torch.float16}
    output.sum().backward()


@proves("torch-fsdp2", "SHARD_LAYOUT")
def _fsdp2_splits_rows(rank: int, world_size: int, device: torch.device) -> None:
    from torch.distributed.fsdp import fully_shard

    layout = registry.load("torch-fsdp2").SHARD_LAYOUT
    # 5 and 3 rows: uneven at world size 2 (and 4), so the padding shows.
    model = fixtures.build(
        lambda: nn.Sequential(nn.Linear(5, 5, bias=False), nn.Linear(5, 3, bias=False)), current_seed(), device
    )
    shapes = {name: p.shape for name, p in model.named_parameters()}
    fully_shard(model[0])
    fully_shard(model)
    for name, param in model.named_parameters():
        wanted = expected_local_numel(layout, [shapes[name]], 0, rank, world_size)
        assert param.to_local().numel() == wanted, (name, param.to_local().shape, wanted)

    def allocated(unit: nn.Module) -> int:  # torch's private all-gather outputs: no public accessor
        state = unit._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
        outputs = [t for group in groups for p in group.fsdp_params for t in p.all_gather_outputs]
        return sum(t.untyped_storage().nbytes() // t.element_size() for t in outputs)

    model.unshard()  # each FSDPModule gathers only its own parameters
    model[0].unshard()
    full = {"": allocated(model), "0": allocated(model[0])}
    model.reshard()
    model[0].reshard()
    wanted = {
        "": expected_unsharded_numel(layout, [shapes["1.weight"]], world_size),
        "0": expected_unsharded_numel(layout, [shapes["0.weight"]], world_size),
    }
    assert full == wanted, (full, wanted)
    assert allocated(model) == allocated(model[0]) == 0


# -- DeepSpeed -----------------------------------------------------------------------------------


def _deepspeed_stage3(deepspeed: object, model: nn.Module) -> object:
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    return engine


@proves("deepspeed", "SHARD_LAYOUT")
def _deepspeed_pads_each_parameter(rank: int, world_size: int, device: torch.device) -> None:
    import deepspeed

    layout = registry.load("deepspeed").SHARD_LAYOUT
    model = fixtures.build(lambda: nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 3)), current_seed(), device)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    engine = _deepspeed_stage3(deepspeed, model)
    try:
        for name, param in engine.module.named_parameters():
            wanted = expected_local_numel(layout, [shapes[name]], 0, rank, world_size)
            assert param.ds_tensor.numel() == wanted, (name, param.ds_tensor.numel(), wanted)
    finally:
        engine.destroy()


@proves("deepspeed", "UNSHARDED_NAME_PREFIX")
def _deepspeed_keeps_names(rank: int, world_size: int, device: torch.device) -> None:
    """DeepSpeed itself lists the original names inside GatheredParameters; the prefix is the
    attribute under which the adapter's root (DeepSpeedModel) holds the model."""
    import deepspeed

    from conformance.adapters.deepspeed import DeepSpeedModel

    prefix = registry.load("deepspeed").UNSHARDED_NAME_PREFIX
    model = _two_linears(device)
    names = [name for name, _ in model.named_parameters()]
    engine = _deepspeed_stage3(deepspeed, model)
    try:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            assert [name for name, _ in engine.module.named_parameters()] == names
        root = DeepSpeedModel(engine.module, spec=None, config={}, units=[])  # type: ignore[arg-type]
        assert [name for name, _ in root.named_parameters()] == [f"{prefix}.{name}" for name in names]
    finally:
        engine.destroy()


@proves("deepspeed", "MIXED_PRECISION_UNSHARD")
def _deepspeed_gathers_the_low_precision_parameters(rank: int, world_size: int, device: torch.device) -> None:
    import deepspeed

    declared = registry.load("deepspeed").MIXED_PRECISION_UNSHARD
    config = {
        "train_batch_size": world_size,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_allow_untested_optimizer": True,
    }
    model = _two_linears(device)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    try:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            shown = {p.dtype for p in engine.module.parameters()}
        assert shown == {torch.bfloat16 if declared.shows_compute_dtype else torch.float32}, shown
    finally:
        engine.destroy()


# -- 2-D sharded state dicts (both libraries) ----------------------------------------------------


def _non_tp_layout(
    backend: str, world_size: int, device: torch.device, shard: Callable[[nn.Module, object], nn.Module]
) -> dict[str, object]:
    """Shard a model whose first layer is tensor-parallel over the "tp" dimension of a
    (world size / 2, 2) mesh with ``shard(model, dp mesh)``; the layer TP left whole must sit
    where ``backend`` declares (``NON_TP_2D_STATE_DICT_MESH``), the TP one on the 2-D mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh(device.type, (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(_two_linears(device), mesh["tp"], {"0": ColwiseParallel()})
    state = shard(model, mesh["dp"]).state_dict()
    tp_value, whole = state["0.weight"], state["1.weight"]
    assert isinstance(tp_value, DTensor) and tp_value.device_mesh == mesh, tp_value
    assert isinstance(whole, DTensor), type(whole)
    if registry.load(backend).NON_TP_2D_STATE_DICT_MESH == "2-D":
        assert (whole.device_mesh, tuple(whole.placements)) == (mesh, (Shard(0), Replicate())), whole
    else:
        assert (whole.device_mesh, tuple(whole.placements)) == (mesh["dp"], (Shard(0),)), whole
    return state


@proves("reference", "NON_TP_2D_STATE_DICT_MESH", world_size=4)
def _engine_keeps_non_tp_values_on_the_dp_mesh(rank: int, world_size: int, device: torch.device) -> None:
    import engine

    def shard(model: nn.Module, dp_mesh: object) -> nn.Module:
        sharded = engine.fully_shard(model, mesh=dp_mesh, device=device)
        engine.set_state_dict_type(sharded, engine.StateDictKind.SHARDED)
        return sharded

    _non_tp_layout("reference", world_size, device, shard)


@proves("torch-fsdp1", "NON_TP_2D_STATE_DICT_MESH", world_size=4)
def _fsdp1_extension_puts_non_tp_values_on_the_2d_mesh(rank: int, world_size: int, device: torch.device) -> None:
    """The seed's own checks (test_2d_fsdp_state_enable_extension, test_fsdp_2d_extension): a
    DTensorExtensions with a slice of a 2-D mesh, none with a 1-D mesh; and the layout it gives."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.fsdp._common_utils import _get_module_fsdp_state
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel.fsdp import DTensorExtensions

    def shard(model: nn.Module, dp_mesh: object) -> nn.Module:
        sharded = FSDP(model, device_mesh=dp_mesh, use_orig_params=True, device_id=device)
        assert isinstance(_get_module_fsdp_state(sharded)._fsdp_extension, DTensorExtensions)
        FSDP.set_state_dict_type(sharded, StateDictType.SHARDED_STATE_DICT)
        return sharded

    state = _non_tp_layout("torch-fsdp1", world_size, device, shard)
    # The seed's test_2d_state_dict, literally: every value's first (dp) placement is Shard(0).
    assert all(value.placements[0] == Shard(0) for value in state.values()), state
    one_d = init_device_mesh(device.type, (world_size,))
    assert (
        _get_module_fsdp_state(FSDP(_two_linears(device), device_mesh=one_d, device_id=device))._fsdp_extension is None
    )


@proves("torch-fsdp2", "NON_TP_2D_STATE_DICT_MESH", world_size=4)
def _fsdp2_keeps_non_tp_values_on_the_dp_mesh(rank: int, world_size: int, device: torch.device) -> None:
    from torch.distributed.fsdp import fully_shard

    _non_tp_layout("torch-fsdp2", world_size, device, lambda model, dp_mesh: fully_shard(model, mesh=dp_mesh))


# -- the tests -----------------------------------------------------------------------------------


def _installed_builtins() -> list[str]:
    return [
        *registry.BUILTIN,
        *(
            name
            for name, (library, _target, _install) in registry.OPTIONAL_BUILTIN.items()
            if importlib.util.find_spec(library) is not None
        ),
    ]


def test_every_proof_runs() -> None:
    assert set(REGISTRY.at(2)) | set(REGISTRY.at(4)) == set(REGISTRY.proofs), "a proof at a world size no test runs"


def test_every_declared_fact_has_a_proof_and_every_proof_a_fact() -> None:
    builtins = _installed_builtins()
    unproven = {backend: REGISTRY.unproven(backend, registry.load(backend)) for backend in builtins}
    stale = {backend: REGISTRY.stale(backend, registry.load(backend)) for backend in builtins}
    assert {b: facts for b, facts in unproven.items() if facts} == {}, "declared facts without a proof here"
    assert {b: facts for b, facts in stale.items() if facts} == {}, (
        "proofs of facts no adapter declares any more: delete them"
    )


def test_declared_refusals_are_checked_exactly() -> None:
    """A declaration is a type list and a pattern: another type, or a text the pattern misses, is
    a mismatch (what the scenarios report), a subclass of a declared type is not."""
    refusal = declared_refusal(registry.load("torch-fsdp1"), Misuse.UNSHARD_DURING_FORWARD)
    seed_text = "Cannot manually unshard parameters during forward/backward"
    assert refusal.mismatch(AssertionError(seed_text)) is None
    assert "raised RuntimeError" in (refusal.mismatch(RuntimeError(seed_text)) or "")
    assert refusal.mismatch(AssertionError("cannot unshard now")) is not None
    tp = declared_refusal(registry.load("torch-fsdp2"), Misuse.TENSOR_PARALLEL_OUTER_MESH_DIM)
    assert tp.mismatch(RuntimeError("Found TP device_mesh on the 0 dimension of its parent mesh")) is None
    assert tp.mismatch(RuntimeError("TP must be the innermost dimension")) is not None
    assert re.search(tp.pattern, "Found TP device_mesh on the 1 dimension of its parent mesh")


@pytest.mark.world_size(2)
def test_a_flat_parameter_is_one_flat_buffer_under_any_declared_layout(
    rank: int, world_size: int, device: torch.device
) -> None:
    """A backend keeping flat parameters as flat units and original ones in rows declares ROWS,
    the layout of its original parameters: the storage scenarios hold its flat parameters to one
    flat buffer per unit (once, any layout but FLAT_UNIT made them fail: "ROWS has no flat
    parameter per unit") and its original parameters to the declared layout, which must be true
    (the same backend declaring PER_PARAMETER fails on its original parameters only)."""
    env = BackendEnv(rank, world_size, device)
    backend = FlatUnitsOriginalRows(env)
    unshard_scenarios.test_unshard_singleton_writeback(
        backend=backend, use_orig_params=False, rank=rank, world_size=world_size, device=device
    )
    for use_orig_params in (False, True):
        unshard_scenarios.test_unshard_names_and_storage(
            backend=backend, use_orig_params=use_orig_params, world_size=world_size, device=device
        )
    misdeclared = FlatUnitsOriginalRowsMisdeclared(env)
    unshard_scenarios.test_unshard_names_and_storage(
        backend=misdeclared, use_orig_params=False, world_size=world_size, device=device
    )
    # 1.weight (3 x 5): rows of 2 and 1 at two ranks; PER_PARAMETER would be 8 padded elements each.
    with pytest.raises(
        AssertionError, match=r"store \[10, 5\] elements of sharded 1\.weight .*PER_PARAMETER.* gives \[8, 8\]"
    ):
        unshard_scenarios.test_unshard_names_and_storage(
            backend=misdeclared, use_orig_params=True, world_size=world_size, device=device
        )


@pytest.mark.world_size(2)
@pytest.mark.parametrize(("backend_name", "fact"), REGISTRY.at(2), ids=[f"{b}-{f}" for b, f in REGISTRY.at(2)])
def test_declared_fact_is_real(backend_name: str, fact: str, rank: int, world_size: int, device: torch.device) -> None:
    _prove(backend_name, fact, rank, world_size, device)


@pytest.mark.world_size(4)
@pytest.mark.parametrize(("backend_name", "fact"), REGISTRY.at(4), ids=[f"{b}-{f}" for b, f in REGISTRY.at(4)])
def test_declared_2d_fact_is_real(
    backend_name: str, fact: str, rank: int, world_size: int, device: torch.device
) -> None:
    _prove(backend_name, fact, rank, world_size, device)


def _prove(backend_name: str, fact: str, rank: int, world_size: int, device: torch.device) -> None:
    if backend_name not in _installed_builtins():
        library, _target, install = registry.OPTIONAL_BUILTIN[backend_name]
        pytest.skip(reason=f"{library} is not installed here ({install}): its facts are proven where it is")
    assert isinstance(registry.load(backend_name)(BackendEnv(rank, world_size, device)), BackendAdapter)
    REGISTRY.proofs[backend_name, fact](rank, world_size, device)
