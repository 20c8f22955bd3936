"""The optional parts of the adapter protocol: training-loop hooks, storage accessors, labels,
close, structural capabilities.

An adapter written against the protocol before these existed (abstract methods only) must keep
working unchanged: the defaults are plain torch, and every test here that uses
:class:`OldStyleAdapter` checks exactly that.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.nn as nn
from adapter_testing import ops_labelled, run_inner_session, traced_tables, train_steps
from torch.distributed.tensor import DTensor

import fixtures
from conformance.adapters.reference import ReferenceAdapter
from conformance.adapters.torch_fsdp1 import TorchFSDP1Adapter
from conformance.adapters.torch_fsdp2 import TorchFSDP2Adapter
from conformance.protocol import (
    PROTOCOL_VERSION,
    TEMPLATE_METHODS,
    ApiForm,
    BackendAdapter,
    BackendEnv,
    Capability,
    Requirement,
    ShardingSpec,
    ShardingStrategy,
    SpecCondition,
    StateDictKind,
    UnshardRequest,
)
from conformance.protocol import hooks as protocol_hooks
from conformance.suite import backend_fixture
from harness import RankContext
from tests.conformance_tests.old_adapters import OldStyleAdapter

CPU = torch.device("cpu")
ADAM = functools.partial(torch.optim.Adam, lr=1e-2)


def old_style() -> OldStyleAdapter:
    return OldStyleAdapter(BackendEnv(rank=0, world_size=1, device=CPU))


def train_through_hooks(
    backend: BackendAdapter,
    model: nn.Module,
    loss_model: nn.Module,
    plan: fixtures.TrainingPlan,
    rank: int,
    device: torch.device,
) -> list[float]:
    optim = backend.make_optimizer(model, plan.make_optimizer)
    return train_steps(
        backend, model, loss_model, optim, plan.iterations, rank, device, seed=plan.seed, batch_size=plan.batch_size
    )


# -- an adapter without hooks ---------------------------------------------------------------


def test_old_style_adapter_trains_through_the_default_hooks() -> None:
    """The defaults are plain torch: one rank, nothing sharded, so the oracle is exact."""
    plan = fixtures.TrainingPlan(seed=3, iterations=3, batch_size=2, make_optimizer=ADAM)
    oracle = fixtures.train_oracle(
        fixtures.build(fixtures.CompositeModel, 3, CPU, dim=8), plan, world_size=1, device=CPU
    )
    backend = old_style()
    model = fixtures.build(fixtures.CompositeModel, 3, CPU, dim=8)
    sharded = backend.shard(model, ShardingSpec(), ApiForm.COMPOSABLE)
    losses = train_through_hooks(backend, sharded, model, plan, rank=0, device=CPU)
    assert losses == [per_rank[0] for per_rank in oracle.rank_losses]
    for name, expected in oracle.state_dict.items():
        assert torch.equal(model.state_dict()[name], expected), name


def test_default_zero_grad_drops_gradients_and_make_optimizer_sees_every_parameter() -> None:
    backend = old_style()
    model = fixtures.build(fixtures.CompositeModel, 0, CPU, dim=4)
    optim = backend.make_optimizer(model, ADAM)
    assert [p for group in optim.param_groups for p in group["params"]] == list(model.parameters())
    inputs = fixtures.local_batch(model, seed=0, iteration=0, rank=0, batch_size=2, device=CPU)
    backend.backward(model, model.loss(model(*inputs)))
    assert all(p.grad is not None for p in model.parameters())
    backend.zero_grad(model, optim)
    assert all(p.grad is None for p in model.parameters())


def test_default_storage_accessors_read_copies_and_write_through() -> None:
    backend = old_style()
    model = fixtures.build(fixtures.CompositeModel, 0, CPU, dim=4)
    weight = model.unit1.inp.weight
    stored = backend.local_shard(model, "unit1.inp.weight")
    assert torch.equal(stored, weight.detach()) and stored.data_ptr() != weight.data_ptr()
    stored.fill_(7.0)  # a copy: the model is untouched ...
    assert not torch.equal(weight.detach(), stored)
    backend.set_local_shard(model, "unit1.inp.weight", stored)  # ... until written back
    assert torch.equal(weight.detach(), torch.full_like(weight, 7.0))

    assert backend.local_grad_shard(model, "unit1.inp.weight") is None
    with pytest.raises(ValueError, match="stores no gradient"):
        backend.set_local_grad_shard(model, "unit1.inp.weight", torch.zeros(4, 4))
    inputs = fixtures.local_batch(model, seed=0, iteration=0, rank=0, batch_size=2, device=CPU)
    model.loss(model(*inputs)).backward()
    grad = backend.local_grad_shard(model, "unit1.inp.weight")
    assert grad is not None and torch.equal(grad, weight.grad)
    backend.set_local_grad_shard(model, "unit1.inp.weight", torch.ones(4, 4))
    assert torch.equal(weight.grad, torch.ones(4, 4))


def test_default_storage_accessors_explain_bad_names_and_shapes() -> None:
    backend = old_style()
    model = fixtures.build(fixtures.CompositeModel, 0, CPU, dim=4)
    with pytest.raises(KeyError, match=r"no parameter 'unit1\.nope'.*unit1\.inp\.weight"):
        backend.local_shard(model, "unit1.nope")
    with pytest.raises(ValueError, match=r"unit1\.inp\.bias: this rank stores shape \(4,\), got .*\(5,\)"):
        backend.set_local_shard(model, "unit1.inp.bias", torch.zeros(5))


def test_storage_accessors_map_names_through_original_fqn() -> None:
    """A wrapper's path components are the adapter's business: accessors take original FQNs."""

    class Wrapping(OldStyleAdapter):
        def shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
            return nn.ModuleDict({"wrapped": model})

        def original_fqn(self, name: str) -> str:
            return name.removeprefix("wrapped.")

    backend = Wrapping(BackendEnv(rank=0, world_size=1, device=CPU))
    model = fixtures.build(fixtures.CompositeModel, 0, CPU, dim=4)
    sharded = backend.shard(model, ShardingSpec(), ApiForm.WRAPPER)
    assert torch.equal(backend.local_shard(sharded, "proj.bias"), model.proj.bias.detach())


def test_default_label_and_close_do_nothing() -> None:
    backend = old_style()
    assert backend.collective_label() is None
    assert backend.close() is None


# -- the rank fixture: labels registered per test, close, unregistration ----------------------


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []


class LabellingAdapter(OldStyleAdapter):
    name = "labelling"
    recorder = _Recorder()

    def collective_label(self) -> str | None:
        return "unit.weight"

    def close(self) -> None:
        self.recorder.calls.append("close")


def _run_fixture(monkeypatch: pytest.MonkeyPatch, body_raises: bool) -> list[str]:
    calls = LabellingAdapter.recorder.calls = []
    registered: list[Any] = []

    def register(provider: Any) -> Any:
        registered.append(provider)
        calls.append(f"register -> {provider()}")
        return lambda: calls.append("unregister")

    monkeypatch.setattr(backend_fixture, "register_label_provider", register)
    ctx = RankContext(
        rank=0, world_size=1, local_rank=0, device=CPU, params={"backend": f"{__name__}:LabellingAdapter"}
    )
    fixture = contextlib.contextmanager(backend_fixture.backend)(ctx)
    with contextlib.suppress(RuntimeError), fixture as adapter:
        assert isinstance(adapter, LabellingAdapter)
        assert adapter.env.local_rank == 0
        calls.append("body")
        adapter.shard(nn.Linear(2, 2), ShardingSpec(), ApiForm.COMPOSABLE)  # a passing test must shard
        if body_raises:
            raise RuntimeError("the test body failed")
    assert registered and registered[0].__self__ is adapter
    return calls


@pytest.mark.parametrize("body_raises", [False, True], ids=["passed", "failed"])
def test_rank_fixture_registers_the_label_for_the_test_then_closes_and_unregisters(
    monkeypatch: pytest.MonkeyPatch, body_raises: bool
) -> None:
    calls = _run_fixture(monkeypatch, body_raises)
    assert calls == ["register -> unit.weight", "body", "close", "unregister"]


def test_call_sites_skip_the_protocols_own_frames(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A collective issued by a protocol default (say `BackendHooks.backward`) is attributed to the
    scenario's line that called it, never to the protocol's file."""
    from harness.rank import call_sites

    _run_fixture(monkeypatch, body_raises=False)  # (its adapter lives in this file, which it skips too)
    namespace: dict[str, Any] = {"call_site": call_sites.call_site}
    # A protocol default that issues a collective, and a scenario that calls it, each in its file.
    exec(compile("def issue():\n    return call_site(1)\n", protocol_hooks.__file__, "exec"), namespace)
    scenario = str(tmp_path / "test_scenario.py")
    exec(compile("def step():\n    return issue()\n", scenario, "exec"), namespace)
    assert namespace["step"]().endswith("test_scenario.py:2")


