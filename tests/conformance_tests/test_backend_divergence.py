"""Same-shape divergence is caught for every backend: by the backend's own order check, or
else by the harness's trace diff — never passed silently, and never a hung session.

One inner pytest session (a subprocess with the repository's own configuration) runs, for
torch-fsdp1 (no TORCH_DISTRIBUTED_DEBUG=DETAIL), torch-fsdp2 and reference, a body in which
ranks run two equal-sized units in opposite orders (``conformance.test_divergence``'s step),
with no capability check and no ``expect_divergence`` marker; then the same step with the
ranks agreeing, which must pass, so a failure of the first is the divergence and not a broken
adapter or a session that died.

The converse: a backend library's own rank-dependent paths are never a divergence. Where the
library's owner rank broadcasts from one line and the others receive from another
(tests/conformance_tests/owner_broadcast_lib), an adapter that declares the library's package
(``BACKEND_MODULES``) passes, every collective named by the scenario's line; the same adapter
without the declaration fails on the library's two lines, in the same ranks right after, so the
declaration lasts one test.
"""

from __future__ import annotations

import re

import pytest
from adapter_testing import run_inner_session, traced_tables

from conformance.suite.backend_fixture import skip_backend_call_sites
from tests.conformance_tests.owner_broadcast_adapters import OwnerBroadcastAdapter
from tests.support.pytest_output import failure_sections

BACKENDS = ("torch-fsdp1", "torch-fsdp2", "reference")
# Short enough that a hang would show up as a timeout long before the subprocess limit.
COLLECTIVE_TIMEOUT_S = 10
SESSION_TIMEOUT_S = 300

INNER_TESTS = """
import pytest
from conformance.test_divergence import training_step

@pytest.mark.world_size(2)
def test_crossed_step(backend, rank, device):
    for form in backend.forms():
        training_step(backend, form, rank, device, crossed=True)

@pytest.mark.world_size(2)
def test_agreeing_step(backend, rank, device):
    for form in backend.forms():
        training_step(backend, form, rank, device, crossed=False)
"""

DIVERGENCE_DIFF = re.compile(
    # " at file:line" when every rank issued it from the same line (the scenario's, or the backend's)
    r"ranks issued divergent collectives: collective #\d+ on group \[0, 1\](?: at \S+:\d+)?: "
    r"rank 0 \w+ \[first[^\]]*\] .* vs rank 1 \w+ \[second[^\]]*\]"
)


@pytest.fixture(scope="module")
def inner_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Run the inner session once; map each failed test id to its failure section."""
    directory = tmp_path_factory.mktemp("backend_divergence")
    result = run_inner_session(
        directory,
        INNER_TESTS,
        list(BACKENDS),
        f"--collective-timeout={COLLECTIVE_TIMEOUT_S}",
        timeout_s=SESSION_TIMEOUT_S,
        unset_env=("TORCH_DISTRIBUTED_DEBUG",),  # FSDP1 must run without its DETAIL-only check
    )
    output = result.stdout + result.stderr
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, output
    assert f"{len(BACKENDS)} failed, {len(BACKENDS)} passed" in output, output
    for backend in BACKENDS:
        assert f"PASSED test_inner.py::test_agreeing_step[{backend}]" in output, output
    return failure_sections(result.stdout)


# Not named `backend`: the conformance plugin parametrizes every test taking that argument.
@pytest.mark.parametrize("backend_name", ["torch-fsdp1", "torch-fsdp2"])
def test_unchecked_backend_is_failed_by_the_trace_diff(inner_report: dict[str, str], backend_name: str) -> None:
    """No order check: the step completes, and only the harness's diff stops it passing."""
    failure = inner_report.get(f"test_crossed_step[{backend_name}]")
    assert failure is not None, f"the crossed step passed on {backend_name}: {sorted(inner_report)}"
    assert DIVERGENCE_DIFF.search(failure), failure
    assert "Forward order differs" not in failure, failure


def test_reference_raises_its_order_error(inner_report: dict[str, str]) -> None:
    """The reference engine checks the first forward across ranks and raises on every rank;
    its check's own collective is labelled alike on every rank, so there is no diff."""
    failure = inner_report.get("test_crossed_step[reference]")
    assert failure is not None, f"the crossed step passed on reference: {sorted(inner_report)}"
    assert re.search(r"rank 0: failed.*Forward order differs across ranks", failure, re.S), failure
    assert re.search(r"rank 1: failed.*Forward order differs across ranks", failure, re.S), failure
    assert "ranks issued divergent collectives" not in failure, failure


