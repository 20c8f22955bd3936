"""Protocol versioning (conformance.protocol.versions) and adapters that cannot be used at all: an older
adapter runs with one warning naming what it misses and what that cost, and fails nothing for the
suite's reasons (its own helpers keep their names, its wrapper's prefix does not hide its
parameters); an adapter module that fails to import, or an adapter missing abstract methods, is a
usage error at selection. And what a user quotes in a report: ``python -m conformance --version``
(package, protocol and the torch range CI proves), with docs/changelog.md saying per protocol
version what an adapter must change."""

from __future__ import annotations

import contextlib
import importlib.metadata
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.nn as nn
from adapter_testing import run_inner_session

from conformance.__main__ import main
from conformance.protocol import (
    PROTOCOL_VERSION,
    ApiForm,
    BackendEnv,
    BackendHooks,
    Capability,
    ShardingSpec,
    ShardingStrategy,
    UnshardRequest,
    versions,
)
from conformance.suite import registry
from tests.conformance_tests.old_adapters import (
    FirstProtocolAdapter,
    Incomplete,
    ZeroStyleFirstProtocolAdapter,
    ZeroTwoAsShardGradOpAdapter,
)

REPO = Path(__file__).resolve().parents[2]


class _FirstProtocolDeclaringGaps(FirstProtocolAdapter):
    """Protocol 1, but it declares two later capabilities missing, with reasons."""

    name = "first-protocol-declaring-gaps"
    UNSUPPORTED_REASONS: ClassVar[Mapping[Capability, str]] = {
        Capability.UNITS: "this backend shards the whole model as one unit",
        Capability.NATIVE_CHECKPOINT: "this backend has no checkpoint format of its own",
    }


def test_a_capability_declared_missing_is_no_shortfall() -> None:
    """A later capability an old adapter lists in UNSUPPORTED_REASONS is a declaration: the
    warning neither names it nor counts the scenarios it skips."""
    declared_missing = set(_FirstProtocolDeclaringGaps.UNSUPPORTED_REASONS)
    plain = versions.shortfall(FirstProtocolAdapter)
    shortfall = versions.shortfall(_FirstProtocolDeclaringGaps)
    assert plain is not None and shortfall is not None
    assert declared_missing <= plain.capabilities  # short without the declaration
    assert shortfall.capabilities == plain.capabilities - declared_missing
    assert not shortfall.costs(f"unsupported: {Capability.UNITS.value}: this backend shards the whole model")
    assert shortfall.costs(f"unsupported: {Capability.UNMANAGED_ROOT.value}: the adapter does not provide it")
    text = shortfall.describe(_FirstProtocolDeclaringGaps.name, 1)
    assert "UNITS" not in text.replace("UNMANAGED_ROOT", "") and "NATIVE_CHECKPOINT" not in text


def test_an_older_adapter_is_told_what_it_does_not_declare() -> None:
    shortfall = versions.shortfall(FirstProtocolAdapter)
    assert shortfall is not None and shortfall.version == 1
    later = [versions.ADDED[v].capabilities for v in range(2, PROTOCOL_VERSION + 1)]
    assert shortfall.capabilities == frozenset().union(*later)  # it declares none of them
    assert "make_optimizer" in shortfall.hooks and "collective_label" in shortfall.hooks
    assert shortfall.facts == (
        "FLAT_PARAMETER_NAME",
        "REFUSALS",
        "MIXED_PRECISION_UNSHARD",
        "SHARD_LAYOUT",
        "UNSHARDED_NAME_PREFIX",
        "NON_TP_2D_STATE_DICT_MESH",
        "BACKEND_MODULES",
    )
    assert shortfall.costs(f"unsupported: {Capability.UNITS.value}: the first-protocol adapter does not provide it")
    assert not shortfall.costs(f"unsupported: {Capability.WRAPPER.value}: no wrapper")  # a version-1 capability
    text = shortfall.describe("first-protocol", 3)
    assert f"written for protocol version 1 (current: {PROTOCOL_VERSION})" in text and "(3 scenarios skipped" in text
    assert f"set PROTOCOL_VERSION = {PROTOCOL_VERSION}" in text