# -- capabilities --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (ShardingSpec(), set()),
        (ShardingSpec(auto_wrap_classes=(fixtures.Unit,)), {Capability.UNITS}),
        (ShardingSpec(manual_units=("unit1",), shard_root=False), {Capability.UNITS, Capability.UNMANAGED_ROOT}),
        (
            ShardingSpec(manual_units=("unit1",), strategy_overrides={"": ShardingStrategy.NO_SHARD}),
            {Capability.UNITS, Capability.MIXED_STRATEGIES},
        ),
        # An override equal to the spec's strategy mixes nothing.
        (
            ShardingSpec(manual_units=("unit1",), strategy_overrides={"unit1": ShardingStrategy.FULL_SHARD}),
            {Capability.UNITS},
        ),
    ],
    ids=["whole-model", "auto-wrap", "unmanaged-root", "mixed", "same-override"],
)
def test_structural_capabilities(spec: ShardingSpec, expected: set[Capability]) -> None:
    structural = {Capability.UNITS, Capability.UNMANAGED_ROOT, Capability.MIXED_STRATEGIES}
    assert spec.feature_capabilities() & structural == expected


@pytest.mark.parametrize("adapter_cls", [TorchFSDP1Adapter, TorchFSDP2Adapter], ids=lambda c: c.name)
def test_fsdp_style_adapters_lack_the_optimizer_state_only_strategy(adapter_cls: type[BackendAdapter]) -> None:
    adapter = adapter_cls(BackendEnv(rank=0, world_size=1, device=CPU))
    assert not adapter.supports(Capability.SHARD_OPTIM_STATE)
    assert "optimizer state" in adapter.unsupported_reason(Capability.SHARD_OPTIM_STATE)
    assert Capability.for_strategy(ShardingStrategy.SHARD_OPTIM_STATE) is Capability.SHARD_OPTIM_STATE


