"""torchrun / multi-node mode: this pytest process is one rank, and every rank runs the same
selection in lockstep.

torchrun (or SLURM + torchrun) launches the world; we do not build a launcher. Each rank's
pytest collects the same tests, runs each distributed body itself, then all ranks exchange
their outcomes and traces over a separate gloo group, so every rank reaches the same verdict:
a failure on one rank fails that test everywhere instead of leaving the others hanging.
Each rank writes its own `rank-<r>.xml`.

A rank waiting in a collective its peers will never issue learns so while it waits, through
the store, and ends that wait in seconds (`harness.session.torchrun_watch`), as a pool's parent
stops such a rank; the world is then unusable, as after a collective timeout.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import shutil
import tempfile
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from harness.config.rank_modules import RankModules
from harness.config.torchrun import TorchrunWorld
from harness.messages import RankLoss, RankResult, TestTask
from harness.process.rank_env import loopback_interface
from harness.rank.runner import TestRunner
from harness.rank.world import join_world, rank_device
from harness.session.flow import Execution, HarnessSession, WorldUnusable
from harness.session.torchrun_clock import measure_offset
from harness.session.torchrun_watch import ProtectedSockets, TorchrunWatch, open_channel
from harness.trace.records import CollectiveRecord, last_unfinished, read_trace_or_empty


class TorchrunSession(HarnessSession):
    def __init__(
        self, config: pytest.Config, rank_modules: RankModules, reports_dir: str, torchrun: TorchrunWorld
    ) -> None:
        super().__init__(config, rank_modules, reports_dir)
        self.rank = torchrun.rank
        self.world_size = torchrun.world_size
        if torchrun.on_one_host:
            # The whole world is on this host: gloo needs no network but loopback, and must not
            # depend on how the host name resolves (see harness.process.rank_env). Set before any group.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
        # GPUs are counted on this node (LOCAL_WORLD_SIZE): `plan` is the session's one device decision.
        self.torchrun = torchrun
        self.device_plan = self.plan(self.world_size)
        if self.device_plan.kind is None:
            raise pytest.UsageError(f"--device cuda under torchrun: this node {self.device_plan.skip_reason}")
        device = rank_device(self.device_plan.kind, torchrun.local_rank)
        # The connections a stopped wait may break are the test's: note the session's own.
        self.protected = ProtectedSockets(_store_port())
        self.protected.before_join()
        join_world(device, self.options.collective_timeout, init_method="env://")
        self.protected.after_join()
        # Outcomes travel on their own gloo group: the default one may be wedged by the test. A
        # rank stuck in a collective reaches the exchange up to one collective timeout after its
        # peers (plus the straggler grace), so the exchange waits longer than that.
        exchange_s = 2 * self.options.collective_timeout + self.options.straggler_grace
        self.control = dist.new_group(backend="gloo", timeout=timedelta(seconds=exchange_s))
        # A first exchange opens the control group's connections now, while they can be noted.
        self.channel, self.no_watch_reason = open_channel(self.control, self.rank, exchange_s)
        # Failure times compare across hosts only on one clock: rank 0's, offset measured now.
        self.clock = measure_offset(self.control, self.rank, self.world_size)
        self.protected.ready()
        self.tests_run = 0
        self.trace_dir = tempfile.mkdtemp(prefix="fsdp-harness-torchrun-")
        self.trace_path = os.path.join(self.trace_dir, "trace")
        self.runner = TestRunner(
            self.rank,
            self.world_size,
            torchrun.local_rank,
            device,
            rank_modules.fixtures,
            self.label_providers,
            self.trace_path,
        )
        self.unusable_since: str | None = None

    def own_ranks(self, world_size: int) -> range:
        return range(self.rank, self.rank + 1)

    def kill_all(self) -> None:
        shutil.rmtree(self.trace_dir, ignore_errors=True)

    def summary(self) -> str:
        text = f"{self.dispatched} distributed tests in lockstep as rank {self.rank} of {self.world_size}"
        if self.no_watch_reason:
            text += f" (one-sided waits ended only at the collective timeout: {self.no_watch_reason})"
        if self.clock.offset_s is None:
            text += f" (the first failed rank told by message only: {self.clock.why_unknown})"
        return text

    def collected(self, nodeids: list[str]) -> None:
        """Ranks that collected different tests would pair the wrong bodies: refuse to start."""
        digest = hashlib.sha256("\n".join(nodeids).encode()).hexdigest()
        digests: list[str | None] = [None] * self.world_size
        dist.all_gather_object(digests, digest, group=self.control)
        if len(set(digests)) != 1:
            raise pytest.UsageError(
                "ranks collected different tests ("
                + ", ".join(f"rank {r}: {d[:8]}" for r, d in enumerate(digests) if d)
                + "); run the same pytest command and the same checkout on every node"
            )

    def execute(self, item: pytest.Function, world_size: int, device_kind: str, task: TestTask) -> Execution:
        if self.unusable_since is not None:
            raise WorldUnusable(
                f"the torchrun world is unusable since {self.unusable_since}; relaunch to run the remaining tests"
            )
        started = time.monotonic()
        self.tests_run += 1  # the same count on every rank: all run the same selection
        watch = self._watch(item)
        if watch is not None:
            watch.start()
        ran = self.runner.run(task)
        outcome: RankResult = ran if watch is None else watch.finish(ran)
        if watch is not None and watch.failure:  # the store failed it: later waits end at the timeout
            self.channel, self.no_watch_reason = None, watch.failure
        records = read_trace_or_empty(self.trace_path)
        try:
            return self._exchange(item, outcome, records, started)
        finally:
            if watch is not None:
                watch.forget()

    def _watch(self, item: pytest.Function) -> TorchrunWatch | None:
        """This test's watch for one-sided waits, None where pool mode has none either (a test
        that diverges on purpose may wait on purpose), the session has no store to share it, or
        the world is on CUDA (a stop shuts connections down, and NCCL's own must not be)."""
        if self.channel is None or item.get_closest_marker("expect_divergence") is not None:
            return None
        if self.device_plan.kind == "cuda":
            return None
        return TorchrunWatch(
            self.channel,
            self.tests_run,
            self.rank,
            self.world_size,
            self.trace_path,
            self.trace_dir,
            self.protected,
            body_caller=inspect.getfile(TestRunner),
        )

    def _exchange(
        self, item: pytest.Function, outcome: RankResult, records: list[CollectiveRecord], started: float
    ) -> Execution:
        gathered: list[tuple[RankResult, list[CollectiveRecord]] | None] = [None] * self.world_size
        outcome = self.clock.on_reference_clock(outcome)
        try:
            dist.all_gather_object(gathered, (outcome, records), group=self.control)
        except RuntimeError as error:
            self.unusable_since = f"{item.nodeid} did not reach the end on every rank"
            lost = f"did not reach the end of the test within --collective-timeout ({error})"
            # What this process knows of a peer's duration: the test ran here until the exchange gave up.
            elapsed = time.monotonic() - started
            # Noticed here, now: on this rank's clock, shifted onto rank 0's as this rank's own time is.
            results: dict[int, RankResult] = {
                r: self.clock.on_reference_clock(RankLoss(r, lost, duration_s=elapsed)) for r in range(self.world_size)
            }
            results[self.rank] = outcome
            return Execution(results, {}, {self.rank: records})
        results = {rank: entry[0] for rank, entry in enumerate(gathered) if entry is not None}
        traces = {rank: entry[1] for rank, entry in enumerate(gathered) if entry is not None}
        # A collective left unfinished on any rank has wedged the default group for good (the
        # pool would restart here; a torchrun world cannot): later tests fail fast instead.
        if last_unfinished(traces):
            self.unusable_since = f"{item.nodeid} left a collective unfinished"
        replace = [f"rank {r}: {o.replace_reason}" for r, o in results.items() if getattr(o, "replace_reason", "")]
        if replace and self.unusable_since is None:
            self.unusable_since = f"{item.nodeid} ({'; '.join(replace)})"
        return Execution(results, {}, traces)


def _store_port() -> int | None:
    """The port of the store behind MASTER_ADDR:MASTER_PORT (env:// rendezvous), None if unset."""
    text = os.environ.get("MASTER_PORT", "")
    return int(text) if text.strip().isdigit() else None