def test_the_builtins_are_written_for_the_current_protocol() -> None:
    for name in registry.BUILTIN:
        assert versions.shortfall(registry.load(name)) is None, name


def test_an_adapter_module_failing_at_import_is_one_selection_error() -> None:
    with pytest.raises(registry.BackendSelectionError) as error:
        registry.select(["tests.conformance_tests.raising_adapter_module:Adapter"])
    message = str(error.value)
    assert "raised RuntimeError: CUDA driver initialization failed" in message
    assert "fix the adapter module" in message


def test_an_adapter_missing_abstract_methods_is_refused_at_selection() -> None:
    with pytest.raises(
        registry.BackendSelectionError, match=r"does not implement .* _load_optim_state_dict, _optim_state_dict"
    ):
        registry.select(["tests.conformance_tests.old_adapters:Incomplete"])


USES_UNITS = f"""
import pytest

# Not distributed (no rank pool to start): the skip a rank would report for a missing UNITS.
@pytest.mark.parametrize("case", ["a", "b"])
def test_units(backend, case):
    pytest.skip("unsupported: {Capability.UNITS.value}: the first-protocol adapter does not provide it")

def test_plain(backend):
    pass
"""


def test_older_adapter_runs_with_one_warning_and_its_cost(tmp_path) -> None:
    result = run_inner_session(tmp_path, USES_UNITS, ["tests.conformance_tests.old_adapters:FirstProtocolAdapter"])
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "1 passed, 2 skipped" in output
    assert output.count("was written for protocol version 1") == 1, output
    later = frozenset().union(*(versions.ADDED[v].capabilities for v in range(2, PROTOCOL_VERSION + 1)))
    listed = ", ".join(sorted(capability.name for capability in later))
    assert f"does not declare the capabilities {listed} (2 scenarios" in output, output
    assert "INTROSPECT_STORAGE, MIXED_STRATEGIES, NATIVE_CHECKPOINT" in listed  # versions 2 to 4 among them


def test_an_adapter_module_failing_at_import_exits_4_with_one_message(tmp_path) -> None:
    """Not a 30-line INTERNALERROR: one usage error (the abstract-method refusal takes the same
    path, registry.load -> BackendSelectionError -> pytest.UsageError)."""
    result = run_inner_session(tmp_path, USES_UNITS, ["tests.conformance_tests.raising_adapter_module:Adapter"])
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert "raised RuntimeError: CUDA driver initialization failed" in result.stderr
    assert "INTERNALERROR" not in result.stderr + result.stdout


# -- an old adapter fails nothing for the suite's reasons ------------------------------------------

CPU = torch.device("cpu")


def _zero_style() -> ZeroStyleFirstProtocolAdapter:
    return ZeroStyleFirstProtocolAdapter(BackendEnv(rank=0, world_size=1, device=CPU))


def test_an_old_adapters_own_helper_is_never_taken_for_the_implementation() -> None:
    """Its public unshard() is what the template calls, with every option the template passes
    (once the helper was called instead: "unexpected keyword argument 'rank0_only'"); its own
    ``_unshard(engine, fqn, writeback)`` stays the helper its own code calls."""
    backend = _zero_style()
    engine = backend.shard(
        nn.Sequential(nn.Linear(2, 2)), ShardingSpec(strategy=ShardingStrategy.NO_SHARD), ApiForm.WRAPPER
    )
    with backend.unshard(engine, "0", writeback=False, rank0_only=False):
        pass
    assert backend.gathered == [("0", False)]
    with backend._unshard(engine, "", True):  # the adapter's own call of its own helper
        pass
    assert backend.gathered == [("0", False), ("", True)]