# -- a backend library's own paths are not the user's ------------------------------------------

OWNER_BROADCAST = "tests.conformance_tests.owner_broadcast_adapters:"
OWNER_BROADCAST_TESTS = """
import pytest
import torch
import torch.nn as nn
from conformance.protocol import ApiForm, ShardingSpec, ShardingStrategy

@pytest.mark.world_size(2)
def test_replicated_from_the_owner(backend, rank, device):
    model = nn.Linear(4, 2).to(device)
    with torch.no_grad():
        model.weight.fill_(rank + 1)
    backend.shard(model, ShardingSpec(strategy=ShardingStrategy.NO_SHARD), ApiForm.WRAPPER)  # the scenario's line
    assert torch.all(model.weight == 1), model.weight
"""
SCENARIO_LINE = next(
    number for number, line in enumerate(OWNER_BROADCAST_TESTS.splitlines(), 1) if "the scenario's line" in line
)


def test_a_backend_librarys_own_paths_are_not_a_divergence(tmp_path) -> None:
    result = run_inner_session(
        tmp_path,
        OWNER_BROADCAST_TESTS,
        [f"{OWNER_BROADCAST}OwnerBroadcastAdapter", f"{OWNER_BROADCAST}OwnerBroadcastUndeclared"],
        "--show-traces",
        "-s",
    )
    output = result.stdout + result.stderr
    assert "PASSED test_inner.py::test_replicated_from_the_owner[owner-broadcast]" in output, output
    assert "FAILED test_inner.py::test_replicated_from_the_owner[owner-broadcast-undeclared]" in output, output
    assert "1 pool starts, 2 rank processes" in output, output  # the same ranks ran both, declared first
    declared, undeclared = traced_tables(output)
    # Every collective of the declared run, the library's broadcasts and the template's DDP ones
    # (its broadcast of module states, and what its C++ issues: the shape check's all-gather, the
    # broadcast of its bucket layout), on both ranks: named by the scenario's line.
    sites = re.findall(r"(\S+\.py:\d+)", declared)
    ops = re.findall(r"\] +\d+ +(\w+) ", declared)
    assert ops.count("broadcast_coalesced") == 2 and ops.count("all_gather") == 2, declared
    assert len(sites) == len(ops) >= 6 and set(sites) == {f"test_inner.py:{SCENARIO_LINE}"}, declared
    library = r"\S*owner_broadcast_lib/__init__\.py:\d+"
    assert re.search(
        rf"ranks issued divergent collectives: collective #1 on group \[0, 1\]: rank 0 broadcast 8 float32 at "
        rf"{library} vs rank 1 broadcast 8 float32 at {library}",
        output,
    ), output
    assert "owner_broadcast_lib" in undeclared and "owner_broadcast_lib" not in declared
    # The verdict names what to declare, for the undeclared adapter only.
    hints = output.partition(" call sites inside backend libraries ")[2]
    assert re.search(
        r"test_inner.py::test_replicated_from_the_owner\[owner-broadcast-undeclared\]: the divergent collectives "
        r"were issued inside tests.conformance_tests.owner_broadcast_lib .*OwnerBroadcastUndeclared.BACKEND_MODULES "
        r"does not declare.*Declare BACKEND_MODULES = \('tests.conformance_tests.owner_broadcast_lib',\) in the "
        r"owner-broadcast-undeclared adapter",
        hints,
    ), output
    assert "test_replicated_from_the_owner[owner-broadcast]: " not in output, hints


def test_declared_backend_modules_must_be_the_librarys() -> None:
    """A declared package that is not importable, or that holds the suite's own code (it would hide
    the scenarios' lines), is refused naming the fix; a valid declaration can be taken back."""

    class NotImportable(OwnerBroadcastAdapter):
        BACKEND_MODULES = ("no_such_library_anywhere",)

    class TheSuite(OwnerBroadcastAdapter):
        BACKEND_MODULES = ("conformance.scenario_specs",)

    with pytest.raises(
        ValueError, match=r"NotImportable.BACKEND_MODULES = \('no_such_library_anywhere',\).*import names"
    ):
        skip_backend_call_sites(NotImportable)
    with pytest.raises(ValueError, match=r"TheSuite.BACKEND_MODULES names \['conformance.scenario_specs'\].*hide"):
        skip_backend_call_sites(TheSuite)
    skip_backend_call_sites(OwnerBroadcastAdapter)()
