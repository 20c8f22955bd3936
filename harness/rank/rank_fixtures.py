"""Rank-side fixtures: values a distributed test receives by argument name inside each rank.

The parent only knows the names (it registers placeholders so pytest's fixture resolution is
satisfied); the values are built in the rank, where the device and process group live.

A parent-side SPMD call (`harness.SpmdWorld.run`) has no fixtures: the function it runs asks
`call_context()` for the same `RankContext` a rank fixture would receive.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class RankContext:
    """What a rank fixture may look at: who this rank is and what the test was called with."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    params: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)


RankFixture = Callable[[RankContext], Any]
_REGISTRY: dict[str, RankFixture] = {}
_active_call: RankContext | None = None


def call_context() -> RankContext:
    """The `RankContext` of the parent-side SPMD call running on this rank (`harness.SpmdWorld.run`):
    its rank, world size, device and the forwarded pytest options. Rank side, during a call only."""
    if _active_call is None:
        raise RuntimeError(
            "harness.call_context() was called outside a parent-side SPMD call: it answers only inside "
            "a function that SpmdWorld.run (or .call) is running on the ranks. A distributed test "
            "(@pytest.mark.world_size) takes the same values from its rank, world_size and device fixtures "
            "(or a harness.rank_fixture of its own)"
        )
    return _active_call


def enter_call(context: RankContext | None) -> None:
    """Make `context` what `call_context()` returns, until `enter_call(None)` (`harness.rank.call_runner`)."""
    global _active_call
    _active_call = context


def rank_fixture(fn: RankFixture | None = None, *, name: str | None = None) -> Any:
    """Register `fn(ctx)` as the rank-side fixture `name` (default: the function's name).

    A generator function gets teardown after the test, like a pytest yield fixture.
    """

    def register(func: RankFixture) -> RankFixture:
        key = name or func.__name__
        existing = _REGISTRY.get(key)
        if existing is not None and existing.__qualname__ != func.__qualname__:
            raise ValueError(f"rank fixture {key!r} is already registered by {existing.__module__}")
        _REGISTRY[key] = func
        return func

    return register(fn) if fn is not None else register


def _finalize(key: str, generator: Generator[Any, None, None]) -> None:
    """A generator fixture's teardown: the code after its `yield`, whether the test passed or not
    (as pytest runs it: the test's exception is not thrown into the fixture)."""
    try:
        next(generator)
    except StopIteration:
        return
    raise RuntimeError(f"rank fixture {key!r} yielded more than once; a fixture yields exactly one value")


def registered_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def resolve(names: tuple[str, ...], ctx: RankContext, stack: ExitStack) -> dict[str, Any]:
    """Build the requested rank fixtures; generator fixtures are finalised when `stack` closes."""
    values: dict[str, Any] = {}
    for key in names:
        try:
            factory = _REGISTRY[key]
        except KeyError:
            raise LookupError(
                f"rank fixture {key!r} is not registered in this rank: list the module that registers it "
                "in the 'rank_fixture_modules' ini option, or return it from the plugin's "
                "pytest_harness_rank_modules hook (harness.RankModules(fixtures=...))"
            ) from None
        if inspect.isgeneratorfunction(factory):
            generator = factory(ctx)
            values[key] = next(generator)
            stack.callback(_finalize, key, generator)
        else:
            values[key] = factory(ctx)
    return values


@rank_fixture
def rank(ctx: RankContext) -> int:
    return ctx.rank


@rank_fixture
def world_size(ctx: RankContext) -> int:
    return ctx.world_size


@rank_fixture
def device(ctx: RankContext) -> torch.device:
    return ctx.device
