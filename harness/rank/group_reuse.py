"""Process groups kept across a warm rank's tests: the same request in a later test gets the same group.

Creating a communicator is a collective of its own: a store rendezvous and a connection mesh, about
12 ms for two gloo ranks here and seconds on NCCL. Tests rebuild the same groups and meshes again
and again (every HSDP mesh, FSDP1's hybrid groups, DeepSpeed's data-parallel group), so a warm
world that runs 1,000 tests would otherwise create thousands of communicators with the same
members. Here the k-th `new_group` (or `split_group`) call of a test with a given request gets the
group that the k-th such call of an earlier test created, where one is kept; otherwise torch
creates it and it is kept for later tests. `harness.rank.isolation` then leaves kept groups alive
at the end of a test and destroys the others, as it always did.

Invariants:

- A *request* is everything that decides what torch would create: for `new_group` the members
  (as given, with `sort_ranks`), backend, timeout, `use_local_synchronization`, description and
  device id; for `split_group` the parent group (by name), the split, timeout, description and
  backend. A request with `pg_options` (or any argument that is not plain data) is never reused:
  option objects compare by identity. Its group is destroyed after its test, as before.
- Every member of a kept group holds it, and every non-member holds torch's answer for it (the
  non-member marker), because the call that created it was one every rank of the request made.
  The kept set is part of the rank's sync state (`harness.rank.isolation.sync_state`): ranks whose
  kept sets differ (a test destroyed a kept group on one rank only) are told apart by the parent
  after that test, and the world is replaced before any rank could wait for a peer that hits
  the cache while it creates (`harness.session.verdict.world_reusable`).
- A kept group that a test destroyed is forgotten (at once when the same request comes again in
  that test, else at the test's end); the next request creates it anew.
- At most `MAX_KEPT` groups are kept per rank; requests beyond that get fresh groups.
- Reuse is off for a session with `--fresh-groups` (`TestTask.reuse_groups`), and a test marked
  `fresh_world` runs on brand-new ranks, so on fresh groups, anyway.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from harness.rank import tracing

MAX_KEPT = 64
"""Groups kept per rank at most (each holds its backend's threads and connections)."""

Request = tuple[str, tuple[tuple[str, Any], ...]]
"""(the creating function's name, its arguments as plain data, in signature order)."""

_kept: dict[Request, list[Any]] = {}
"""Per request, the groups (or non-member answers) earlier tests created, in the order they did."""
_handed: dict[Request, int] = {}
"""Per request, how many of its kept groups the running test got so far."""
_active = False
_digest = 0
_installed = False


def install() -> None:
    """Put reuse around `new_group` and `split_group` wherever the process binds them (idempotent;
    after `harness.rank.tracing.install`, so that what is kept is what the trace's `new_group` returns)."""
    global _installed
    if _installed:
        return
    for name in ("new_group", "split_group"):
        original = getattr(c10d, name, None)
        if original is not None:
            tracing.rebind_everywhere(original, _reusing(name, original), {name})
    _installed = True


def begin_test(enabled: bool) -> None:
    """A test starts: its calls get kept groups from the first of each request on (when `enabled`)."""
    global _active
    _handed.clear()
    _active = enabled and _installed


def end_test() -> set[Any]:
    """A test ended: forget kept groups it destroyed; the kept groups, which must outlive it."""
    global _active
    _active = False
    _handed.clear()
    live = c10d._world.pg_map
    changed = False
    for request, groups in list(_kept.items()):
        alive = [group for group in groups if not _is_group(group) or group in live]
        if len(alive) != len(groups):
            changed = True
            # Later entries were created after the destroyed one by the same calls: keep their order.
            if alive:
                _kept[request] = alive
            else:
                del _kept[request]
    if changed:
        _update_digest()
    return {group for groups in _kept.values() for group in groups if _is_group(group)}


def digest() -> int:
    """A digest of what this rank keeps, equal on ranks that keep the same requests as often."""
    return _digest


def forget_all() -> None:
    """Keep nothing (the default group is going away, or a test asked for fresh groups)."""
    _kept.clear()
    _handed.clear()
    _update_digest()


def kept_count() -> int:
    return sum(len(groups) for groups in _kept.values())


def _is_group(value: Any) -> bool:
    return isinstance(value, dist.ProcessGroup)


def _update_digest() -> None:
    global _digest
    text = repr(sorted((repr(request), len(groups)) for request, groups in _kept.items()))
    _digest = zlib.crc32(text.encode())


def _reusing(name: str, create: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(getattr(create, "__trace_original__", create))

    @functools.wraps(create)
    def reusing(*args: Any, **kwargs: Any) -> Any:
        if not _active:
            return create(*args, **kwargs)
        request = _request(name, signature, args, kwargs)
        if request is None:
            return create(*args, **kwargs)
        kept = _kept.get(request, [])
        index = _handed.get(request, 0)
        while index < len(kept):
            group = kept[index]
            if not _is_group(group) or group in c10d._world.pg_map:
                _handed[request] = index + 1
                return group
            # The test destroyed it on this rank (as it would on every rank): create it anew.
            del kept[index:]
            _update_digest()
        group = create(*args, **kwargs)
        _handed[request] = index + 1
        if kept_count() < MAX_KEPT:
            _kept.setdefault(request, []).append(group)
            _update_digest()
        return group

    reusing.__trace_original__ = getattr(create, "__trace_original__", create)  # type: ignore[attr-defined]
    return reusing


def _request(name: str, signature: inspect.Signature, args: tuple, kwargs: dict) -> Request | None:
    """The call as plain data (equal on every rank making the same call), or None: not reusable."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None  # torch will say what is wrong with the call
    bound.apply_defaults()
    if bound.arguments.get("pg_options") is not None:
        return None
    parts = []
    for parameter, value in bound.arguments.items():
        plain = _plain(value)
        if plain is _NOT_PLAIN:
            return None
        parts.append((parameter, plain))
    return name, tuple(parts)


_NOT_PLAIN = object()


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, datetime.timedelta):
        return ("timedelta", value.total_seconds())
    if isinstance(value, torch.device):
        return ("device", str(value))
    if isinstance(value, dist.ProcessGroup):
        return ("group", c10d._world.pg_names.get(value, ""))
    if isinstance(value, (list, tuple, range)):
        items = tuple(_plain(item) for item in value)
        return _NOT_PLAIN if any(item is _NOT_PLAIN for item in items) else items
    return _NOT_PLAIN
