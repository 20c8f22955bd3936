"""No vacuous verdict: a backend that can run nothing is refused at session start, and a
scenario that passes without sharding anything is red (conformance.suite.gate, conformance.suite.vacuity).
The harness's own routes (rank fixtures without a world_size marker, --device cuda without GPUs)
are tested in tests/harness_tests/test_options.py."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from adapter_testing import run_inner_session

from conformance.adapters.template import TemplateAdapter
from conformance.protocol import ApiForm, BackendEnv, Capability, ShardingSpec, ShardingStrategy, ShardLayout
from conformance.suite.gate import SessionDevices, refusal
from conformance.suite.vacuity import ExercisedNothing, ShardWatch, StorageClaimNotMet
from tests.conformance_tests.vacuous_adapters import BrokenConstructorAdapter, NoFormsHereAdapter, ShardsNothingAdapter

CPU = SessionDevices(kinds=("cpu",), reachable=True)
TORCH = torch.__version__


def test_a_backend_without_a_usable_form_is_refused_with_what_is_missing() -> None:
    reason = refusal("no-forms-here", NoFormsHereAdapter, CPU, TORCH)
    assert reason is not None and "capabilities() on cpu include neither WRAPPER or COMPOSABLE" in reason
    assert "--device" in reason


def test_a_backend_that_cannot_be_built_is_refused_with_the_cause() -> None:
    reason = refusal("broken-constructor", BrokenConstructorAdapter, CPU, TORCH)
    assert reason is not None and "RuntimeError: no accelerator runtime found" in reason


def test_usable_backends_and_sessions_without_devices_are_admitted() -> None:
    assert refusal("template", TemplateAdapter, CPU, TORCH) is None
    no_device = SessionDevices(
        kinds=("cuda",), reachable=False
    )  # --device cuda without GPUs: the harness fails that run
    assert refusal("no-forms-here", NoFormsHereAdapter, no_device, TORCH) is None


# In process, no ranks: what the rank fixture's watch concludes from each kind of evidence.


# What harness.collectives_issued() would read in a rank: this process issues none, so the tests
# "issue" one by counting it here.
ISSUED = [0]


def issue_collective() -> None:
    ISSUED[0] += 1


def watched(adapter_cls: type[ShardsNothingAdapter], world_size: int = 2) -> ShardWatch:
    adapter = adapter_cls(BackendEnv(rank=0, world_size=world_size, device=torch.device("cpu"), local_rank=0))
    return ShardWatch(adapter, collectives=lambda: ISSUED[0])


def shard_linear(watch: ShardWatch, strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD) -> nn.Module:
    return watch.adapter.shard(nn.Linear(4, 2), ShardingSpec(strategy=strategy), ApiForm.WRAPPER)


class HalvesStorage(ShardsNothingAdapter):
    """Keeps half of every parameter on this rank: a proper shard."""

    def _shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                setattr(module, name, nn.Parameter(param.detach().flatten()[: (param.numel() + 1) // 2].clone()))
        return model


class ReportsUnits(ShardsNothingAdapter):
    """Keeps full storage but reports a root unit (NO_SHARD units of torch FSDP1, the engine)."""

    CAPABILITIES = ShardsNothingAdapter.CAPABILITIES | {Capability.INTROSPECT_UNIT_FQNS}

    def unit_fqns(self, model: nn.Module) -> dict[str, list[str]]:
        return {"": [name for name, _ in model.named_parameters()]}


class BroadcastsOnShard(ShardsNothingAdapter):
    """Replicates and syncs at start-up (DDP, DeepSpeed stage 0): a collective inside shard()."""

    def _shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
        issue_collective()
        return model


class RefusesToShard(ShardsNothingAdapter):
    def _shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
        raise ValueError("refused")


def test_a_no_op_backend_at_two_ranks_is_vacuous_with_the_fix() -> None:
    watch = watched(ShardsNothingAdapter)
    shard_linear(watch, ShardingStrategy.NO_SHARD)
    issue_collective()  # a collective of the scenario's own, outside the backend's calls
    finding = watch.finding(body_passed=True)
    assert finding is not None
    assert "the shards-nothing backend showed no sign of sharding at world size 2" in str(finding)
    assert "NO_SHARD (wrapper form) kept every parameter at full size" in str(finding)
    assert "leaves those capabilities out of capabilities()" in str(finding)


def test_a_backend_that_keeps_what_its_strategy_shards_whole_is_red_even_with_collectives() -> None:
    """The storage claim replaced "a collective was issued" as evidence: DDP (whole parameters,
    an all-reduce in every backward) declaring FULL_SHARD fails, with the numbers."""
    watch = watched(BroadcastsOnShard)
    shard_linear(watch, ShardingStrategy.FULL_SHARD)
    finding = watch.finding(body_passed=True)
    assert isinstance(finding, StorageClaimNotMet), finding
    assert "the shards-nothing backend does not store what its strategy claims at world size 2" in str(finding)
    assert "FULL_SHARD (wrapper form) claims parameters sharded; this rank stores all 10 parameter elements" in str(
        finding
    )
    # Only the parameters were observable (no backward): every strategy keeping them whole fits.
    assert (
        "FULL_SHARD (wrapper form): what your backend stores (parameters whole) matches NO_SHARD (DDP, ZeRO stage 0), "
        "SHARD_OPTIM_STATE (ZeRO-1) and SHARD_GRAD_AND_OPTIM_STATE (ZeRO-2), which this test cannot tell apart"
    ) in str(finding)
    assert "Fix the adapter" in str(finding)


class WholeOptimizerState(BroadcastsOnShard):
    """DDP with an unsharded optimizer: every rank holds all of the optimizer state."""

    CAPABILITIES = BroadcastsOnShard.CAPABILITIES | {
        Capability.SHARD_OPTIM_STATE,
        Capability.SHARD_GRAD_AND_OPTIM_STATE,
    }


class HalfOptimizerState(WholeOptimizerState):
    """Reports half of each parameter's optimizer state (as a partitioning optimizer stores)."""

    def local_optim_state(self, model, optimizer, fqn):
        return {
            name: value[: (value.numel() + 1) // 2]
            for name, value in super().local_optim_state(model, optimizer, fqn).items()
        }


def stepped(watch: ShardWatch, strategy: ShardingStrategy) -> None:
    model = shard_linear(watch, strategy)
    optimizer = watch.adapter.make_optimizer(model, functools.partial(torch.optim.Adam, lr=0.1))
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()


@pytest.mark.parametrize("strategy", [ShardingStrategy.SHARD_OPTIM_STATE, ShardingStrategy.SHARD_GRAD_AND_OPTIM_STATE])
def test_ddp_with_an_unsharded_optimizer_declaring_zero_is_red(strategy: ShardingStrategy) -> None:
    watch = watched(WholeOptimizerState)
    stepped(watch, strategy)
    finding = watch.finding(body_passed=True)
    assert isinstance(finding, StorageClaimNotMet), finding
    if strategy is ShardingStrategy.SHARD_GRAD_AND_OPTIM_STATE:  # the gradients are read first
        assert "claims gradients sharded; this rank stores 10 gradient elements of a model with 10" in str(finding)
    assert "claims optimizer state sharded; this rank stores 10 elements of the optimizer's 'exp_avg' state" in str(
        finding
    )
    assert (
        f"{strategy.name} (wrapper form): what your backend stores (parameters whole, gradients whole, optimizer "
        f"state whole) matches NO_SHARD (DDP, ZeRO stage 0): declare that instead of {strategy.name}"
    ) in str(finding)


class HalfGradients(BroadcastsOnShard):
    """Whole parameters, but half of each gradient after backward: what a ZeRO-2 backend stores."""

    CAPABILITIES = WholeOptimizerState.CAPABILITIES

    def local_grad_shard(self, model, fqn):
        grad = super().local_grad_shard(model, fqn)
        return None if grad is None else grad.flatten()[: (grad.numel() + 1) // 2]


class Zero2Storage(HalfGradients, HalfOptimizerState):
    """Whole parameters, half of each gradient and of each optimizer state: ZeRO-2's storage."""


def test_a_zero2_backend_declared_as_shard_grad_op_is_told_to_declare_zero2() -> None:
    """What an adapter written from the docs before protocol 5 did (DeepSpeed's stage 2 mapped to
    SHARD_GRAD_OP, which also shards parameters at rest): the finding names the strategy whose
    claims match what the rank stores."""
    watch = watched(Zero2Storage)
    stepped(watch, ShardingStrategy.SHARD_GRAD_OP)
    finding = watch.finding(body_passed=True)
    assert isinstance(finding, StorageClaimNotMet), finding
    assert "SHARD_GRAD_OP (wrapper form) claims parameters sharded; this rank stores all 10 parameter" in str(finding)
    assert (
        "SHARD_GRAD_OP (wrapper form): what your backend stores (parameters whole, gradients sharded, optimizer "
        "state sharded) matches SHARD_GRAD_AND_OPTIM_STATE (ZeRO-2): declare that instead of SHARD_GRAD_OP"
    ) in str(finding)
    # The same storage meets the ZeRO-2 claim.
    zero2 = watched(Zero2Storage)
    stepped(zero2, ShardingStrategy.SHARD_GRAD_AND_OPTIM_STATE)
    assert zero2.finding(body_passed=True) is None


def test_storage_that_no_strategy_claims_is_said_to_match_none() -> None:
    """Gradients sharded but optimizer state whole: ZeRO-2 fails on the optimizer state, and no
    strategy (ZeRO-1 keeps gradients whole) stores that, so none is named."""
    watch = watched(HalfGradients)
    stepped(watch, ShardingStrategy.SHARD_GRAD_AND_OPTIM_STATE)
    finding = watch.finding(body_passed=True)
    assert isinstance(finding, StorageClaimNotMet), finding
    assert "claims optimizer state sharded; this rank stores 10 elements of the optimizer's 'exp_avg' state" in str(
        finding
    )
    assert (
        "SHARD_GRAD_AND_OPTIM_STATE (wrapper form): its claim for optimizer state failed, and no strategy matches "
        "what your backend stores (parameters whole, gradients sharded, optimizer state whole)"
    ) in str(finding)
    assert "declare that" not in str(finding)


def test_a_partitioned_optimizer_state_meets_the_zero1_claim() -> None:
    watch = watched(HalfOptimizerState)
    stepped(watch, ShardingStrategy.SHARD_OPTIM_STATE)
    assert watch.finding(body_passed=True) is None


def test_a_zero1_test_that_never_stepped_falls_back_to_the_backends_collectives() -> None:
    quiet = watched(ShardsNothingAdapter)  # no collective: nothing the claim shards was observable
    quiet.adapter.CAPABILITIES = WholeOptimizerState.CAPABILITIES
    shard_linear(quiet, ShardingStrategy.SHARD_OPTIM_STATE)
    assert isinstance(quiet.finding(body_passed=True), ExercisedNothing)
    syncing = watched(WholeOptimizerState)  # a start-up broadcast shows replication
    shard_linear(syncing, ShardingStrategy.SHARD_OPTIM_STATE)
    assert syncing.finding(body_passed=True) is None


@pytest.mark.parametrize(
    ("adapter_cls", "strategy"),
    [
        (HalvesStorage, ShardingStrategy.FULL_SHARD),
        (ReportsUnits, ShardingStrategy.FULL_SHARD),
        (BroadcastsOnShard, ShardingStrategy.NO_SHARD),
    ],
)
def test_each_sign_of_sharding_is_enough(adapter_cls: type[ShardsNothingAdapter], strategy: ShardingStrategy) -> None:
    watch = watched(adapter_cls)
    shard_linear(watch, strategy)
    assert watch.finding(body_passed=True) is None


def test_world_size_one_failures_and_refusals_are_left_alone() -> None:
    single = watched(ShardsNothingAdapter, world_size=1)
    shard_linear(single)
    assert single.finding(body_passed=True) is None
    failed = watched(ShardsNothingAdapter)
    shard_linear(failed)
    assert failed.finding(body_passed=False) is None  # the test's own failure stands
    refusing = watched(RefusesToShard)
    with pytest.raises(ValueError, match="refused"):  # as a misuse scenario expects: no model to inspect
        shard_linear(refusing)
    assert refusing.finding(body_passed=True) is None


class RowsOnRankZero(ShardsNothingAdapter):
    """ROWS layout done right on every rank: rank 0 keeps the first ceil(rows / 2) rows of each
    parameter, rank 1 the rest (nothing of a one-row weight); ``keep_all`` replicates instead."""

    SHARD_LAYOUT = ShardLayout.ROWS
    keep_all = False

    def _shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if not self.keep_all:
                    chunks = torch.chunk(param.detach(), self.env.world_size, dim=0)
                    part = chunks[self.env.rank] if self.env.rank < len(chunks) else param.detach()[:0]
                    setattr(module, name, nn.Parameter(part.clone()))
        return model


class RowsKeptWhole(RowsOnRankZero):
    keep_all = True


def _singleton_watch(adapter_cls: type[ShardsNothingAdapter], rank: int, with_grads: bool = False) -> ShardWatch:
    adapter = adapter_cls(BackendEnv(rank=rank, world_size=2, device=torch.device("cpu"), local_rank=rank))
    watch = ShardWatch(adapter, collectives=lambda: 0)
    sharded = adapter.shard(nn.Linear(1, 1, bias=False), ShardingSpec(), ApiForm.WRAPPER)
    if with_grads:  # a backward left each rank's gradient of what it stores
        for param in sharded.parameters():
            param.grad = torch.ones_like(param)
    return watch


def test_a_rank_whose_share_is_the_whole_parameter_passes_without_units_and_replication_still_fails() -> None:
    """A 1-element weight under ROWS: rank 0's share is all of it and rank 1's is nothing. A
    unit-less backend that shards right passes on both ranks (rank 0 by its declared layout);
    one that replicates passes on rank 0, where the two look alike, and fails on rank 1."""
    assert _singleton_watch(RowsOnRankZero, rank=0).finding(body_passed=True) is None
    assert _singleton_watch(RowsOnRankZero, rank=1).finding(body_passed=True) is None
    assert _singleton_watch(RowsKeptWhole, rank=0).finding(body_passed=True) is None
    finding = _singleton_watch(RowsKeptWhole, rank=1).finding(body_passed=True)
    assert isinstance(finding, StorageClaimNotMet), finding
    assert "FULL_SHARD (wrapper form) claims parameters sharded; this rank stores all 1 parameter elements" in str(
        finding
    )


def test_a_rank_whose_share_is_the_whole_gradient_passes_and_replication_still_fails() -> None:
    """The same with the gradients stored after a backward: rank 0 holds the whole gradient of
    the 1-element weight, its share, which is sharding (it failed "claims gradients sharded"
    before); the replicating backend still fails on rank 1."""
    assert _singleton_watch(RowsOnRankZero, rank=0, with_grads=True).finding(body_passed=True) is None
    assert _singleton_watch(RowsOnRankZero, rank=1, with_grads=True).finding(body_passed=True) is None
    finding = _singleton_watch(RowsKeptWhole, rank=1, with_grads=True).finding(body_passed=True)
    assert isinstance(finding, StorageClaimNotMet), finding


def test_a_layout_that_gives_every_rank_the_whole_parameter_is_no_evidence() -> None:
    """PER_PARAMETER pads a 1-element weight to one element on every rank: whole storage is what
    a replicating backend shows too, so without units or collectives the pass stays unproven."""

    class PaddedPerParameter(RowsKeptWhole):
        SHARD_LAYOUT = ShardLayout.PER_PARAMETER

    finding = _singleton_watch(PaddedPerParameter, rank=0).finding(body_passed=True)
    assert isinstance(finding, StorageClaimNotMet), finding


SHARDS = """
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from conformance.protocol import ApiForm, ShardingSpec, ShardingStrategy

@pytest.mark.world_size(1)
def test_loops_over_no_form(backend):
    for form in []:  # what a scenario did for a backend whose forms() came back empty
        backend.shard(nn.Linear(2, 2), ShardingSpec(), form)

@pytest.mark.world_size(1)
def test_shards(backend, device):
    spec = ShardingSpec(strategy=ShardingStrategy.NO_SHARD)
    backend.shard(nn.Linear(2, 2).to(device), spec, backend.forms()[0])

@pytest.mark.world_size(1)
def test_skips(backend):
    pytest.skip("unsupported: something")

@pytest.mark.world_size(1)
def test_fails(backend):
    assert False, "its own failure"

@pytest.mark.world_size(2)
def test_replicates_at_two_ranks(backend, device):
    model = backend.shard(nn.Linear(2, 2).to(device), ShardingSpec(strategy=ShardingStrategy.NO_SHARD), ApiForm.WRAPPER)
    total = torch.ones(1, device=device)
    dist.all_reduce(total)  # the scenario's own collective: no sign that the backend did anything
    assert total.item() == 2 and model is not None
"""


def test_vacuous_routes_end_to_end(tmp_path) -> None:
    """One inner session (each costs ~1-3 s): the refused backend stops the run at selection;
    with a usable backend a test that passed without sharding is red, the rest keep their own
    verdicts."""
    refused = run_inner_session(
        tmp_path, SHARDS, ["tests.conformance_tests.vacuous_adapters:NoFormsHereAdapter"], "--device", "cpu"
    )
    assert refused.returncode == pytest.ExitCode.USAGE_ERROR, refused.stdout + refused.stderr
    assert "backend 'no-forms-here' cannot run here: its capabilities() on cpu include neither" in refused.stderr

    result = run_inner_session(
        tmp_path,
        SHARDS,
        [
            "conformance.adapters.template:TemplateAdapter",
            "tests.conformance_tests.vacuous_adapters:ShardsNothingAdapter",
        ],
        "--device",
        "cpu",
    )
    output = result.stdout + result.stderr
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, output
    assert "FAILED test_inner.py::test_loops_over_no_form[template-ddp]" in output
    assert "passed without calling backend.shard(): it checked nothing of the template-ddp backend" in output, output
    assert "PASSED test_inner.py::test_shards[template-ddp]" in output
    assert "SKIPPED" in output and "unsupported: something" in output
    assert "FAILED test_inner.py::test_fails[template-ddp]" in output and "its own failure" in output
    # At two ranks DDP's start-up broadcast shows that the template replicates; the no-op backend
    # shows nothing (the scenario's own all_reduce is not the backend's), and is red with the fix.
    assert "PASSED test_inner.py::test_replicates_at_two_ranks[template-ddp]" in output, output
    assert "FAILED test_inner.py::test_replicates_at_two_ranks[shards-nothing]" in output, output
    assert "the shards-nothing backend showed no sign of sharding at world size 2" in output, output
    assert "Fix the adapter: _shard() must apply the backend's sharding" in output, output
    assert "PASSED test_inner.py::test_shards[shards-nothing]" in output, output  # world size 1: nothing to show
