"""How the pytest process ends on SIGINT and SIGTERM: the same clean way, whichever comes first.

Ctrl-C is a KeyboardInterrupt, which pytest turns into an "interrupted" session that still
finishes (hooks, summary, unconfigure): the harness then publishes the interrupted test, writes
the per-rank reports of the tests that finished, ends the ranks and their children and removes
its run directory. SIGTERM (a CI system cancelling the job) would kill the process without any
of that, so the guard turns it into `SessionTerminated`, a KeyboardInterrupt.

Once the session is ending (the first signal, or the normal end's clean-up), a further SIGINT or
SIGTERM does not interrupt the clean-up half-way (which would leave ranks, files, or no reports
at all): it is noted on stderr and the clean-up, which is bounded, goes on. A third one stops the
process at once, as the signal's default action would (the ranks still die with it).
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any


class SessionTerminated(KeyboardInterrupt):
    """SIGTERM reached the pytest process: the session ends as it does after Ctrl-C."""


class SignalGuard:
    """Installed for the session's life in the main thread; a no-op elsewhere (e.g. pytester)."""

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}
        self._ending = False
        self._noted = 0
        self.received: list[str] = []
        """The signals received, by name, in order."""

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        # Only where the default behaviour is in place: a handler someone else installed wins.
        defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
        for sig, default in defaults.items():
            if signal.getsignal(sig) is default:
                self._previous[sig] = default
                signal.signal(sig, self._handle)

    def ending(self) -> None:
        """From now on a signal does not interrupt: the session is already on its way out."""
        self._ending = True

    @property
    def is_ending(self) -> bool:
        return self._ending

    def uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        self.received.append(name)
        if not self._ending:
            self._ending = True
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SessionTerminated(f"{name} received: the session ends (finished tests are reported, ranks ended)")
        self._noted += 1
        if self._noted == 1:
            os.write(
                2,
                f"\nharness: {name} received while the session is ending; finishing the clean-up "
                f"(reports, ranks) first. Send it once more to stop at once.\n".encode(),
            )
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
