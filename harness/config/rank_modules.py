"""Parent side: the modules every rank of the session loads, from the ini options and the plugins.

Three lists reach the ranks: the modules that register rank-side fixtures (`rank_fixture_modules`),
the `module:attr` collective label providers (`collective_label_providers`) and the heavy imports the
zygote makes once for all ranks (`rank_preload_modules`). A project lists its own in its ini file; a
plugin that ships in a package returns its own from the `pytest_harness_rank_modules` hook, so that
an installed plugin works in any directory without the user copying ini lines (the conformance
suite's plugin registers its `backend` rank fixture that way). Both are merged here, once per
session: the ini file's entries first, then each plugin's in hook call order, each entry once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class RankModules:
    """Modules a plugin's tests need in every rank (what `pytest_harness_rank_modules` returns)."""

    fixtures: tuple[str, ...] = ()
    """Modules that register rank-side fixtures with `harness.rank_fixture` (imported by every rank)."""
    label_providers: tuple[str, ...] = ()
    """`module:attr` callables returning a label for the collective being issued."""
    preload: tuple[str, ...] = ()
    """Heavy imports the session's zygote makes once before forking ranks (their import-time code
    sees the session's environment, not a rank's)."""


def _once(entries: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(entry for entry in entries if entry))


def _checked(result: object, plugin_hint: str) -> RankModules:
    if not isinstance(result, RankModules):
        raise pytest.UsageError(
            f"a pytest_harness_rank_modules implementation returned {result!r} ({plugin_hint}): "
            "return a harness.RankModules (or None)"
        )
    for field_name in ("fixtures", "label_providers", "preload"):
        value = getattr(result, field_name)
        if isinstance(value, str) or not all(isinstance(entry, str) for entry in value):
            raise pytest.UsageError(
                f"a pytest_harness_rank_modules implementation returned RankModules({field_name}={value!r}) "
                f"({plugin_hint}): give a tuple of module names, e.g. {field_name}=({value!r},)"
            )
    return result


def session_rank_modules(config: pytest.Config) -> RankModules:
    """The ini options' modules, then every plugin's (`pytest_harness_rank_modules`), each once."""
    from_plugins = [
        _checked(result, "its plugin is among those pytest loaded")
        for result in config.hook.pytest_harness_rank_modules(config=config)
        if result is not None
    ]
    return RankModules(
        fixtures=_once([*config.getini("rank_fixture_modules"), *(m for r in from_plugins for m in r.fixtures)]),
        label_providers=_once(
            [*config.getini("collective_label_providers"), *(m for r in from_plugins for m in r.label_providers)]
        ),
        preload=_once([*config.getini("rank_preload_modules"), *(m for r in from_plugins for m in r.preload)]),
    )
