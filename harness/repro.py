"""`--repro`: every failed distributed test gets a line that reproduces it, and can be re-run by node id.

A failure's arguments (node id, device, seed, timeouts, plus what plugins add through
`pytest_harness_repro_args`) are printed as a `REPRO:` line and recorded in pytest's cache;
`pytest --repro NODEID` replaces the process with that recorded command, traces shown. The re-run
writes its reports to `--reports-dir` if given, else to `<rootdir>/reports/repro`: never over the
reports of the run it reproduces.
"""

from __future__ import annotations

import os
import shlex
import sys

import pytest

CACHE_KEY = "harness/repro"


def repro_args(item: pytest.Item) -> list[str]:
    """The pytest arguments that re-run exactly this test: node id, device, seed, timeouts, plugins' own."""
    opts = item.config.option
    args = [
        item.nodeid,
        f"--device={opts.device}",
        f"--seed={opts.seed}",
        f"--collective-timeout={opts.collective_timeout:g}",
        f"--test-timeout={opts.test_timeout:g}",
    ]
    for extra in item.config.hook.pytest_harness_repro_args(item=item):
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
    reports_dir = os.path.abspath(config.getoption("reports_dir") or os.path.join(config.rootpath, "reports", "repro"))
    os.chdir(config.rootpath)
    os.execv(
        sys.executable,
        [
            sys.executable,
            "-m",
            "pytest",
            *_session_args(config.invocation_params.args),
            *recorded[nodeid],
            f"--reports-dir={reports_dir}",
            "--show-traces",
            "-rA",
        ],
    )


def _session_args(args: tuple[str, ...]) -> list[str]:
    """The invocation's plugin and ini arguments (-p, -c, -o, --rootdir), which a re-run needs too."""
    kept: list[str] = []
    for index, arg in enumerate(args):
        if arg in ("-p", "-c", "-o", "--rootdir") and index + 1 < len(args):
            kept += [arg, args[index + 1]]
        elif arg.startswith(("--rootdir=", "-p", "-o", "-c")) and arg not in ("-p", "-o", "-c"):
            kept.append(arg)
    return kept