@pytest.mark.world_size(2)
@pytest.mark.parametrize("form", list(ApiForm), ids=lambda f: f.value)
def test_reference_shard_optim_state_is_zero1_through_the_hooks(
    form: ApiForm, rank: int, world_size: int, device: torch.device
) -> None:
    """The reference's SHARD_OPTIM_STATE: make_optimizer partitions the optimizer state (each
    rank's Adam holds about half of it), while local_shard / local_grad_shard show the whole
    parameter and the whole averaged gradient on every rank, equal across ranks."""
    backend = ReferenceAdapter(BackendEnv(rank, world_size, device))
    assert backend.supports(Capability.SHARD_OPTIM_STATE)
    model = fixtures.build(fixtures.CompositeModel, 0, device, dim=8)
    full = {name: p.detach().clone() for name, p in model.named_parameters()}
    sharded = backend.shard(
        model, ShardingSpec(strategy=ShardingStrategy.SHARD_OPTIM_STATE, auto_wrap_classes=(fixtures.Unit,)), form
    )
    optim = backend.make_optimizer(sharded, functools.partial(torch.optim.Adam, lr=1e-2))
    train_steps(backend, sharded, model, optim, 1, rank, device)
    total = sum(p.numel() for p in full.values())
    held = sum(s["exp_avg"].numel() for s in optim.state.values())
    assert 0 < held <= total // world_size + len(full), (held, total)
    stored = torch.cat([backend.local_shard(sharded, name).reshape(-1) for name in full])
    grads = torch.cat([backend.local_grad_shard(sharded, name).reshape(-1) for name in full])
    assert stored.numel() == grads.numel() == total
    for name, before in full.items():
        assert backend.local_shard(sharded, name).shape == before.shape, name
    everywhere = torch.stack([stored, grads])
    gathered = [torch.empty_like(everywhere) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, everywhere)
    for other in gathered:
        torch.testing.assert_close(other, everywhere, rtol=0, atol=0)  # replicated


