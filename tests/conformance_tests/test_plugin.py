"""The conformance plugin end to end, in inner pytest sessions (pytester)."""

from __future__ import annotations

import os
import sys
import tempfile
import time

import pytest

from harness.config.gpu_count import visible_gpu_count
from tests.support.warm_pytest import run_pytest

pytest_plugins = ["pytester"]

SCENARIO = """
import pytest
import torch

@pytest.mark.parametrize("mode", ["a"])
def test_case(backend, mode):
    assert backend != "torch-fsdp2", "planned failure of fsdp2"
"""


def expect_fsdp2_failure(pytester: pytest.Pytester, backend: str, text: str) -> None:
    pytester.mkdir("expectations")
    (pytester.path / "expectations" / f"{backend}.toml").write_text(
        f'[[expected_failure]]\nscenario = "test_scenario.py::test_case[a]"\n'
        f'failure = "{text}"\nreason = "tracked upstream"\n'
    )


def run(pytester: pytest.Pytester, *backends: str) -> pytest.RunResult:
    pytester.makepyfile(test_scenario=SCENARIO)
    args = ["-p", "conformance.suite.backend_plugin", "-p", "no:cacheprovider", "-rxXf", "-v"]
    args += ["--expectations-dir", str(pytester.path / "expectations")]
    for backend in backends:
        args += ["--backend", backend]
    return pytester.runpytest(*args)


def test_backend_leads_the_test_id(pytester: pytest.Pytester) -> None:
    result = run(pytester, "torch-fsdp1", "reference")
    result.stdout.fnmatch_lines(["*test_case[[]torch-fsdp1-a[]] PASSED*", "*test_case[[]reference-a[]] PASSED*"])
    result.stdout.fnmatch_lines(["conformance backends: torch-fsdp1, reference"])


def test_default_backend_is_reference(pytester: pytest.Pytester) -> None:
    run(pytester).stdout.fnmatch_lines(["*test_case[[]reference-a[]] PASSED*"])


def test_all_selects_every_builtin(pytester: pytest.Pytester) -> None:
    """Every built-in, the optional ones whose library is installed here included, and the
    header says what each is and which optional ones were left out."""
    from conformance.suite import registry

    known = registry.known_names()
    result = run(pytester, "all")
    result.assert_outcomes(passed=len(known) - 1, failed=1)
    result.stdout.fnmatch_lines(
        [
            f"conformance backends: {', '.join(known)}",
            "  reference: built-in conformance.adapters.reference:ReferenceAdapter; expected failures: none",
        ]
    )
    for name in registry.missing_optional():
        result.stdout.fnmatch_lines([f"  {name}: not installed, left out of 'all' (install: *)"])
    for name in set(known) & set(registry.OPTIONAL_BUILTIN):
        result.stdout.fnmatch_lines([f"  {name}: optional built-in *"])


def test_bad_backend_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = run(pytester, "torch-fsdp9")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*unknown backend 'torch-fsdp9'; known backends: reference, torch-fsdp1, torch-fsdp2*"]
    )


def test_expected_failure_xfails(pytester: pytest.Pytester) -> None:
    expect_fsdp2_failure(pytester, "torch-fsdp2", "planned failure")
    result = run(pytester, "torch-fsdp1", "torch-fsdp2")
    result.assert_outcomes(passed=1, xfailed=1)
    result.stdout.fnmatch_lines(["*XFAIL*test_case[[]torch-fsdp2-a[]]*expected-fail: tracked upstream*"])


def test_unexpected_pass_fails(pytester: pytest.Pytester) -> None:
    expect_fsdp2_failure(pytester, "torch-fsdp1", "planned failure")
    result = run(pytester, "torch-fsdp1")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*unexpected pass: test_scenario.py::test_case[[]a[]]*"])


def test_unexpected_failure_text_stays_a_failure(pytester: pytest.Pytester) -> None:
    expect_fsdp2_failure(pytester, "torch-fsdp2", "some other error")
    result = run(pytester, "torch-fsdp2")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*failed differently*", "*planned failure of fsdp2*"])