class _FifthProtocolUnshard(Incomplete):
    """Written for protocol 5: ``_unshard`` takes the options as keywords (no UnshardRequest)."""

    name = "fifth-protocol"
    PROTOCOL_VERSION = 5
    CAPABILITIES = frozenset({Capability.COMPOSABLE, Capability.UNSHARD, Capability.UNSHARD_WRITEBACK})

    def __init__(self, env: BackendEnv) -> None:
        super().__init__(env)
        self.asked: list[tuple[str, dict[str, bool]]] = []

    def _unshard(self, model: nn.Module, fqn: str = "", **options: bool) -> Any:  # type: ignore[override]
        self.asked.append((fqn, options))
        return contextlib.nullcontext()

    def _state_dict(self, model: nn.Module, kind: Any) -> dict[str, Any]:
        return model.state_dict()

    def _load_state_dict(self, model: nn.Module, state_dict: Mapping[str, Any], kind: Any) -> None:
        model.load_state_dict(dict(state_dict))

    def _optim_state_dict(self, model: nn.Module, optim: Any, kind: Any) -> dict[str, Any]:
        raise AssertionError("not called here")

    def _load_optim_state_dict(self, model: nn.Module, optim: Any, state_dict: Mapping[str, Any], kind: Any) -> None:
        raise AssertionError("not called here")


class _SixthProtocolUnshard(_FifthProtocolUnshard):
    """The same adapter written for the current protocol (6 and later): one UnshardRequest."""

    name = "sixth-protocol"
    PROTOCOL_VERSION = PROTOCOL_VERSION

    def _unshard(self, model: nn.Module, request: UnshardRequest) -> Any:  # type: ignore[override]
        self.asked.append((request.fqn, {"request": request}))
        return contextlib.nullcontext()


def test_unshard_reaches_a_version_5_adapter_as_keywords_and_a_current_one_as_one_request() -> None:
    env = BackendEnv(rank=0, world_size=1, device=torch.device("cpu"))
    model = nn.Sequential(nn.Linear(2, 2))
    old, current = _FifthProtocolUnshard(env), _SixthProtocolUnshard(env)
    for backend in (old, current):
        with backend.unshard(model, "0", writeback=False):
            pass
    assert old.asked == [
        ("0", {"writeback": False, "rank0_only": False, "offload_to_cpu": False, "recurse": True, "with_grads": False})
    ]
    assert current.asked == [("0", {"request": UnshardRequest(fqn="0", writeback=False)})]
    # The old form runs, and the warning says it is the old form and what the new one is.
    shortfall = versions.shortfall(_FifthProtocolUnshard)
    assert shortfall is not None and shortfall.signatures == ("_unshard",)
    text = shortfall.describe(_FifthProtocolUnshard.name, 0)
    assert "implements _unshard in its version-5 form, which still runs" in text
    assert "_unshard(self, model, request)" in text and f"set PROTOCOL_VERSION = {PROTOCOL_VERSION}" in text
    assert versions.shortfall(_SixthProtocolUnshard) is None


def test_an_old_adapters_parameters_are_found_through_its_wrapper() -> None:
    """Its engine names parameters ``module.<fqn>``, a prefix it could not declare: the storage
    hooks find them by their original FQN; a name matching none, or several, says what to declare."""
    backend = _zero_style()
    engine = backend.shard(
        nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1)),
        ShardingSpec(strategy=ShardingStrategy.NO_SHARD),
        ApiForm.WRAPPER,
    )
    assert torch.equal(backend.local_shard(engine, "1.weight"), engine.module[1].weight.detach())
    assert backend.local_grad_shard(engine, "0.bias") is None
    with pytest.raises(KeyError, match=r"no parameter ends in '\.2\.weight'.*Declare them in WRAPPER_COMPONENTS"):
        backend.local_shard(engine, "2.weight")
    with pytest.raises(KeyError, match=r"several parameters end in '\.weight': \['module\.0\.weight', 'module\.1"):
        backend.local_shard(engine, "weight")


