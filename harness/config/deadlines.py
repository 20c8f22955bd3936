"""How long a distributed test's ranks get: `--test-timeout`, or pytest-timeout's limit for the test.

pytest-timeout (`--timeout`, the `timeout` ini option, `PYTEST_TIMEOUT`, `@pytest.mark.timeout(N)`)
guards a test by interrupting the pytest process: SIGALRM raises in whatever the parent is doing,
and the `thread` method dumps the parent's stacks and `os._exit`s the whole session. For a test
whose body runs on a warm pool, what the parent is doing is starting the pool, waiting for the
ranks or restarting them: an interrupt there charges the pool's start to the test, fails a test
whose ranks were about to pass, loses the hung ranks' stacks, and with `thread` ends the session.

So in a pool session, a distributed test's pytest-timeout limit becomes its ranks' deadline, the
one the harness enforces itself (`harness.process.pool`: counted from the task's dispatch, once
the pool is up; hung ranks are stack-dumped, killed and replaced, and the session goes on), and
pytest-timeout's own timer is not armed while the test's body runs on the ranks.

How pytest-timeout is held off: through the extension hooks it declares for exactly this
(`pytest_timeout_set_timer` / `pytest_timeout_cancel_timer`, "overridden by plugins for alternative
timeout implementation strategies"), not by editing its settings or cancelling its timer after the
fact. Its `pytest_runtest_protocol` (or, with `timeout_func_only`, `pytest_runtest_call`) wrapper
resolves the test's settings its own way (marker, then `--timeout`, `PYTEST_TIMEOUT`, the ini file)
and asks the hook to arm a timer; `PytestTimeoutBridge.pytest_timeout_set_timer` (tryfirst) answers
for a distributed test: it keeps the resolved limit as the test's deadline and arms nothing, so
neither a signal nor a thread exists while the pool starts, runs or restarts, whatever the method
and whatever the order of the other plugins' wrappers. Nothing private of pytest-timeout is read,
and the hook's signature is the same in every pytest-timeout the project supports (>= 2.3).
The parent-side phases of a distributed test (its fixtures' setup and teardown in the pytest
process) keep pytest-timeout's own timer, each phase armed and cancelled around itself: a parent
fixture that hangs is still pytest-timeout's to stop, the usual way.

Under torchrun (`harness.session.torchrun_session`) the test's body runs in this process, as a rank:
pytest-timeout is left as it is there.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import pytest

from harness.config import repro, world_sizes

PYTEST_TIMEOUT_PLUGIN = "timeout"
"""The name pytest-timeout registers under (its `pytest11` entry point; `-p no:timeout` disables it)."""


@dataclass(frozen=True)
class Deadline:
    """How long a distributed test's ranks get once the task is dispatched, and who set it."""

    seconds: float
    source: str = ""
    """Who set it, when not `--test-timeout` (e.g. "pytest-timeout --timeout 3"); said with a hang."""


_DEADLINE = pytest.StashKey[Deadline]()  # per item: pytest-timeout's limit, as its hook gave it
# Per item: the settings pytest-timeout resolved for it (its `Settings` tuple), to arm its own timer
# with for the parent-side phases.
_SETTINGS = pytest.StashKey[Any]()
_ARMING_PHASE = pytest.StashKey[bool]()  # per item: pytest-timeout's timer is being armed for a parent-side phase


def deadline_of(item: pytest.Item, test_timeout_s: float) -> Deadline:
    """The deadline of `item`'s ranks: pytest-timeout's limit for it when that plugin set one
    (`PytestTimeoutBridge`), else `--test-timeout`."""
    return item.stash.get(_DEADLINE, None) or Deadline(test_timeout_s)


@dataclass(frozen=True)
class _SessionLimit:
    """Where pytest-timeout's limit for the whole session came from, and what carries it."""

    source: str
    repro_args: list[str]