def test_reference_expectations_are_refused(pytester: pytest.Pytester) -> None:
    expect_fsdp2_failure(pytester, "reference", "anything")
    result = run(pytester, "reference")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*reference backend may not have expected failures*"])


STALE_SCENARIOS = """
import pytest
import torch

@pytest.mark.parametrize("mode", ["a", "b"])
def test_case(backend, mode):
    if mode == "b":
        pytest.skip("unsupported: planned: the backend lacks it")
    assert False, "planned failure"
"""


def write_entries(pytester: pytest.Pytester, *scenarios: str) -> None:
    pytester.mkdir("expectations")
    entries = "".join(
        f'[[expected_failure]]\nscenario = "{scenario}"\nfailure = "planned failure"\nreason = "tracked"\n\n'
        for scenario in scenarios
    )
    (pytester.path / "expectations" / "torch-fsdp1.toml").write_text(entries)


def run_with_entries(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """The conformance plugin on torch-fsdp1 with this test's expectations and reports directories,
    plus `args`."""
    expectations, reports = str(pytester.path / "expectations"), str(pytester.path / "reports")
    return pytester.runpytest(
        "-p",
        "conformance.suite.backend_plugin",
        "-p",
        "no:cacheprovider",
        "--backend",
        "torch-fsdp1",
        "--expectations-dir",
        expectations,
        "--reports-dir",
        reports,
        *args,
    )


def run_stale(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_scenario=STALE_SCENARIOS)
    write_entries(
        pytester,
        "test_scenario.py::test_case[a]",  # runs and fails as recorded: fine
        "test_scenario.py::test_case[b]",  # skipped: stale
        "test_scenario.py::test_case[gone]",  # no such test: stale
    )
    return run_with_entries(
        pytester,
        *args,
    )


def test_stale_entries_are_reported_and_fail_a_strict_run(pytester: pytest.Pytester) -> None:
    result = run_stale(pytester, "--strict-expectations")
    result.assert_outcomes(xfailed=1, skipped=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*stale expectations*",
            (
                "torch-fsdp1: test_scenario.py::test_case[[]b[]]: its test was skipped "
                "(unsupported: planned: the backend lacks it)"
            ),
            "torch-fsdp1: test_scenario.py::test_case[[]gone[]]: matches no collected test",
            "2 stale expected-failure entries: remove or fix them; --strict-expectations fails the run",
        ]
    )
    # The verdict is on the last line, not only in the exit status.
    assert "2 stale expectations (--strict-expectations: run failed)" in result.stdout.lines[-1]
    matrix = (pytester.path / "reports" / "conformance.md").read_text()
    assert "## Stale expectations" in matrix and "test_case[gone]: matches no collected test" in matrix
    assert "Stale expectations" in (pytester.path / "reports" / "conformance.html").read_text()


def test_stale_entries_alone_do_not_fail_a_run(pytester: pytest.Pytester) -> None:
    result = run_stale(pytester)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["2 stale expected-failure entries: remove or fix them"])


def test_deselected_tests_are_not_stale(pytester: pytest.Pytester) -> None:
    """-k leaves the skipped-but-deselected entry alone; the file was still collected whole, so
    the entry that matches no test at all is stale."""
    result = run_stale(pytester, "--strict-expectations", "-k", "not b")
    result.assert_outcomes(xfailed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["torch-fsdp1: test_scenario.py::test_case[[]gone[]]: matches no collected test"])
    assert "test_case[b]" not in result.stdout.str()


def test_a_node_id_selection_calls_nothing_stale(pytester: pytest.Pytester) -> None:
    result = run_stale(pytester, "--strict-expectations", "test_scenario.py::test_case[torch-fsdp1-a]")
    result.assert_outcomes(xfailed=1)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    assert "stale expect" not in result.stdout.str()


