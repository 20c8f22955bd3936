"""Protocol versioning (conformance.protocol.versions) and adapters that cannot be used at all: an older
adapter runs with one warning naming what it misses and what that cost; an adapter module that
fails to import, or an adapter missing abstract methods, is a usage error at selection."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import pytest
from adapter_testing import run_inner_session

from conformance.protocol import PROTOCOL_VERSION, Capability, versions
from conformance.suite import registry
from tests.conformance.old_adapters import FirstProtocolAdapter


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
        registry.select(["tests.conformance.raising_adapter_module:Adapter"])
    message = str(error.value)
    assert "raised RuntimeError: CUDA driver initialization failed" in message
    assert "fix the adapter module" in message


def test_an_adapter_missing_abstract_methods_is_refused_at_selection() -> None:
    with pytest.raises(
        registry.BackendSelectionError, match=r"does not implement .* _load_optim_state_dict, _optim_state_dict"
    ):
        registry.select(["tests.conformance.old_adapters:Incomplete"])


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
    result = run_inner_session(tmp_path, USES_UNITS, ["tests.conformance.old_adapters:FirstProtocolAdapter"])
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "1 passed, 2 skipped" in output
    assert output.count("was written for protocol version 1") == 1, output
    assert (
        "does not declare the capabilities INTROSPECT_STORAGE, MIXED_STRATEGIES, NATIVE_CHECKPOINT, SHARD_OPTIM_STATE, "
        "UNITS, UNMANAGED_ROOT (2 scenarios" in output
    )


def test_an_adapter_module_failing_at_import_exits_4_with_one_message(tmp_path) -> None:
    """Not a 30-line INTERNALERROR: one usage error (the abstract-method refusal takes the same
    path, registry.load -> BackendSelectionError -> pytest.UsageError)."""
    result = run_inner_session(tmp_path, USES_UNITS, ["tests.conformance.raising_adapter_module:Adapter"])
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert "raised RuntimeError: CUDA driver initialization failed" in result.stderr
    assert "INTERNALERROR" not in result.stderr + result.stdout
