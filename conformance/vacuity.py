"""No vacuous pass: a scenario that passed without sharding anything fails.

The rank fixture watches what a test asks of its adapter. A test that passed without ever
calling ``shard()`` checked nothing of the backend (a scenario that loops over
``backend.forms()`` of a backend offering none, a body that returns early): it fails with
what happened and the fix. A ``shard()`` call counts when it is made, whatever it returns or
raises, so misuse scenarios (the backend refuses at shard time) exercise the backend too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conformance.protocol import BackendAdapter


class ExercisedNothing(AssertionError):
    """A test passed without making its backend shard anything."""


@dataclass
class ShardWatch:
    """Counts one adapter instance's ``shard()`` calls during one test."""

    adapter: BackendAdapter
    calls: int = 0

    def __post_init__(self) -> None:
        implementation = self.adapter.shard

        def counted_shard(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return implementation(*args, **kwargs)

        # On the instance (built fresh for each test): the class and its subclasses are untouched.
        self.adapter.shard = counted_shard  # type: ignore[method-assign]

    def verdict(self, test_passed: bool) -> None:
        """Raise :class:`ExercisedNothing` when the test passed having sharded nothing."""
        if not test_passed or self.calls:
            return
        forms = [form.value for form in self.adapter.forms()]
        raise ExercisedNothing(
            f"this test passed without calling backend.shard(): it checked nothing of the "
            f"{self.adapter.name} backend (its API forms here: {forms or 'none'}); a scenario must "
            "shard a model, or skip (pytest.skip / conformance.protocol.require) when it cannot"
        )