# -- defaults on a real sharded backend ------------------------------------------------------


@pytest.mark.world_size(2)
def test_default_accessors_reach_fsdp2_local_shards(rank: int, world_size: int, device: torch.device) -> None:
    """On DTensor parameters the defaults read and write the local shard, and the write is
    what a later gather shows; gradients are the reduced local shard."""
    backend = TorchFSDP2Adapter(BackendEnv(rank, world_size, device, local_rank=rank))
    model = fixtures.build(fixtures.CompositeModel, 0, device, dim=8)
    sharded = backend.shard(model, ShardingSpec(manual_units=("unit1",)), ApiForm.COMPOSABLE)
    param = sharded.unit1.inp.weight
    assert isinstance(param, DTensor)
    stored = backend.local_shard(sharded, "unit1.inp.weight")
    assert torch.equal(stored, param.to_local())
    backend.set_local_shard(sharded, "unit1.inp.weight", torch.full_like(stored, float(rank + 1)))
    with backend.unshard(sharded, writeback=False):
        full = sharded.unit1.inp.weight.detach().clone()
    rows = 8 // world_size
    assert torch.equal(
        full, torch.arange(1, world_size + 1.0, device=device).repeat_interleave(rows).unsqueeze(1).expand(8, 8)
    )

    plan = fixtures.TrainingPlan(seed=0, iterations=1, batch_size=2, make_optimizer=ADAM)
    optim = backend.make_optimizer(sharded, plan.make_optimizer)
    inputs = fixtures.local_batch(model, seed=0, iteration=0, rank=rank, batch_size=2, device=device)
    backend.zero_grad(sharded, optim)
    backend.backward(sharded, model.loss(sharded(*inputs)))
    grad = backend.local_grad_shard(sharded, "unit1.inp.weight")
    assert grad is not None and torch.equal(grad, param.grad.to_local())


# -- labels end to end: adapter -> rank fixture -> harness trace --------------------------------

LABELLED_STEP = """
import functools
import pytest
import torch
import fixtures
from harness import current_seed
from conformance.protocol import ShardingSpec

@pytest.mark.world_size(2)
def test_step(backend, rank, device):
    model = fixtures.build(fixtures.CompositeModel, current_seed(), device, dim=8)
    sharded = backend.shard(model, ShardingSpec(manual_units=("unit1",)), backend.forms()[0])
    optim = backend.make_optimizer(sharded, functools.partial(torch.optim.SGD, lr=0.1))
    inputs = fixtures.local_batch(model, seed=0, iteration=0, rank=rank, batch_size=2, device=device)
    backend.zero_grad(sharded, optim)
    backend.backward(sharded, model.loss(sharded(*inputs)))
    backend.step(sharded, optim)
"""


def test_adapter_labels_reach_the_trace(tmp_path) -> None:
    """Backward collectives run outside any module forward: the harness's module label is
    empty there, so parameter FQNs in their labels can only come from the adapter's
    collective_label, registered by the rank fixture."""
    backends = ["torch-fsdp2", "torch-fsdp1"]
    result = run_inner_session(tmp_path, LABELLED_STEP, backends, "--show-traces", "-s")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    tables = traced_tables(result.stdout)
    assert len(tables) == len(backends), output  # the backends run in the order given
    for backend, table in zip(backends, tables):
        assert "reduce_scatter_tensor" in ops_labelled(table, "unit1.inp.weight"), (backend, table)


# -- the adapter template keeps working --------------------------------------------------------