def _session_limit(config: pytest.Config) -> _SessionLimit | None:
    """pytest-timeout's session-wide limit with its source, in pytest-timeout's precedence
    (`--timeout`, then `PYTEST_TIMEOUT`, then the ini file); read once, at configure time, when
    pytest-timeout reads them too."""
    option = config.getoption("timeout", None)
    variable = os.environ.get("PYTEST_TIMEOUT")
    ini = config.getini("timeout")
    try:
        if option is not None:
            value = float(option)
            return _SessionLimit(f"--timeout {value:g}", repro.option_args("--timeout", value))
        if variable is not None:
            value = float(variable)
            # A REPRO line carries no environment: it says the limit as the option with the same effect.
            return _SessionLimit(f"PYTEST_TIMEOUT={value:g}", repro.option_args("--timeout", value))
        if ini:
            value = float(ini)
            # The ini file (or the invocation's `-o`, which a REPRO line repeats) sets it again.
            return _SessionLimit(f"ini timeout = {value:g}", [])
    except ValueError:
        return None  # not a number: pytest-timeout refuses it at configure time, naming where it came from
    return None


def _marker_limit(item: pytest.Item) -> float | None:
    """The timeout of `item`'s own `@pytest.mark.timeout` marker, if it gives one (the marker wins
    over every session-wide setting in pytest-timeout)."""
    marker = item.get_closest_marker("timeout")
    if marker is None:
        return None
    value = marker.kwargs.get("timeout", marker.args[0] if marker.args else None)
    return None if value is None else float(value)


class PytestTimeoutBridge:
    """Registered in a pool session when pytest-timeout is active: makes its limit for a distributed
    test the ranks' deadline, and keeps its timer off while the test's body runs on the ranks."""

    def __init__(self, config: pytest.Config) -> None:
        self._session = _session_limit(config)

    @staticmethod
    def _harness_enforces(item: pytest.Item) -> bool:
        return world_sizes.is_distributed(item)

    @pytest.hookimpl(tryfirst=True, optionalhook=True)
    def pytest_timeout_set_timer(self, item: pytest.Item, settings: Any) -> bool | None:
        """pytest-timeout asks for its timer: for a distributed test, keep its limit as the ranks'
        deadline and arm nothing (True: the timer is "set", pytest-timeout's own one is not asked)."""
        if not self._harness_enforces(item) or item.stash.get(_ARMING_PHASE, False):
            return None
        seconds = float(settings.timeout)
        marker = _marker_limit(item)
        if marker is not None:
            source = f"@pytest.mark.timeout({marker:g})"
        elif self._session is not None:
            source = self._session.source
        else:  # another plugin's settings: pytest-timeout resolved a limit from none of its own sources
            source = f"timeout {seconds:g}"
        item.stash[_DEADLINE] = Deadline(seconds, f"pytest-timeout {source}")
        item.stash[_SETTINGS] = settings
        return True

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        return (yield from self._timed_by_pytest_timeout(item))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Generator[None, None, None]:
        return (yield from self._timed_by_pytest_timeout(item))

    def _timed_by_pytest_timeout(self, item: pytest.Item) -> Generator[None, None, None]:
        """A parent-side phase of a distributed test (its fixtures, in this process) keeps
        pytest-timeout's own timer, armed for this phase alone: no pool is started or waited for
        in it."""
        settings = item.stash.get(_SETTINGS, None)
        if settings is None or getattr(settings, "func_only", False):
            return (yield)  # no limit, or pytest-timeout's limit covers the test's call alone
        item.stash[_ARMING_PHASE] = True
        try:
            item.config.hook.pytest_timeout_set_timer(item=item, settings=settings)
        finally:
            item.stash[_ARMING_PHASE] = False
        try:
            return (yield)
        finally:
            item.config.hook.pytest_timeout_cancel_timer(item=item)

    def pytest_harness_repro_args(self, item: pytest.Item) -> list[str]:
        """A failed distributed test's reproduction keeps pytest-timeout's limit, so the re-run's
        ranks get the same deadline: `--timeout` when the command line or `PYTEST_TIMEOUT` set it (a
        marker is in the test's source; the ini file is read again by the re-run)."""
        if item.stash.get(_DEADLINE, None) is None or self._session is None:
            return []
        return list(self._session.repro_args)