def test_a_current_adapter_keeps_the_exact_lookup() -> None:
    """Only adapters written before WRAPPER_COMPONENTS could be declared are looked up through
    their wrapper: a current one that leaves its wrapper undeclared is told so by the exact lookup."""
    assert Incomplete.named_parameter is BackendHooks.named_parameter
    assert ZeroStyleFirstProtocolAdapter.named_parameter is not BackendHooks.named_parameter


OLD_ZERO_STYLE = """
import pytest
import torch
import torch.nn as nn
from conformance.protocol import ApiForm, ShardingSpec, ShardingStrategy

@pytest.mark.world_size(2)
def test_old_adapter_unshards_and_shows_its_storage(backend, rank, device):
    model = nn.Sequential(nn.Linear(3, 3)).to(device)
    with torch.no_grad():
        model[0].weight.fill_(rank + 1)  # the engine starts every rank from rank 0's parameters
    sharded = backend.shard(model, ShardingSpec(strategy=ShardingStrategy.NO_SHARD), ApiForm.WRAPPER)
    with backend.unshard(sharded, writeback=True, rank0_only=False, offload_to_cpu=False, recurse=True):
        pass
    assert backend.gathered == [("", True)]
    assert torch.equal(backend.local_shard(sharded, "0.weight"), torch.ones(3, 3, device=device))
"""