def test_entries_no_run_can_match_are_stale_whatever_the_selection(pytester: pytest.Pytester) -> None:
    """A file that does not exist, the matrix's short form (no directory) and a file that is not a
    test file are stale even in a run selected by node id; the short form is shown in full."""
    (pytester.path / "suite").mkdir()
    (pytester.path / "suite" / "test_scenario.py").write_text(STALE_SCENARIOS)
    (pytester.path / "suite" / "helpers.py").write_text("")
    write_entries(
        pytester,
        "suite/test_scenario.py::test_case[a]",  # runs and fails as recorded: fine
        "test_scenario.py::test_case[a]",  # the matrix's short form
        "suite/test_gone.py::test_case[a]",  # no such file
        "suite/helpers.py::test_case[a]",  # not a test file
    )
    result = run_with_entries(
        pytester,
        "--strict-expectations",
        "suite/test_scenario.py::test_case[torch-fsdp1-a]",
    )
    result.assert_outcomes(xfailed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "torch-fsdp1: test_scenario.py::test_case[[]a[]]: its file test_scenario.py does not exist (under *); "
            "a scenario id starts with the test file's path from the root directory: "
            "suite/test_scenario.py::test_case[[]a[]]",
            "torch-fsdp1: suite/test_gone.py::test_case[[]a[]]: its file suite/test_gone.py does not exist*",
            "torch-fsdp1: suite/helpers.py::test_case[[]a[]]: its file suite/helpers.py is not a test file*",
        ]
    )
    assert "3 stale expectations (--strict-expectations: run failed)" in result.stdout.lines[-1]


def test_an_entry_naming_a_test_without_a_backend_is_stale(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain="def test_plain():\n    pass\n")
    write_entries(pytester, "test_plain.py::test_plain")
    result = run_with_entries(
        pytester,
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["torch-fsdp1: test_plain.py::test_plain: matches no collected test"])


