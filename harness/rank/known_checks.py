"""Checks a test goes on past: a failed check whose text the parent says is known (rank side).

A plugin that records known failures (the conformance suite's expectations files) names, per
test, the texts of the failures it expects (`pytest_harness_known_failures`). The parent sends
them with the test (`TestTask.known_failures`); for the body's duration this rank's ledger holds
them. A scenario marks its checks with `check(what)`, a context manager and a decorator:

- an `AssertionError` raised in a check whose text contains a known text is recorded, and the
  test goes on after the check, so the checks behind a known failure still run;
- when the body is over, the rank fails with every recorded failure (`KnownFailuresSeen`), and
  the plugin judges it as before (all its texts seen: the expected failure);
- a later failure whose text contains no known text, in a check or anywhere in the body, after
  one was recorded, fails the rank as `DefectBehindKnownFailure`: its text carries
  `DEFECT_BEHIND_KNOWN_FAILURE`, which no expectation may excuse.

Only assertions are gone past: a library's exception (a KeyError in a load) stops the test as
before, since the code after it may be in the middle of a collective sequence its peers finish.
For the same reason a check holds the comparison, not collectives after it: a rank whose check
fails leaves the check at the failing line, and a collective later in the same check would be
skipped on that rank alone (its peers would wait for it until the timeout). Outside a test (a
plain script, a parent-side SPMD call) and for a test without known failures, `check` does
nothing: its assertions raise as written.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import TracebackType

DEFECT_BEHIND_KNOWN_FAILURE = "a defect behind the expected failure"
"""In the text of a failure that came after a known one and matches none of the known texts."""


class KnownFailuresSeen(AssertionError):
    """The test's checks failed only as the parent said they would: every recorded failure, in
    the order the checks ran."""


class DefectBehindKnownFailure(AssertionError):
    """A failure behind a known one, that the known texts do not describe: the known failure
    hid it before the test went on past its checks."""


@dataclass
class _Ledger:
    known: tuple[str, ...]
    seen: list[tuple[str, str]] = field(default_factory=list)  # (check, failure text)

    def matching(self, text: str) -> str | None:
        return next((known for known in self.known if known in text), None)

    def summary(self) -> str:
        return "\n".join(f"- check {what!r} failed as expected: {text}" for what, text in self.seen)


_ledger: _Ledger | None = None


def finish_body(error: BaseException | None) -> None:
    """Called when the body is over (``error``: what it raised, None when it returned). Raises
    what the rank's outcome must be when known failures were recorded; else returns (the body's
    own exception, if any, goes on as it is)."""
    ledger = _ledger
    if ledger is None or not ledger.seen:
        return
    if error is None:
        raise KnownFailuresSeen(_seen(ledger))
    if isinstance(error, (KnownFailuresSeen, DefectBehindKnownFailure)) or not isinstance(error, Exception):
        return  # already judged, or an interrupt or a skip: as it is
    text = f"{type(error).__name__}: {error}"
    if ledger.matching(text) is not None:  # a known library failure after the known checks
        raise KnownFailuresSeen(f"{_seen(ledger)}\nthen, as expected, it stopped at: {text}") from error
    raise DefectBehindKnownFailure(_behind(ledger, "after the checks", text)) from error


def _seen(ledger: _Ledger) -> str:
    return (
        f"{len(ledger.seen)} check(s) failed as the expectations say, and the test went on past each:\n"
        + ledger.summary()
    )


def _behind(ledger: _Ledger, where: str, text: str) -> str:
    return (
        f"{DEFECT_BEHIND_KNOWN_FAILURE}: {where} that failed as expected, the test went on and failed "
        f"in a way no expected-failure text names (fix it, or record its text with the entry if it is "
        f"the same defect's consequence):\n{text}\nThe expected failures before it:\n{ledger.summary()}"
    )


class check(contextlib.ContextDecorator):
    """One check of a test: ``with check("optimizer state read back"): assert ...`` or
    ``@check("parameters match the oracle")`` on a helper that asserts. See the module's text."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> check:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> bool:
        ledger = _ledger
        if ledger is None or error is None or isinstance(error, (KnownFailuresSeen, DefectBehindKnownFailure)):
            return False
        if not isinstance(error, AssertionError):
            return False  # a library's exception stops the test (see the module's text)
        text = str(error)
        if ledger.matching(text) is not None:
            ledger.seen.append((self.what, text))
            return True
        if ledger.seen:
            raise DefectBehindKnownFailure(_behind(ledger, f"after the check(s) before {self.what!r}", text)) from error
        return False


@contextlib.contextmanager
def known_failures(known: tuple[str, ...]) -> Iterator[None]:
    """The known failure texts of the test that runs in the block on this rank (none: `check`
    is inert); the runner enters it around a test's fixtures and body."""
    global _ledger
    _ledger = _Ledger(known) if known else None
    try:
        yield
    finally:
        _ledger = None
