"""World sizes as constraints: which world sizes each distributed test runs at in this session.

A test declares the world sizes it can run at with the `world_size` marker; the session decides
which sizes it runs: `--world-sizes`, or under torchrun the launched world's WORLD_SIZE, or
(neither given) each test's own default sizes. A test runs at every session size its marker
allows. A size it cannot run at is deselected with the reason, and the terminal summary says
how many were deselected and why, so a world in which the suite runs nothing is never silent.

Marker forms::

    world_size(2)                          pinned: exactly 2 ranks, the test id has no size
    world_size([2, 4])                     exactly these sizes; ids ws2, ws4
    world_size(min=2, default=[2, 4])      any size >= 2; a session that chose none runs 2 and 4
    world_size(min=4, multiple_of=2, max=16, default=4)
    world_size(min=2, default=2, exclude=fn)   fn(WorldShape, params) -> reason | None, per test

Every form but the pinned one parametrizes the test over `world_size` with ids `ws<N>`, so a
test id names its size and stays the same at that size in every session.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from harness.config.torchrun import TorchrunWorld

DEFAULT_WORLD_SIZES = (1, 2, 4)
"""The sizes a session runs a constrained test at when neither the session nor the test chose."""

_CONSTRAINT_KEYS = ("min", "max", "multiple_of", "default")
_USAGE = (
    "use @pytest.mark.world_size(N), world_size([N1, N2]) or constraints such as "
    "world_size(min=2, multiple_of=2, default=[2, 4])"
)


@dataclass(frozen=True)
class WorldShape:
    """A world as a test's `exclude` predicate sees it: its size and the ranks per host."""

    size: int
    local_size: int
    """Ranks on each host: LOCAL_WORLD_SIZE under torchrun; a warm pool is one host (== size)."""

    @property
    def hosts(self) -> int:
        return self.size // self.local_size


Exclusion = Callable[[WorldShape, Mapping[str, Any]], "str | None"]
"""`exclude=` predicate: given the world and the test's parameters, why it cannot run, or None."""


@dataclass(frozen=True)
class WorldSizeSpec:
    """What one test's `world_size` marker allows."""

    listed: tuple[int, ...] | None = None
    """The sizes a test lists (`world_size(N)` or `world_size([...])`); None for constraints."""
    pinned: bool = False
    """`world_size(N)`: one size, not parametrized (the test id carries no size)."""
    minimum: int = 1
    maximum: int | None = None
    multiple_of: int = 1
    default: tuple[int, ...] | None = None
    exclude: Exclusion | None = None

    def refusal(self, size: int) -> str | None:
        """Why this test cannot run at `size` whatever its parameters, or None if it can."""
        if self.listed is not None:
            if size in self.listed:
                return None
            if len(self.listed) == 1:
                return f"runs only at world size {self.listed[0]}"
            return f"runs only at world sizes {_join(self.listed)}"
        if size < self.minimum:
            return f"needs world size >= {self.minimum}"
        if self.maximum is not None and size > self.maximum:
            return f"needs world size <= {self.maximum}"
        if size % self.multiple_of:
            return f"needs a world size divisible by {self.multiple_of}"
        return None


def parse_marker(marker: pytest.Mark, where: str) -> WorldSizeSpec:
    """Check a `world_size` marker and say what it allows; errors name the test and the fix."""
    kwargs = dict(marker.kwargs)
    exclude = kwargs.pop("exclude", None)
    if exclude is not None and not callable(exclude):
        raise TypeError(f"{where}: world_size(exclude=...) takes a function (WorldShape, params) -> reason | None")
    unknown = sorted(set(kwargs) - set(_CONSTRAINT_KEYS))
    if unknown or len(marker.args) > 1 or (marker.args and kwargs) or not (marker.args or kwargs):
        raise TypeError(f"{where}: {_USAGE}; got {_describe(marker)}")
    if marker.args:
        value = marker.args[0]
        pinned = not isinstance(value, (list, tuple))
        sizes = _sizes(where, "world_size", [value] if pinned else list(value))
        if not sizes:
            raise ValueError(f"{where}: world_size list is empty")
        return WorldSizeSpec(listed=sizes, pinned=pinned, exclude=exclude)
    minimum = _sizes(where, "min", [kwargs.get("min", 1)])[0]
    multiple_of = _sizes(where, "multiple_of", [kwargs.get("multiple_of", 1)])[0]
    maximum = _sizes(where, "max", [kwargs["max"]])[0] if "max" in kwargs else None
    if maximum is not None and maximum < minimum:
        raise ValueError(f"{where}: world_size(max={maximum}) is below min={minimum}")
    default = None
    if "default" in kwargs:
        raw = kwargs["default"]
        default = _sizes(where, "default", list(raw) if isinstance(raw, (list, tuple)) else [raw])
        if not default:
            raise ValueError(
                f"{where}: world_size(default=[]) is empty; leave it out to use {_join(DEFAULT_WORLD_SIZES)}"
            )
    spec = WorldSizeSpec(minimum=minimum, maximum=maximum, multiple_of=multiple_of, default=default, exclude=exclude)
    for size in default or ():
        reason = spec.refusal(size)
        if reason is not None:
            raise ValueError(f"{where}: default world size {size} contradicts the marker: it {reason}")
    return spec


