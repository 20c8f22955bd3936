"""A failure's reproduction carries every option that changes a verdict or its timing.

Every option the harness and the conformance suite register is declared in its plugin's
`pytest_harness_repro_options` table, carried or not (with the reason); a new option that is in no
table fails here. Carried options survive the trip through a command line, and a re-run made with
`--repro` behaves as the run it reproduces (its rank files show it).
"""

from __future__ import annotations

import argparse
import re
import shlex
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pytest

import conformance.suite.backend_plugin
import harness.plugin
from conftest import InnerSession, read_cases
from harness.config import repro

PLUGINS = [harness.plugin, conformance.suite.backend_plugin]


@dataclass
class RecordingParser:
    """Stands in for pytest's parser (and its groups): records what a plugin registers."""

    options: dict[str, tuple[list[str], dict[str, Any]]] = field(default_factory=dict)
    """First long flag -> (every flag, argparse attributes)."""
    ini: set[str] = field(default_factory=set)

    def getgroup(self, name: str, description: str = "", after: str | None = None) -> RecordingParser:
        return self

    def addoption(self, *flags: str, **attrs: Any) -> None:
        self.options[next(flag for flag in flags if flag.startswith("--"))] = (list(flags), attrs)

    def addini(self, name: str, help: str, *args: Any, **kwargs: Any) -> None:
        self.ini.add(name)


def registered(plugin: ModuleType) -> RecordingParser:
    parser = RecordingParser()
    plugin.pytest_addoption(parser)
    return parser


@pytest.mark.parametrize("plugin", PLUGINS, ids=lambda plugin: plugin.__name__)
def test_every_option_is_declared_carried_or_not_with_a_reason(plugin: ModuleType) -> None:
    parser = registered(plugin)
    table = plugin.pytest_harness_repro_options()
    options = {*parser.options, *parser.ini}
    missing = sorted(options - set(table))
    assert not missing, (
        f"{plugin.__name__} registers {missing} but its pytest_harness_repro_options table does not say "
        "whether a REPRO line carries them: add each as repro.Carried() (it can change a verdict or its "
        "timing) or repro.NotCarried('why not')"
    )
    assert not sorted(set(table) - options), "the table declares options the plugin no longer registers"
    for option, policy in table.items():
        assert isinstance(policy, repro.Carried | repro.NotCarried), option
        if isinstance(policy, repro.NotCarried):
            assert len(policy.reason) > 20, f"{option}: say why it changes no verdict and no timing"


def _changed(attrs: dict[str, Any]) -> Any:
    """A value other than the option's default, of the option's kind."""
    default = attrs.get("default")
    if attrs.get("action") == "store_true":
        return True
    if attrs.get("action") == "append":
        return ["first", "second"]
    if "choices" in attrs:
        return next(choice for choice in attrs["choices"] if choice != default)
    kind = attrs.get("type", str)
    if kind is float:
        return (default or 1.0) / 3  # not exact in a short decimal: must not be rounded on the way
    if kind is int:
        return (default or 0) + 7
    return "some/where"


@pytest.mark.parametrize("plugin", PLUGINS, ids=lambda plugin: plugin.__name__)
def test_carried_options_survive_the_command_line(plugin: ModuleType) -> None:
    """Every option carried by its value (`Carried()`) is parsed back to the same value."""
    parser = registered(plugin)
    for option, policy in plugin.pytest_harness_repro_options().items():
        if not isinstance(policy, repro.Carried) or policy.args is not None or option not in parser.options:
            continue
        flags, attrs = parser.options[option]
        command_line = argparse.ArgumentParser(add_help=False)
        action = command_line.add_argument(*flags, **{k: v for k, v in attrs.items() if k != "help"})
        value = _changed(attrs)
        args = repro.option_args(option, value)
        assert getattr(command_line.parse_args(args), action.dest) == value, (option, value, args)


STRAGGLER = """
import time, pytest

@pytest.mark.world_size(2)
def test_straggler(rank):
    if rank == 1:
        raise ValueError("rank 1 fails at once")
    time.sleep(60)  # rank 0 straggles: it is given --straggler-grace, then its stacks are taken
"""
NODE = "test_straggler.py::test_straggler"
CHANGED = ("--device=cpu", "--seed=5", "--collective-timeout=4", "--test-timeout=40", "--straggler-grace=0.5")


def test_a_repro_re_runs_with_every_option_that_changed_the_verdict(inner: InnerSession) -> None:
    inner.write("test_straggler.py", STRAGGLER)
    first = inner.run("-q", *CHANGED, cache=True)
    output = first.stdout + first.stderr
    line = next((line for line in output.splitlines() if line.startswith("REPRO: ")), None)
    assert line is not None, output[-3000:]
    command = shlex.split(line.removeprefix("REPRO: ").split("  (or: ")[0])
    for option in CHANGED:
        assert option in command, (option, line)
    assert "-o" in command and "rank_fixture_modules=" in command, line  # the invocation's configuration too
    rerun = inner.run("--repro", NODE, cache=True)
    rerun_output = rerun.stdout + rerun.stderr
    assert rerun.returncode == 1 and "1 failed" in rerun_output, rerun_output[-3000:]
    junit = inner.directory / "reports" / "repro" / "junit"
    straggler = read_cases(junit / "rank-0.xml")["test_straggler"]
    # The recorded grace, not the default 5 s: the re-run's verdict and its timing are the run's.
    assert "hung: still running" in straggler.message and "0.5 s after another rank failed" in straggler.message, (
        straggler.message
    )
    assert 0.5 <= straggler.time_s < 5, straggler.time_s
    assert re.search(r"in test_straggler", straggler.text), straggler.text[-2000:]
    seeds = {
        prop.get("value") for prop in ET.parse(junit / "rank-0.xml").iter("property") if prop.get("name") == "seed"
    }
    assert seeds == {"5"}
