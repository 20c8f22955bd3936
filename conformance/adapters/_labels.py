"""Collective labels for the torch backends: which parameter FQNs an all-gather or
reduce-scatter carries, so the harness's trace diff can tell two same-shaped units apart.

Without a label a collective issued outside any module forward (FSDP's backward all-gathers
and reduce-scatters) would be anonymous, and a same-shape swap there would go unseen. Each
adapter wraps the backend's unshard / reduce entry points once; the wrapper publishes the
unit's FQNs in a context variable, which the adapter's ``collective_label`` returns. The rank
fixture registers that method with the harness for each test: nothing here imports the harness
or registers anything at import.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from typing import Any

_label: contextvars.ContextVar[str | None] = contextvars.ContextVar("backend_collective_label", default=None)
_wrapped: set[tuple[int, str]] = set()


def current_label() -> str | None:
    """The FQNs of the unit whose collective is being issued, or None outside a wrapped call."""
    return _label.get()


def label_calls(owner: Any, name: str, fqns_of: Callable[..., list[str] | None]) -> None:
    """Wrap `owner.name` (once per process) so collectives inside it are labelled `fqns_of(*args)`."""
    key = (id(owner), name)
    if key in _wrapped:
        return
    original = getattr(owner, name)

    @functools.wraps(original)
    def labelled(*args: Any, **kwargs: Any) -> Any:
        fqns = fqns_of(*args, **kwargs)
        token = _label.set(", ".join(fqns) if fqns else None)
        try:
            return original(*args, **kwargs)
        finally:
            _label.reset(token)

    setattr(owner, name, labelled)
    _wrapped.add(key)