def _sizes(where: str, name: str, values: Iterable[Any]) -> tuple[int, ...]:
    sizes = []
    for size in values:
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"{where}: {name} must be an int or a list of ints, got {size!r}")
        if size < 1:
            raise ValueError(f"{where}: {name} must be >= 1, got {size}")
        sizes.append(size)
    return tuple(dict.fromkeys(sizes))


def _describe(marker: pytest.Mark) -> str:
    args = [repr(a) for a in marker.args] + [f"{k}={v!r}" for k, v in marker.kwargs.items()]
    return f"world_size({', '.join(args)})"


def _join(sizes: Iterable[int]) -> str:
    return ", ".join(str(s) for s in sizes)


def parse_sizes_option(text: str) -> tuple[int, ...]:
    """`--world-sizes 2,4,8` -> (2, 4, 8)."""
    try:
        sizes = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        sizes = ()
    if not sizes or sizes[0] < 1:
        raise pytest.UsageError(f"--world-sizes takes positive integers separated by commas, e.g. 2,4,8; got {text!r}")
    return sizes


@dataclass(frozen=True)
class SessionWorldSizes:
    """The world sizes this pytest session runs, and the shape of a world of each size."""

    chosen: tuple[int, ...] | None
    """--world-sizes, or (WORLD_SIZE,) under torchrun; None: every test runs at its defaults."""
    origin: str
    """Where the sizes come from, for messages: '--world-sizes 2,4,8', 'torchrun WORLD_SIZE=3', ..."""
    fallback: tuple[int, ...] = DEFAULT_WORLD_SIZES
    """Defaults for a constrained test that gives none."""
    visible_gpus: int = 0
    """With CUDA in use: a session that chose no sizes also runs constrained tests at this size."""
    local_size: int | None = None
    """LOCAL_WORLD_SIZE under torchrun; None in a pool session (every world is on this host)."""

    def shape(self, size: int) -> WorldShape:
        return WorldShape(size, self.local_size if self.local_size is not None else size)

    def own_sizes(self, spec: WorldSizeSpec) -> tuple[int, ...]:
        """The sizes a test runs at when the session chose none: its list, or its defaults (else
        `fallback`) and the number of visible GPUs, as far as its constraints allow them."""
        if spec.listed is not None:
            return spec.listed
        wanted = [*(spec.default or self.fallback)]
        if self.visible_gpus:
            wanted.append(self.visible_gpus)
        return tuple(size for size in dict.fromkeys(wanted) if spec.refusal(size) is None)

    def candidates(self, spec: WorldSizeSpec) -> tuple[int, ...]:
        """The sizes a parametrized test is generated at; those it does not run at are deselected.

        A session that chose sizes generates each of them (a refusal is then reported) and the
        test's own sizes as well, deselected: the test exists at those sizes, this session does
        not run them (so an expected-failure entry recorded at one is not stale).
        """
        own = self.own_sizes(spec)
        if self.chosen is None:
            return own
        return tuple(sorted({*self.chosen, *own}))

    def refusal(self, spec: WorldSizeSpec, size: int | None, params: Mapping[str, Any]) -> str | None:
        """Why a generated test does not run in this session, or None if it runs."""
        if size is None:  # constraints that allow none of the fallback sizes, and no default
            reasons = dict.fromkeys(r for s in self.fallback if (r := spec.refusal(s)) is not None)
            return f"allows none of {_join(self.fallback)} ({'; '.join(reasons)}) and has no default= sizes"
        if self.chosen is not None and size not in self.chosen:
            return f"runs only at world size {size}" if spec.pinned else "not among this session's world sizes"
        reason = spec.refusal(size)
        if reason is None and spec.exclude is not None:
            reason = spec.exclude(self.shape(size), params)
        return reason