@pytest.mark.world_size(2)
def test_the_template_adapter_trains_and_saves_like_the_oracle(
    rank: int, world_size: int, device: torch.device
) -> None:
    from conformance.adapters.template import TemplateAdapter

    backend = TemplateAdapter(BackendEnv(rank, world_size, device, local_rank=rank))
    plan = fixtures.TrainingPlan(seed=0, iterations=3, batch_size=2, make_optimizer=ADAM)
    oracle = fixtures.train_oracle(
        fixtures.build(fixtures.CompositeModel, 0, device, dim=8), plan, world_size=world_size, device=device
    )
    model = fixtures.build(fixtures.CompositeModel, 0, device, dim=8)
    sharded = backend.shard(model, ShardingSpec(strategy=ShardingStrategy.NO_SHARD), ApiForm.WRAPPER)
    losses = train_through_hooks(backend, sharded, model, plan, rank, device)
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor([r[rank] for r in oracle.rank_losses]), rtol=1e-4, atol=1e-4
    )
    state = backend.state_dict(sharded, StateDictKind.FULL)
    assert state.keys() == oracle.state_dict.keys()
    for name, expected in oracle.state_dict.items():
        torch.testing.assert_close(state[name], expected, rtol=1e-3, atol=1e-3)
    optim = backend.make_optimizer(sharded, plan.make_optimizer)
    backend.backward(
        sharded,
        model.loss(sharded(*fixtures.local_batch(model, seed=0, iteration=0, rank=rank, batch_size=2, device=device))),
    )
    backend.step(sharded, optim)
    saved = backend.optim_state_dict(sharded, optim, StateDictKind.FULL)
    assert set(saved["state"]) == {name for name, _ in model.named_parameters()}  # no buffers
    assert backend.local_shard(sharded, "unit1.inp.weight").shape == (8, 8)
    with pytest.raises(pytest.skip.Exception, match="unsupported: sharding units"):
        backend.shard(model, ShardingSpec(strategy=ShardingStrategy.NO_SHARD, manual_units=("unit1",)), ApiForm.WRAPPER)


# -- the protocol checks capabilities, then calls the adapter (template methods) ----------------


class Counting(BackendAdapter):
    """A current-protocol adapter that checks nothing itself and counts what reaches it."""

    name = "counting"
    PROTOCOL_VERSION = PROTOCOL_VERSION
    CAPABILITIES = frozenset(
        {Capability.COMPOSABLE, Capability.FULL_SHARD, Capability.UNSHARD, Capability.FULL_STATE_DICT}
    )

    def __init__(self, env: BackendEnv) -> None:
        super().__init__(env)
        self.reached: list[str] = []

    def _shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
        self.reached.append("shard")
        return model

    def _unshard(self, model: nn.Module, request: UnshardRequest) -> Any:
        self.reached.append("unshard")
        return contextlib.nullcontext()

    def _state_dict(self, model: nn.Module, kind: StateDictKind) -> dict[str, Any]:
        self.reached.append("state_dict")
        return model.state_dict()

    def _load_state_dict(self, model: nn.Module, state_dict: Mapping[str, Any], kind: StateDictKind) -> None:
        self.reached.append("load_state_dict")

    def _optim_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, kind: StateDictKind) -> dict[str, Any]:
        self.reached.append("optim_state_dict")
        return {}

    def _load_optim_state_dict(
        self, model: nn.Module, optim: torch.optim.Optimizer, state_dict: Mapping[str, Any], kind: StateDictKind
    ) -> None:
        self.reached.append("load_optim_state_dict")


def _skip_reason(call: Any) -> str:
    with pytest.raises(pytest.skip.Exception) as skipped:
        call()
    return str(skipped.value.msg)


def test_public_methods_refuse_what_the_adapter_does_not_declare_before_calling_it() -> None:
    backend = Counting(BackendEnv(rank=0, world_size=1, device=CPU))
    model = nn.Linear(2, 2)
    assert "unsupported: wrapper form" in _skip_reason(lambda: backend.shard(model, ShardingSpec(), ApiForm.WRAPPER))
    flat = ShardingSpec(use_orig_params=False)
    assert "use_orig_params=False" in _skip_reason(lambda: backend.shard(model, flat, ApiForm.COMPOSABLE))
    assert "unshard rank0_only" in _skip_reason(
        lambda: backend.unshard(model, writeback=False, rank0_only=True).__enter__()
    )
    assert "sharded state dict" in _skip_reason(lambda: backend.state_dict(model, StateDictKind.SHARDED))
    assert "sharded state dict" in _skip_reason(lambda: backend.load_state_dict(model, {}, StateDictKind.SHARDED))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    assert "optimizer state dict" in _skip_reason(lambda: backend.optim_state_dict(model, optim, StateDictKind.FULL))
    assert "optimizer state dict" in _skip_reason(
        lambda: backend.load_optim_state_dict(model, optim, {}, StateDictKind.FULL)
    )
    assert backend.reached == []  # nothing half-supported reached the adapter
    backend.shard(model, ShardingSpec(), ApiForm.COMPOSABLE)
    with backend.unshard(model, writeback=False):
        pass
    backend.state_dict(model, StateDictKind.FULL)
    assert backend.reached == ["shard", "unshard", "state_dict"]


