"""`--repro`: every failed distributed test gets a line that reproduces it, and can be re-run by node id.

What a reproduction carries is declared, option by option, by the plugins that register the
options: each implements `pytest_harness_repro_options` with a table {option: `Carried` or
`NotCarried(reason)`} covering every command-line and ini option it adds (the harness's in
`harness.plugin`, the conformance suite's in `conformance.suite.backend_plugin`; a self-test fails when an option
is missing from its table). A failure's arguments (node id, the carried options, the invocation's
`-c`/`-o`/`-p`/`--rootdir`, plus what other plugins add through `pytest_harness_repro_args`) are
printed as a `REPRO:` line and recorded in pytest's cache; `pytest --repro NODEID` replaces the
process with that recorded command, traces shown. The re-run writes its reports to
`--reports-dir` if given, else to `reports/repro` in the directory pytest was started from: never
over the reports of the run it reproduces.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest

CACHE_KEY = "harness/repro"


@dataclass(frozen=True)
class Carried:
    """A reproduction carries this option: it can change a verdict or its timing.

    `args(item)` gives the arguments that carry it for one test (e.g. only the backend that test
    ran with); by default the session's value is carried as `--option=value` (a flag that is set:
    `--option`; a list: the option once per value), and an unset option (None, False, empty) not
    at all.
    """

    args: Callable[[pytest.Item], list[str]] | None = None


@dataclass(frozen=True)
class NotCarried:
    """A reproduction leaves this option out; `reason` says why it changes no verdict and no timing."""

    reason: str


ReproPolicy = Carried | NotCarried

CARRIED_BY_INI = Carried(lambda item: [])
"""For ini options: the REPRO line runs in the root directory, whose ini file sets them, and repeats
the invocation's `-c`, `-o`, `-p` and `--rootdir` arguments, which override or replace it."""


def option_args(option: str, value: object) -> list[str]:
    """`option` (`--name`) with `value`, as a command line carries it (see `Carried`)."""
    if value is None or value is False:
        return []
    if value is True:
        return [option]
    if isinstance(value, (list, tuple)):
        return [f"{option}={item}" for item in value]
    if isinstance(value, float):
        text = f"{value:g}"  # 30.0 -> "30", as a user types it, unless that would round it
        return [f"{option}={text if float(text) == value else repr(value)}"]
    return [f"{option}={value}"]


def repro_options(config: pytest.Config) -> dict[str, ReproPolicy]:
    """Every declared option and what a reproduction does with it, the harness's first."""
    merged: dict[str, ReproPolicy] = {}
    for table in reversed(config.hook.pytest_harness_repro_options()):  # in registration order
        merged.update(table)
    return merged


def repro_args(item: pytest.Item) -> list[str]:
    """The pytest arguments that re-run exactly this test: node id, every carried option, the
    invocation's configuration arguments, and other plugins' own."""
    config = item.config
    args = [item.nodeid]
    for option, policy in repro_options(config).items():
        if isinstance(policy, Carried):
            args += policy.args(item) if policy.args is not None else option_args(option, config.getoption(option))
    args += session_args(config.invocation_params.args, str(config.invocation_params.dir))
    for extra in config.hook.pytest_harness_repro_args(item=item):
        args.extend(extra)
    return args


def repro_line(item: pytest.Item) -> str:
    command = [sys.executable, "-m", "pytest", *repro_args(item)]
    return (
        f"REPRO: cd {shlex.quote(str(item.config.rootpath))} && {shlex.join(command)}"
        f"  (or: pytest --repro {shlex.quote(item.nodeid)})"
    )


def remember_failure(item: pytest.Item) -> None:
    """Record the failure's arguments for `--repro` (needs the cacheprovider plugin)."""
    cache = getattr(item.config, "cache", None)
    if cache is not None:
        recorded = cache.get(CACHE_KEY, {})
        recorded[item.nodeid] = repro_args(item)
        cache.set(CACHE_KEY, recorded)


def reexec_recorded(config: pytest.Config, nodeid: str) -> None:
    """Replace this process with the recorded command of an earlier failure of `nodeid`."""
    cache = getattr(config, "cache", None)
    recorded = cache.get(CACHE_KEY, {}) if cache is not None else {}
    if nodeid not in recorded:
        known = "\n  ".join(sorted(recorded)) or "(none: run the suite first; needs the cacheprovider plugin)"
        raise pytest.UsageError(f"--repro: no recorded failure of {nodeid!r}; failures recorded:\n  {known}")
    # Give the terminal back before exec: pytest's global capture holds fds 1 and 2.
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.stop_global_capturing()
    # Absolute before the chdir: a relative --reports-dir was meant from where pytest was started.
    reports_dir = os.path.join(config.invocation_params.dir, config.getoption("reports_dir") or "reports/repro")
    reports_dir = os.path.abspath(reports_dir)
    os.chdir(config.rootpath)
    os.execv(
        sys.executable,
        [
            sys.executable,
            "-m",
            "pytest",
            *session_args(config.invocation_params.args, str(config.invocation_params.dir)),
            *recorded[nodeid],  # after the re-run's own: the recorded configuration wins
            f"--reports-dir={reports_dir}",
            "--show-traces",
            "-rA",
        ],
    )


def session_args(args: tuple[str, ...] | list[str], invocation_dir: str) -> list[str]:
    """The invocation's plugin and ini arguments (-p, -c, -o, --rootdir), which a re-run needs too.

    The paths of -c and --rootdir are made absolute (from `invocation_dir`): a re-run starts in the
    root directory, not where the session was started.
    """
    kept: list[str] = []
    for index, arg in enumerate(args):
        if arg in ("-p", "-c", "-o", "--rootdir") and index + 1 < len(args):
            value = args[index + 1]
            if arg in ("-c", "--rootdir"):
                value = os.path.join(invocation_dir, value)
            kept += [arg, value]
        elif arg.startswith("--rootdir="):
            kept.append(f"--rootdir={os.path.join(invocation_dir, arg.removeprefix('--rootdir='))}")
        elif arg.startswith("-c") and arg != "-c":
            kept.append(f"-c{os.path.join(invocation_dir, arg.removeprefix('-c'))}")
        elif arg.startswith(("-p", "-o")) and arg not in ("-p", "-o"):
            kept.append(arg)
    return kept