def session_world_sizes(
    option: str | None, device: str, visible_gpus: int, torchrun: TorchrunWorld | None
) -> SessionWorldSizes:
    """Resolve `--world-sizes`, the torchrun world this process is a rank of (if any) and the
    device into this session's sizes."""
    chosen = parse_sizes_option(option) if option else None
    if torchrun is not None:  # this process is a rank of a launched world
        world_size = torchrun.world_size
        if chosen is not None and world_size not in chosen:
            raise pytest.UsageError(
                f"this torchrun world has {world_size} ranks but --world-sizes {option} excludes it; "
                "under torchrun every test runs at WORLD_SIZE: drop --world-sizes"
            )
        origin = f"torchrun WORLD_SIZE={world_size}"
        return SessionWorldSizes((world_size,), origin, local_size=torchrun.local_world_size)
    if chosen is not None:
        return SessionWorldSizes(chosen, f"--world-sizes {_join(chosen).replace(' ', '')}")
    gpus = visible_gpus if device != "cpu" else 0
    return SessionWorldSizes(None, "each test's default world sizes", visible_gpus=gpus)


# -- the pytest side: parametrize, deselect, report -------------------------------------------

_SESSION_KEY = pytest.StashKey[SessionWorldSizes]()
_DESELECTED_KEY = pytest.StashKey[list[tuple[str, str]]]()


def configure(config: pytest.Config, visible_gpus: int, torchrun: TorchrunWorld | None) -> None:
    config.addinivalue_line(
        "markers",
        "world_size(n | [n, ...] | min=, max=, multiple_of=, default=, exclude=): the world sizes a "
        "test runs at (see harness/config/world_sizes.py); a list or constraints parametrize it (ids ws<N>)",
    )
    config.stash[_SESSION_KEY] = session_world_sizes(
        config.option.world_sizes, config.option.device, visible_gpus, torchrun
    )
    config.stash[_DESELECTED_KEY] = []


def generate(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("world_size")
    if marker is None:
        return
    spec = parse_marker(marker, metafunc.definition.nodeid)
    if spec.pinned:
        return
    sizes = metafunc.config.stash[_SESSION_KEY].candidates(spec)
    if not sizes:
        return  # one unparametrized item, deselected with the reason in `deselect`
    if "world_size" not in metafunc.fixturenames:
        metafunc.fixturenames.append("world_size")
    metafunc.parametrize("world_size", sizes, ids=[f"ws{n}" for n in sizes])


def world_size_of(item: pytest.Item) -> int | None:
    """The world size a collected distributed test runs at (None: not distributed, or none)."""
    marker = item.get_closest_marker("world_size")
    if marker is None:
        return None
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "world_size" in callspec.params:
        return int(callspec.params["world_size"])
    spec = parse_marker(marker, item.nodeid)
    return spec.listed[0] if spec.pinned and spec.listed else None


def is_distributed(item: pytest.Item) -> bool:
    return item.get_closest_marker("world_size") is not None


def deselect(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Drop the tests this session cannot run at their world size; remember why for the summary."""
    session = config.stash[_SESSION_KEY]
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    reasons = config.stash[_DESELECTED_KEY]
    for item in items:
        marker = item.get_closest_marker("world_size")
        reason = None
        if marker is not None:
            spec = parse_marker(marker, item.nodeid)
            callspec = getattr(item, "callspec", None)
            params = dict(callspec.params) if callspec is not None else {}
            reason = session.refusal(spec, world_size_of(item), params)
        if reason is None:
            kept.append(item)
        else:
            dropped.append(item)
            reasons.append((item.nodeid, reason))
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def repro_args(item: pytest.Item) -> list[str]:
    """A session that chose its sizes: the re-run chooses this test's size (under torchrun too,
    so a failure at WORLD_SIZE=3 re-runs on one machine in a pool of 3)."""
    session = item.config.stash.get(_SESSION_KEY, None)
    size = world_size_of(item)
    if session is None or session.chosen is None or size is None:
        return []
    return [f"--world-sizes={size}"]


def summary_lines(config: pytest.Config) -> list[str]:
    """What the terminal summary says about tests deselected for their world size."""
    reasons = config.stash.get(_DESELECTED_KEY, [])
    if not reasons:
        return []
    session = config.stash[_SESSION_KEY]
    counts = Counter(reason for _, reason in reasons)
    common = "; ".join(f"{count} {reason}" for reason, count in counts.most_common(6))
    more = f"; {len(counts) - 6} other reasons (-v lists them)" if len(counts) > 6 else ""
    lines = [f"harness: {len(reasons)} deselected for their world size ({session.origin}): {common}{more}"]
    if config.option.verbose > 0:
        lines += [f"  {nodeid}: {reason}" for nodeid, reason in reasons]
    return lines