def test_an_old_zero_style_adapter_runs_in_ranks_with_one_warning(tmp_path) -> None:
    """End to end at two ranks, through the rank fixture and the template methods: passes, with
    the version warning."""
    result = run_inner_session(
        tmp_path, OLD_ZERO_STYLE, ["tests.conformance_tests.old_adapters:ZeroStyleFirstProtocolAdapter"]
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "1 passed" in output, output
    assert output.count("backend 'zero-style-first-protocol' was written for protocol version 1") == 1, output


# -- what a user reports: the version line, the torch range, the changelog ---------------------


def _release(version: str) -> tuple[int, ...]:
    """``2.13.0+cpu`` -> (2, 13, 0): the release numbers, for ordering versions CI names."""
    return tuple(int(part) for part in version.partition("+")[0].split("."))


def test_python_m_conformance_version_prints_the_version_line(tmp_path: Path) -> None:
    """In a fresh process, as a user runs it (outside the checkout: the installed package)."""
    result = subprocess.run(
        [sys.executable, "-m", "conformance", "--version"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    oldest, newest = versions.SUPPORTED_TORCH
    expected = (
        f"fsdp-conformance {importlib.metadata.version('fsdp-conformance')}, adapter protocol {PROTOCOL_VERSION}, "
        f"torch {oldest} to {newest} (this one: {torch.__version__})"
    )
    assert result.stdout.splitlines() == [expected], result.stdout + result.stderr


def test_without_arguments_it_says_how_to_run_the_suite(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    shown = capsys.readouterr().out
    assert "python -m pytest --pyargs conformance --backend package.module:AdapterClass [--backend-path DIR]" in shown
    assert shown.splitlines()[-1] == versions.version_line()


def test_an_uninstalled_checkout_says_it_has_no_package_version(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(versions.metadata, "version", not_installed)
    assert versions.package_version() == "unknown (not installed: pip install -e .)"
    assert versions.version_line().startswith("fsdp-conformance unknown (not installed: pip install -e .), ")


def test_the_supported_torch_range_is_the_one_ci_proves() -> None:
    """The ends are the torch versions .ci/run hands to .ci/torch-leg, and the main leg's pin lies
    between them: a range CI no longer runs cannot stay in the version line."""
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    legs = re.findall(r"^\.ci/torch-leg (\S+) ", ci, re.M)
    pins = re.findall(r"\btorch==(\S+)", ci)
    assert len(legs) >= 2 and pins, "no torch legs found in .ci/run: has its form changed?"
    assert (min(legs, key=_release), max(legs, key=_release)) == versions.SUPPORTED_TORCH
    oldest, newest = (_release(version) for version in versions.SUPPORTED_TORCH)
    assert all(oldest <= _release(pin) <= newest for pin in pins), pins


def test_the_changelog_has_a_section_for_every_protocol_version() -> None:
    text = (REPO / "docs" / "changelog.md").read_text(encoding="utf-8")
    sections = dict(re.findall(r"^### Protocol (\d+): (.+)$", text, re.M))
    assert {int(version): title for version, title in sections.items()} == versions.CHANGELOG
    assert set(versions.CHANGELOG) == set(range(1, PROTOCOL_VERSION + 1))
    # Each says what an adapter of the version before must change (protocol 1: that nothing must).
    for version in range(1, PROTOCOL_VERSION + 1):
        body = text.partition(f"### Protocol {version}: ")[2].partition("\n### ")[0]
        assert "must change" in body, f"docs/changelog.md, protocol {version}: what must an adapter change?"
    assert f"| {importlib.metadata.version('fsdp-conformance')} | {PROTOCOL_VERSION} |" in text


MOVED = "declares SHARD_GRAD_OP, whose meaning moved"


def test_an_adapter_from_before_5_declaring_shard_grad_op_is_told_its_meaning_moved() -> None:
    """Before protocol 5 the guide mapped ZeRO stage 2 onto SHARD_GRAD_OP; an adapter of then
    that declares it is told what SHARD_GRAD_OP means now and what to declare instead."""
    shortfall = versions.shortfall(ZeroTwoAsShardGradOpAdapter)
    assert shortfall is not None
    assert [moved.strategy for moved in shortfall.moved] == [ShardingStrategy.SHARD_GRAD_OP]
    text = shortfall.describe(ZeroTwoAsShardGradOpAdapter.name, 0)
    assert f"{MOVED} (before version 5 the adapter guide mapped DeepSpeed ZeRO stage 2 onto SHARD_GRAD_OP" in text
    assert "must declare SHARD_GRAD_AND_OPTIM_STATE instead" in text
    # The rest of the warning is as before.
    assert "written for protocol version 4 (current: " in text and "implements _unshard in its version-4" in text


class _FifthProtocolShardGradOp(_FifthProtocolUnshard):
    """Written for protocol 5, when SHARD_GRAD_OP already meant what it means now."""

    name = "fifth-protocol-shard-grad-op"
    CAPABILITIES = _FifthProtocolUnshard.CAPABILITIES | {Capability.SHARD_GRAD_OP}


class _CurrentShardGradOp(_SixthProtocolUnshard):
    name = "current-shard-grad-op"
    CAPABILITIES = _SixthProtocolUnshard.CAPABILITIES | {Capability.SHARD_GRAD_OP}


def test_the_moved_meaning_is_said_only_where_it_applies() -> None:
    """Not to an old adapter that does not declare the strategy, not to one written for 5 or
    later (it knew the new meaning), and a current one has no warning at all."""
    for adapter_cls in (FirstProtocolAdapter, _FifthProtocolShardGradOp):
        shortfall = versions.shortfall(adapter_cls)
        assert shortfall is not None and shortfall.moved == (), adapter_cls.name
        assert "meaning moved" not in shortfall.describe(adapter_cls.name, 0)
    assert versions.shortfall(_CurrentShardGradOp) is None


def test_an_old_adapter_declaring_shard_grad_op_is_warned_at_the_end_of_the_run(tmp_path: Path) -> None:
    result = run_inner_session(
        tmp_path, USES_UNITS, ["tests.conformance_tests.old_adapters:ZeroTwoAsShardGradOpAdapter"]
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert output.count("backend 'zero2-as-shard-grad-op' was written for protocol version 4") == 1, output
    assert output.count(MOVED) == 1, output