def test_state_dict_kinds_map_to_their_capabilities() -> None:
    assert Capability.for_state_dict(StateDictKind.FULL) is Capability.FULL_STATE_DICT
    assert Capability.for_state_dict(StateDictKind.SHARDED) is Capability.SHARDED_STATE_DICT


def test_a_current_adapter_cannot_override_a_checking_method() -> None:
    with pytest.raises(TypeError, match=r"overrides shard\(\), which checks .* implement _shard\(\) instead"):

        class Bypassing(Counting):
            def shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
                return model


def test_an_old_adapters_methods_become_the_implementations_and_gain_the_checks() -> None:
    """OldStyleAdapter (no PROTOCOL_VERSION) implemented shard() itself; it keeps working, and
    what it does not declare is refused before its own code runs."""
    backend = old_style()
    assert "_shard" in vars(OldStyleAdapter) and "shard" not in vars(OldStyleAdapter)
    model = nn.Linear(2, 2)
    assert backend.shard(model, ShardingSpec(), ApiForm.COMPOSABLE) is model
    assert "unsupported: wrapper form" in _skip_reason(lambda: backend.shard(model, ShardingSpec(), ApiForm.WRAPPER))


class FlatOnlyOptimState(Counting):
    """Optimizer state dicts only with flat parameters: a combination of a capability and a
    spec-field value that is no capability."""

    name = "flat-only-optim-state"
    CAPABILITIES = Counting.CAPABILITIES | {Capability.FLAT_PARAMETERS, Capability.OPTIM_STATE_DICT}
    UNSUPPORTED_COMBINATIONS: ClassVar[Mapping[frozenset[Requirement], str]] = {
        frozenset({Capability.OPTIM_STATE_DICT, SpecCondition.ORIGINAL_PARAMETERS}): "gathers flat state only"
    }


def test_combinations_may_name_spec_field_values() -> None:
    backend = FlatOnlyOptimState(BackendEnv(rank=0, world_size=1, device=CPU))
    original = backend.shard(nn.Linear(2, 2), ShardingSpec(), ApiForm.COMPOSABLE)
    flat = backend.shard(nn.Linear(2, 2), ShardingSpec(use_orig_params=False), ApiForm.COMPOSABLE)
    optim = torch.optim.SGD(original.parameters(), lr=0.1)
    reason = _skip_reason(lambda: backend.optim_state_dict(original, optim, StateDictKind.FULL))
    assert reason == (
        "unsupported: optimizer state dict with use_orig_params=True (original parameters): gathers flat state only"
    )
    backend.optim_state_dict(flat, optim, StateDictKind.FULL)
    backend.state_dict(original, StateDictKind.FULL)  # the combination names the optimizer state only
    assert backend.reached == ["shard", "shard", "optim_state_dict", "state_dict"]
    assert ShardingSpec().conditions() == set(SpecCondition)
    assert SpecCondition.ORIGINAL_PARAMETERS not in ShardingSpec(use_orig_params=False).conditions()


def test_the_template_lists_every_method_and_declaration_of_the_protocol() -> None:
    """What an adapter author copies shows all they may implement or declare: every method of
    BackendAdapter an adapter provides (the implementations, not the checking public methods)
    and every class-level declaration."""
    from conformance.adapters.template import TemplateAdapter

    public_templates = set(TEMPLATE_METHODS)
    # BackendAdapter and the bases it is split into by concern (facts, capabilities, hooks).
    protocol_members = {
        name: value
        for klass in BackendAdapter.__mro__
        if klass.__module__.startswith("conformance.protocol.")
        for name, value in vars(klass).items()
    }
    provided = {
        name
        for name, value in protocol_members.items()
        if callable(value) and name not in public_templates and not name.startswith("__")
        if name not in {"supports", "unsupported_reason", "forms", "named_parameter", "_specs", "_spec_requirements"}
    }
    declarations = {name for name in protocol_members if name.isupper()}
    missing = sorted((provided | declarations) - set(vars(TemplateAdapter)) - {"EXPECTATIONS"})
    assert missing == [], f"conformance/adapters/template.py lacks {missing}"
