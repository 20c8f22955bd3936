"""One-sided waits in seconds under torchrun: each torchrun rank learns, while its own test body is
blocked in a collective, that its peers can never match it, and ends that wait itself.

Pool mode has the parent for this (`harness.trace.one_sided` over the ranks' trace files, then a
kill). A torchrun world has no parent, and a rank may not be killed (it runs the next test), so:

* **What the ranks share: the c10d store.** Every rank's watcher thread publishes what its trace
  file gained (chunks under per-test keys, `LockstepChannel`) and, when its body has returned,
  that it finished. The store is the TCPStore behind MASTER_ADDR:MASTER_PORT, reached through a
  client connection of its own (not the default group's store object, which the test's
  `new_group` calls use from the main thread), so it works across hosts.
* **Who judges: the waiting rank, for itself.** Only when its own last collective has stayed
  unfinished for a poll or two does a watcher read its group's peers: their finished flags and
  trace chunks (mirrored into local files), and asks `OneSidedWatch.check` with itself and the
  peers stuck in the same group as the waiting ranks. So a test that does not wait costs one
  small read of its own trace file per poll and a store write per poll that added records.
* **How a wait ends: its connections.** gloo cannot cancel a wait in progress; shutting down the
  test's gloo connections fails it at once (`harness.process.sockets`). The session's own
  connections (the control group that exchanges outcomes, the store) are protected: they were
  noted when the session started (`ProtectedSockets`). The world is then unusable, as after a
  collective timeout (the unfinished collective says so); the pytest process lives on.
* **What the test reports**: the stopped rank's result is a `RankLoss` "stopped by the harness
  ... : waited alone in collective #k on group [..] ...", with its main thread's stack, as in
  pool mode; a peer whose wait in the same group ended because of that stop reports the same
  reason (it publishes nothing; it reads the stopper's reason from the store).

Limits (the collective timeout still ends these waits): waits the traces cannot judge (see
`harness.trace.one_sided`); a peer that died (it never says it finished); NCCL worlds (their
waits are not on the sockets); a default group joined before pytest started (its connections
cannot be told from the session's); gloo with lazy connections (TORCH_GLOO_LAZY_INIT), whose
control-group connections made after the session started are not known to be protected.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from harness.messages import RankLoss, RankOutcome
from harness.process import sockets
from harness.trace.one_sided import OneSidedWatch
from harness.trace.records import CollectiveRecord, RankTrace

__all__ = ["LockstepChannel", "ProtectedSockets", "TorchrunWatch", "WaitStopped", "open_channel"]

POLL_S = 0.25
"""How often a watcher looks at its own trace (and, while it waits, at its peers'), as in pool mode."""
_JUDGE_AFTER_S = 0.5
"""How long the rank's own last collective must stay unfinished before its peers are read: a
collective that completes normally never costs a store read."""


class ProtectedSockets:
    """The sockets a stop must never shut down, noted while the session starts.

    `before_join()` before the default group is created, `after_join()` after it, `ready()` once
    the session's own connections (control group, store client) exist. Protected: everything
    open at `ready()` except the default group's connections (those opened by the join that are
    not the store's, told by MASTER_PORT at either end). A default group that existed before the
    join (a torchrun script joined before pytest) has no such connections: it stays protected.
    """

    def __init__(self, store_port: int | None) -> None:
        self._store_port = store_port
        self._before: set[str] = set()
        self._default_group: set[str] = set()
        self.keep: frozenset[str] = frozenset()

    def before_join(self) -> None:
        self._before = set(sockets.open_sockets())

    def after_join(self) -> None:
        for identity, fd in sockets.open_sockets().items():
            ports = sockets.connected_tcp_ports(identity, fd) if identity not in self._before else None
            if ports is not None and self._store_port not in ports:
                self._default_group.add(identity)

    def ready(self) -> None:
        self.keep = frozenset(set(sockets.open_sockets()) - self._default_group)


class LockstepChannel:
    """The store keys through which the ranks of one torchrun session tell each other, per test,
    how far their traces got, that they finished, and why a wait was stopped."""

    def __init__(self, store: dist.Store, session_key: str) -> None:
        self.store = store
        self.prefix = f"fsdp-harness/torchrun/{session_key}"

    def _key(self, test: int, rank: int | None, name: str) -> str:
        return f"{self.prefix}/{test}/{'all' if rank is None else rank}/{name}"

    def publish(self, test: int, rank: int, chunk_no: int, data: bytes) -> None:
        self.store.set(self._key(test, rank, f"chunk{chunk_no}"), data)
        self.store.add(self._key(test, rank, "chunks"), 1)  # after the chunk: a reader never misses one

    def chunks(self, test: int, rank: int, since: int) -> list[bytes]:
        count = self.store.add(self._key(test, rank, "chunks"), 0)
        return [self.store.get(self._key(test, rank, f"chunk{n}")) for n in range(since, count)]

    def mark_finished(self, test: int, rank: int) -> None:
        self.store.set(self._key(test, rank, "finished"), b"1")

    def finished(self, test: int, rank: int) -> bool:
        return bool(self.store.check([self._key(test, rank, "finished")]))

    def announce_stop(self, test: int, group: tuple[int, ...], reason: str) -> None:
        self.store.set(self._key(test, None, "stopped"), json.dumps({"group": list(group), "reason": reason}))

    def withdraw_stop(self, test: int) -> None:
        with contextlib.suppress(Exception):  # best effort: the key is only read during this test
            self.store.delete_key(self._key(test, None, "stopped"))

    def stop_reason(self, test: int, group: tuple[int, ...]) -> str | None:
        key = self._key(test, None, "stopped")
        if not self.store.check([key]):
            return None
        announced = json.loads(self.store.get(key))
        return str(announced["reason"]) if tuple(announced["group"]) == group else None

    def forget(self, test: int, rank: int, chunk_count: int) -> None:
        """Delete this rank's keys of a test every rank is done with (the stop key is rank 0's)."""
        names = ["chunks", "finished", *(f"chunk{n}" for n in range(chunk_count))]
        with contextlib.suppress(Exception):  # a key left behind costs store memory, nothing else
            for name in names:
                self.store.delete_key(self._key(test, rank, name))
            if rank == 0:
                self.store.delete_key(self._key(test, None, "stopped"))


def open_channel(control: dist.ProcessGroup, rank: int, timeout_s: float) -> tuple[LockstepChannel | None, str]:
    """A channel on a client connection of its own to MASTER_ADDR:MASTER_PORT, under a session key
    rank 0 draws and sends over `control`; (None, why) when there is no such store."""
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    session_key = [os.urandom(8).hex() if rank == 0 else ""]
    try:
        dist.broadcast_object_list(session_key, src=0, group=control)
    except (RuntimeError, ValueError) as error:  # ValueError: a control group torch does not know
        return None, f"the session key could not be shared over the control group ({error})"
    if not address or not port:
        return None, "MASTER_ADDR or MASTER_PORT is not set"
    try:
        store = dist.TCPStore(address, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as error:
        return None, f"the store at {address}:{port} could not be reached ({error})"
    return LockstepChannel(store, str(session_key[0])), ""


@dataclass(frozen=True)
class WaitStopped:
    """A wait of this rank that the harness ended."""

    reason: str
    """Why it could never complete (`OneSidedWatch.check`'s words)."""
    after_s: float
    """How far into the test."""
    stacks: str = ""
    """The main thread's stack when this rank stopped it (empty when a peer's stop ended it)."""

    def loss(self, rank: int, outcome: RankOutcome) -> RankLoss:
        """This rank's result: lost because of its peers, as a pool rank the parent stopped."""
        return RankLoss(
            rank,
            f"stopped by the harness {self.after_s:.1f} s into the test: {self.reason}",
            stacks=self.stacks,
            duration_s=outcome.duration_s,
            after_peer_failed=True,
        )


class _Feed:
    """Bytes of one trace as they arrive -> whole lines into a `RankTrace`."""

    def __init__(self) -> None:
        self.trace = RankTrace()
        self._partial = b""

    def take(self, data: bytes) -> None:
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            if line:
                with contextlib.suppress(ValueError):  # a corrupt line: the verdict reads the file again
                    self.trace.add(line)

    def stuck(self) -> CollectiveRecord | None:
        """The last collective, when it has not returned and could be judged."""
        records = self.trace.by_index
        last = records[max(records)] if records else None
        if last is None or last.completed or last.skipped or last.is_p2p:
            return None
        return last


class TorchrunWatch:
    """This rank's watcher thread for one test: start it before the body runs, `finish` after."""

    def __init__(
        self,
        channel: LockstepChannel,
        test: int,
        rank: int,
        world_size: int,
        trace_path: str,
        mirror_dir: str,
        protected: ProtectedSockets,
        body_caller: str = "",
    ) -> None:
        """`body_caller`: the file whose frame calls the test body; a stopped wait's stack shows
        only the frames below it (the body's), as a test's traceback does."""
        self.channel = channel
        self.body_caller = body_caller
        self.test = test
        self.rank = rank
        self.trace_path = trace_path
        self.protected = protected
        mirrors = {peer: os.path.join(mirror_dir, f"peer-{peer}") for peer in range(world_size) if peer != rank}
        self._mirrors = mirrors
        # Empties this rank's trace (the runner truncates it again) and the mirrors of the last test.
        self._one_sided = OneSidedWatch({rank: trace_path, **mirrors})
        self._own = _Feed()
        self._own_offset = 0
        self._published = 0
        self._peers = {peer: _Feed() for peer in mirrors}
        self._peer_chunks = dict.fromkeys(mirrors, 0)
        self._finished: set[int] = set()
        self._stop = threading.Event()
        self._waiter = threading.get_ident()  # the thread that runs the body
        self._started = time.monotonic()
        self._stuck_since: tuple[int, float] | None = None
        self.stopped: WaitStopped | None = None
        self.failure = ""
        """Why the watcher gave up (a store error), for the harness's own diagnosis; empty if it did not."""
        self._thread = threading.Thread(target=self._loop, name=f"torchrun-watch-{test}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def finish(self, outcome: RankOutcome) -> RankOutcome | RankLoss:
        """Stop watching, publish the rest of this rank's trace and that it finished; this rank's
        result: `outcome`, or a `RankLoss` when its wait was stopped (by itself or a peer)."""
        self._stop.set()
        self._thread.join()
        try:
            self._publish()
            self.channel.mark_finished(self.test, self.rank)
            stopped = self.stopped or self._stopped_by_peer()
        except Exception as error:  # noqa: BLE001 - the store failing must not fail the test
            self.failure = f"torchrun watch: {type(error).__name__}: {error}"
            stopped = self.stopped
        return outcome if stopped is None else stopped.loss(self.rank, outcome)

    def forget(self) -> None:
        """Delete this rank's keys of the test (after the outcome exchange: every rank is done)."""
        self.channel.forget(self.test, self.rank, self._published)

    # -------------------------------------------------------------------------------- internals

    def _loop(self) -> None:
        try:
            while not self._stop.wait(POLL_S):
                self._publish()
                if self._judge():
                    return
        except Exception as error:  # noqa: BLE001 - a watcher that cannot read on leaves the timeout to end waits
            self.failure = f"torchrun watch: {type(error).__name__}: {error}"

    def _publish(self) -> None:
        """Send what this rank's trace file gained since the last look."""
        try:
            with open(self.trace_path, "rb") as handle:
                if os.fstat(handle.fileno()).st_size < self._own_offset:
                    return  # truncated under us: the runner began the test; nothing was published yet
                handle.seek(self._own_offset)
                data = handle.read()
        except FileNotFoundError:
            return
        if data:
            self._own_offset += len(data)
            self._own.take(data)
            self.channel.publish(self.test, self.rank, self._published, data)
            self._published += 1

    def _judge(self) -> bool:
        """Whether this rank's wait was found hopeless (and stopped)."""
        mine = self._own.stuck()
        if mine is None:
            self._stuck_since = None
            return False
        now = time.monotonic()
        if self._stuck_since is None or self._stuck_since[0] != mine.index:
            self._stuck_since = (mine.index, now)
        if now - self._stuck_since[1] < _JUDGE_AFTER_S:
            return False
        peers = [member for member in mine.group if member != self.rank and member in self._peers]
        for peer in peers:
            self._read_peer(peer)
        waiting = {self.rank} | {
            peer
            for peer in peers
            if peer not in self._finished and (record := self._peers[peer].stuck()) and record.group == mine.group
        }
        reason = self._one_sided.check(self._finished, waiting)
        if reason is None:
            return False
        self._stop_wait(mine, reason)
        return True

    def _read_peer(self, peer: int) -> None:
        if peer in self._finished:
            return
        # Finished first, chunks after: a finished rank published its whole trace before saying so.
        finished = self.channel.finished(self.test, peer)
        chunks = self.channel.chunks(self.test, peer, self._peer_chunks[peer])
        if chunks:
            self._peer_chunks[peer] += len(chunks)
            data = b"".join(chunks)
            with open(self._mirrors[peer], "ab") as handle:
                handle.write(data)
            self._peers[peer].take(data)
        if finished:
            self._finished.add(peer)

    def _stop_wait(self, record: CollectiveRecord, reason: str) -> None:
        stacks = self._waiter_stack()
        self.channel.announce_stop(self.test, record.group, reason)  # before the peers' waits fail
        if sockets.shut_down_connections(self.protected.keep):
            self.stopped = WaitStopped(reason, time.monotonic() - self._started, stacks)
        else:  # nothing to shut down here: the collective timeout ends the wait, as before
            self.channel.withdraw_stop(self.test)

    def _waiter_stack(self) -> str:
        """The body's thread's stack, from the test body down to the wait."""
        frame = sys._current_frames().get(self._waiter)
        if frame is None:
            return ""
        entries = traceback.extract_stack(frame)
        callers = [n for n, entry in enumerate(entries) if entry.filename == self.body_caller]
        return "".join(traceback.format_list(entries[callers[-1] + 1 :] if callers else entries))

    def _stopped_by_peer(self) -> WaitStopped | None:
        """A peer's stop, when this rank's own last collective, on the same group, never returned."""
        mine = self._own.stuck()
        if mine is None:
            return None
        reason = self.channel.stop_reason(self.test, mine.group)
        return None if reason is None else WaitStopped(reason, time.monotonic() - self._started)
