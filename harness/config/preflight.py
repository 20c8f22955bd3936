"""Checks made before the first test, so that bad input is refused up front and never costs a verdict.

A problem found here is a usage error (exit status 4) whose message names what is wrong and the
fix. Found later, the same problem would replace real test outcomes with harness errors: a
`traces/` directory the session cannot write turns every failure into a `PermissionError`, an
unwritable `junit/` ends the session in an INTERNALERROR, and pytest-xdist's `-n` splits the
session into workers whose reports overwrite each other. The plugins call these checks from
their `pytest_configure`; each returns or raises, and keeps no state.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Sequence

import pytest

_FIX = "remove or fix it, or pass --reports-dir with a writable directory"


def writable_directory_problem(path: str, called: str = "it") -> str | None:
    """Why the session could not create files in directory `path` (creating it first if needed),
    or None. Nothing is created: a missing directory is judged by its nearest existing parent.
    `called`: how the message names `path` itself."""
    existing = path
    while not os.path.lexists(existing):
        parent = os.path.dirname(existing)
        if parent == existing:
            break
        existing = parent
    where = called if existing == path else existing
    if not os.path.isdir(existing):
        return f"{where} is not a directory"
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".preflight-"):
            pass
    except OSError as error:
        return f"cannot create files in {where} ({error.strerror or error})"
    return None


def writable_file_problem(path: str) -> str | None:
    """Why the session could not (over)write file `path`, or None; an existing file is left as it is."""
    if os.path.lexists(path):
        if os.path.isdir(path) or not os.path.isfile(path):
            return "it is not a regular file"
        try:
            with open(path, "a", encoding="utf-8"):  # append mode: opens for writing, changes nothing
                pass
        except OSError as error:
            return f"cannot write it ({error.strerror or error})"
        return None
    parent = os.path.dirname(path) or "."
    return writable_directory_problem(parent, called=parent)


def reports_directory(given: str | None, invocation_dir: str) -> str:
    """The session's reports directory, absolute and created: `--reports-dir` (`given`, relative to
    where pytest was started), else `<invocation dir>/reports`: the user's directory, also when the
    suite runs from an installed package or from a subdirectory of the root directory. Refused
    (usage error) when files cannot be created in it; what goes in it is checked by
    `require_writable`, by each plugin that writes there."""
    directory = os.path.join(invocation_dir, given or "reports")
    directory = os.path.abspath(directory)
    problem = writable_directory_problem(directory, called="it")
    if problem is None:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as error:
            problem = f"cannot create it ({error.strerror or error})"
    if problem is not None:
        raise pytest.UsageError(
            f"reports directory {directory!r} is not writable ({problem}); pass --reports-dir with a writable path"
        )
    return directory


def require_writable(directories: Sequence[tuple[str, str]] = (), files: Sequence[tuple[str, str]] = ()) -> None:
    """Refuse the session (usage error) when a report location cannot be written.

    Each entry is (what it holds, path), e.g. ("the per-rank JUnit files", ".../reports/junit").
    """
    problems = [
        f"{path} ({what}): {problem}"
        for what, path, problem in [(w, p, writable_directory_problem(p)) for w, p in directories]
        + [(w, p, writable_file_problem(p)) for w, p in files]
        if problem is not None
    ]
    if problems:
        raise pytest.UsageError(
            "reports cannot be written, so failures would be lost or replaced by harness errors:\n  "
            + "\n  ".join(problems)
            + f"\n{_FIX}"
        )


def refuse_parallel_workers(config: pytest.Config) -> None:
    """Refuse pytest-xdist's `-n`/`--dist`/`--tx`: the harness already runs each distributed test
    on its own rank processes, and its per-rank JUnit files, traces and conformance matrix are
    written by one session; xdist workers would each write a part and silently lose the rest."""
    option = config.option
    numprocesses = getattr(option, "numprocesses", None)
    dist = getattr(option, "dist", "no")
    requested = (numprocesses not in (None, 0, "0")) or (dist not in (None, "no")) or bool(getattr(option, "tx", None))
    if requested or hasattr(config, "workerinput"):
        given = f"-n {numprocesses}" if numprocesses not in (None, 0, "0") else f"--dist {dist}"
        raise pytest.UsageError(
            f"pytest-xdist ({given}) is not supported: the harness runs every distributed test on "
            "its own warm rank processes already, and its reports (per-rank JUnit files, traces, "
            "the conformance matrix) are written by a single pytest session, so xdist workers "
            "would lose part of them; drop -n (or pass -n 0 to override an addopts setting)"
        )


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def oversubscription_line(cpu_world_sizes: Iterable[int], cores: int) -> str | None:
    """One line saying that CPU worlds larger than the core count will run oversubscribed, or None."""
    above = sorted({size for size in cpu_world_sizes if size > cores})
    if not above:
        return None
    sizes = ", ".join(map(str, above))
    return (
        f"harness: world size{'s' if len(above) > 1 else ''} {sizes} on CPU exceed{'' if len(above) > 1 else 's'} "
        f"the {cores} usable CPU core{'s' if cores != 1 else ''}: their ranks share cores (oversubscribed), "
        "slower but correct; if tests time out, raise --collective-timeout and --test-timeout"
    )