def test_bad_backend_path_and_disabled_harness_are_usage_errors(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_scenario=SCENARIO)
    result = pytester.runpytest(
        "-p", "conformance.suite.backend_plugin", "--backend-path", str(pytester.path / "nowhere")
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--backend-path */nowhere: no such directory; pass the directory that holds*"])
    result = pytester.runpytest("-p", "no:harness.plugin", "-p", "conformance.suite.backend_plugin")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*disabled (-p no:harness.plugin)*drop -p no:harness.plugin*"])
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()


def test_an_unusable_matrix_file_is_refused_before_any_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_scenario=SCENARIO)
    (pytester.path / "reports" / "conformance.html").mkdir(parents=True)
    result = pytester.runpytest(
        "-p", "conformance.suite.backend_plugin", "--reports-dir", str(pytester.path / "reports")
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*conformance.html (the conformance matrix): it is not a regular file*"])
    assert "PASSED" not in result.stdout.str() and "passed" not in result.stdout.str()


def test_a_test_skipped_for_lack_of_devices_is_not_stale(pytester: pytest.Pytester) -> None:
    if visible_gpu_count() >= 2:
        pytest.skip("this machine has the GPUs: nothing is skipped for lack of them")
    pytester.makepyfile(
        test_scenario="""
import pytest
import torch

@pytest.mark.world_size(2)
def test_case(backend):
    assert False, "planned failure"
"""
    )
    write_entries(pytester, "test_scenario.py::test_case")
    result = run_with_entries(
        pytester,
        "--device",
        "cuda",
        "--strict-expectations",
    )
    result.assert_outcomes(skipped=1)
    # The run fails because nothing got its GPUs (harness.config.devices.DeviceTally), not as stale.
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    assert "no distributed test got its devices" in result.stdout.lines[-1]
    assert "stale expect" not in result.stdout.str()


# -- adapters by import path: ids, reports and expectations by name; their own expectations -----

VENDOR_ADAPTER = """
from conformance.adapters.torch_fsdp2 import TorchFSDP2Adapter

class VendorAdapter(TorchFSDP2Adapter):
    name = "vendor-fsdp"
    EXPECTATIONS = "vendor_expectations.toml"

class Renamed(TorchFSDP2Adapter):
    name = "torch-fsdp1"
"""


def run_vendor(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """An adapter package outside the root directory, imported through --backend-path.

    In its own process (the path must not reach this one), forked from the warm interpreter of
    tests.support.warm_pytest rather than started cold as `runpytest_subprocess` would: the same
    session without importing torch again. Unlike `runpytest_subprocess` it does not put the
    test directory on PYTHONPATH (a changed start-up variable would start a cold interpreter);
    `python -m pytest` puts the working directory, which is that directory, on `sys.path` itself."""
    vendor = pytester.path / "vendor"
    vendor.mkdir(exist_ok=True)
    (vendor / "vendor_adapter.py").write_text(VENDOR_ADAPTER)
    (vendor / "vendor_expectations.toml").write_text(
        '[[expected_failure]]\nscenario = "test_scenario.py::test_case[a]"\n'
        'failure = "planned failure"\nreason = "shipped with the adapter"\n'
    )
    pytester.makepyfile(test_scenario=SCENARIO.replace('"torch-fsdp2"', '"vendor_adapter:VendorAdapter"'))
    command = [
        sys.executable,
        "-m",
        "pytest",
        f"--basetemp={tempfile.mkdtemp(prefix='runpytest-', dir=pytester.path)}",
        "-p",
        "conformance.suite.backend_plugin",
        "-p",
        "no:cacheprovider",
        "-rxXf",
        "-v",
        "--backend-path",
        str(vendor),
        "--reports-dir",
        str(pytester.path / "reports"),
        *args,
    ]
    started = time.monotonic()
    completed = run_pytest(command, cwd=pytester.path, env=dict(os.environ), timeout=300)
    return pytest.RunResult(
        completed.returncode, completed.stdout.splitlines(), completed.stderr.splitlines(), time.monotonic() - started
    )


def test_an_import_path_backend_is_shown_and_judged_by_its_name(pytester: pytest.Pytester) -> None:
    result = run_vendor(pytester, "--backend", "vendor_adapter:VendorAdapter", "--backend", "reference")
    result.assert_outcomes(passed=1, xfailed=1)
    result.stdout.fnmatch_lines(
        [
            "conformance backends: vendor-fsdp, reference",
            "  vendor-fsdp: import path vendor_adapter:VendorAdapter; expected failures: "
            "*vendor_expectations.toml (1 entries)",
            "*test_case[[]vendor-fsdp-a[]]*XFAIL*",
            "*XFAIL*test_case[[]vendor-fsdp-a[]]*expected-fail: shipped with the adapter*",
        ]
    )
    matrix = (pytester.path / "reports" / "conformance.md").read_text()
    assert "| scenario | vendor-fsdp | reference |" in matrix, matrix


def test_expectations_dir_overrides_the_adapters_own_file(pytester: pytest.Pytester) -> None:
    pytester.mkdir("empty")
    result = run_vendor(
        pytester,
        "--backend",
        "vendor_adapter:VendorAdapter",
        "--expectations-dir",
        str(pytester.path / "empty"),
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["  vendor-fsdp: import path *; expected failures: none"])


def test_two_backends_of_one_name_are_refused_and_one_adapter_twice_runs_once(
    pytester: pytest.Pytester,
) -> None:
    clash = run_vendor(pytester, "--backend", "torch-fsdp1", "--backend", "vendor_adapter:Renamed")
    assert clash.ret == pytest.ExitCode.USAGE_ERROR
    clash.stderr.fnmatch_lines(["*backends 'torch-fsdp1' and 'vendor_adapter:Renamed' are both named 'torch-fsdp1'*"])
    twice = run_vendor(
        pytester,
        "--backend",
        "torch-fsdp2",
        "--backend",
        "conformance.adapters.torch_fsdp2:TorchFSDP2Adapter",
    )
    twice.assert_outcomes(passed=1)
    twice.stdout.fnmatch_lines(["conformance backends: torch-fsdp2"])


FAILING_DISTRIBUTED = """
import pytest

@pytest.mark.world_size(2)
def test_fails(backend, rank):
    assert rank < 0, f"planned failure of {backend.name} on rank {rank}"
"""


def test_repro_line_reproduces_an_import_path_backend(tmp_path) -> None:
    """The REPRO line carries the --backend-path that made the adapter importable (ranks
    included) and the selection as given; run from its own directory without that path on
    PYTHONPATH, it fails the same way."""
    import shlex
    import subprocess

    from adapter_testing import REPO, run_inner_session

    vendor = tmp_path / "vendor"
    vendor.mkdir()
    (vendor / "vendor_adapter.py").write_text(VENDOR_ADAPTER.replace('EXPECTATIONS = "vendor_expectations.toml"', ""))
    inner = tmp_path / "inner"
    inner.mkdir()
    result = run_inner_session(
        inner,
        FAILING_DISTRIBUTED,
        ["vendor_adapter:VendorAdapter"],
        "--backend-path",
        str(vendor),
        "-p",
        "cacheprovider",
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "planned failure of vendor-fsdp on rank" in output, output
    repro = next(line for line in output.splitlines() if line.startswith("REPRO: "))
    command = repro.removeprefix("REPRO: ").split("  (or: ")[0]
    assert f"--backend-path {shlex.quote(str(vendor))} --backend vendor_adapter:VendorAdapter" in command, repro
    assert "'test_inner.py::test_fails[vendor-fsdp]'" in command, repro
    # The inner session's configuration came from -c/-p (a real project has it in its root
    # directory, where the REPRO line cd's to); the backend's own arguments are the line's.
    session = ["-c", str(REPO / "pyproject.toml"), "-p", "harness.plugin", "-p", "conformance.suite.backend_plugin"]
    again = subprocess.run(
        [*shlex.split(command.partition(" && ")[2]), *session],
        cwd=shlex.split(command)[1],
        text=True,
        capture_output=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path)},
    )
    rerun = again.stdout + again.stderr
    assert again.returncode == 1 and "planned failure of vendor-fsdp on rank" in rerun, rerun
    assert sys.executable in command


def test_repro_line_carries_every_backend_path(tmp_path) -> None:
    """An adapter that imports its backend from a second --backend-path: the REPRO line carries
    both paths (the adapter's own alone would make the re-run fail with "No module named ..."), and
    so does the HTML report."""
    import shlex

    from adapter_testing import run_inner_session

    vendor, library = tmp_path / "vendor", tmp_path / "library"
    vendor.mkdir()
    library.mkdir()
    (library / "vendor_backend.py").write_text("from conformance.adapters.torch_fsdp2 import TorchFSDP2Adapter\n")
    (vendor / "vendor_adapter.py").write_text(
        "from vendor_backend import TorchFSDP2Adapter\n\nclass VendorAdapter(TorchFSDP2Adapter):\n"
        '    name = "vendor-fsdp"\n'
    )
    inner = tmp_path / "inner"
    inner.mkdir()
    result = run_inner_session(
        inner, FAILING_DISTRIBUTED, ["vendor_adapter:VendorAdapter"],
        "--backend-path", str(vendor), "--backend-path", str(library),
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "planned failure of vendor-fsdp on rank" in output, output
    repro = next(line for line in output.splitlines() if line.startswith("REPRO: "))
    assert (
        f"--backend-path {shlex.quote(str(vendor))} --backend-path {shlex.quote(str(library))} "
        "--backend vendor_adapter:VendorAdapter"
    ) in repro, repro
    # The HTML report shows the same line under the failure.
    from html import escape

    page = (inner / "reports" / "conformance.html").read_text()
    assert escape(repro.removeprefix("REPRO: ")) in page, page


def test_an_adapter_not_on_the_search_path_is_named_with_the_fix(pytester: pytest.Pytester) -> None:
    """The module not found: the message names --backend-path and the search path; a module it
    imports not found: the message names that module."""
    from conformance.suite import registry

    with pytest.raises(registry.BackendSelectionError) as absent:
        registry.load("no_such_vendor_pkg.adapter:Adapter")
    message = str(absent.value)
    assert "pass --backend-path DIR with the directory that holds 'no_such_vendor_pkg'" in message, message
    assert "Searched (sys.path): " in message and sys.path[-1] in message, message
    pytester.makepyfile(broken_vendor_adapter="import no_such_backend_library\n")
    pytester.syspathinsert()
    with pytest.raises(registry.BackendSelectionError) as dependency:
        registry.load("broken_vendor_adapter:Adapter")
    assert "'no_such_backend_library', which it imports, is missing" in str(dependency.value), dependency.value
