"""The vocabulary between the pytest parent and its ranks, and the one status type both use.

A warm worker and the parent talk over a pair of pipes with pickled instances of the message
classes here and nothing else (`WorkerConfig` -> `WorkerReady`, then `TestTask` -> `RankOutcome`
per test, or `SpmdCall` -> `RankOutcome` with its `value` per parent-side SPMD call, `Shutdown` at
the end). Under torchrun the ranks exchange `RankOutcome`s among
themselves instead. A rank that gives no outcome at all (died, hung, unreachable) is a
`RankLoss`, made by whoever noticed; `RankResult` is either. Every verdict, rank-side or
parent-side, is spelled with `Status`.
"""

from __future__ import annotations

import operator
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import ClassVar, Literal

from harness.trace.checksums import ReplicaSnapshot

DeviceKind = Literal["cpu", "cuda"]
"""The device a world's ranks run on; decided by the parent (`harness.config.devices`), sent in `WorkerConfig`."""


PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL
"""The protocol every message and SPMD argument is pickled with on its way to a rank."""


def encoded(value: object) -> bytes:
    """``value`` as the bytes a rank receives (``PICKLE_PROTOCOL``)."""
    return pickle.dumps(value, PICKLE_PROTOCOL)


def picklable(value: object) -> bool:
    """Whether ``value`` can travel to a rank: pickled as it will be (``PICKLE_PROTOCOL``)."""
    try:
        encoded(value)
    except Exception:  # noqa: BLE001 - any pickling failure has the same fix
        return False
    return True


def comm_backend(kind: str | None) -> str:
    """The process group backend for a device kind: NCCL on CUDA, gloo on CPU."""
    return "nccl" if kind == "cuda" else "gloo"


Status = Literal["passed", "failed", "skipped", "xfailed"]
"""The outcome of one test on one rank, of the whole test (the verdict), and of its report entries."""


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a fresh worker needs to join its world; sent once, first thing."""

    rank: int
    world_size: int
    local_rank: int
    device_kind: DeviceKind
    store_path: str
    """The FileStore the ranks rendezvous through (in the pool's private directory)."""
    collective_timeout_s: float
    run_dir: str
    sys_path: list[str]
    rank_fixture_modules: tuple[str, ...]
    label_providers: tuple[str, ...] = ()


@dataclass(frozen=True)
class WorkerReady:
    """A worker's answer to its config: the process group is up."""

    rank: int
    pid: int
    device: str


@dataclass(frozen=True)
class TestTask:
    """One distributed test to run on every rank of the pool."""

    nodeid: str
    module_name: str
    module_file: str
    qualname: str
    call_kwargs: dict[str, object]
    rank_fixture_names: tuple[str, ...]
    params: dict[str, object]
    seed: int
    options: dict[str, object]
    sys_path: list[str]
    check_replicas: bool = False
    """Digest what the test's models keep replicated after the body (the `check_replicas` marker or
    `--check-replicas`): the ranks' `RankOutcome.replicas`, compared by the parent's verdict."""
    known_failures: tuple[str, ...] = ()
    """Failure texts a plugin expects of this test (`pytest_harness_known_failures`): a check
    (`harness.check`) that fails with one of them is recorded and the test goes on past it."""
    reuse_groups: bool = True
    """Serve the test's `new_group` / `split_group` requests from the groups earlier tests on the
    rank created with the same request (`harness.rank.group_reuse`); False with `--fresh-groups`."""


@dataclass(frozen=True)
class SpmdCall:
    """One parent-side call of a module-level function on every rank of a warm pool
    (`harness.session.spmd.SpmdWorld.run`; run by `harness.rank.call_runner`).

    The function travels by name, never by value, so that its module is imported on the rank the
    way the parent imported it; its arguments travel pickled once by the parent (`arguments`),
    so that a rank that cannot unpickle them reports it as the call's failure instead of failing
    to read the message.
    """

    module_name: str
    qualname: str
    module_file: str | None
    """The module's file when pytest's assertion rewriting imported it (a test module, a conftest):
    the rank imports it the same way (`harness.rank.runner.import_test_module`); None for a
    module the rank imports by name."""
    arguments: bytes
    """`pickle.dumps((args, kwargs))`."""
    seed: int
    trace: bool
    """Record the call's collectives into the rank's trace file, as for a test."""
    isolate: bool
    """Bracket the call as a test is bracketed (`harness.rank.isolation`); False: the light path."""
    context: bytes
    """`pickle.dumps((options, sys_path))`: the forwarded pytest options (`RankContext.options`) and
    the session's sys.path. The same bytes call after call, so a rank unpickles them only when
    they change (a few kilobytes: most of a call's message, and of a rank's cost to read it)."""


@dataclass
class RankOutcome:
    """What one rank reports after running a task.

    `sync_state` is (default-group collective sequence number, process groups created so far,
    digest of the groups kept for later tests): when every rank reports the same values, no
    collective is left half-issued and every rank keeps the same groups (see
    `harness.session.verdict.world_reusable` and `harness.rank.group_reuse`).
    """

    rank: int
    status: Status
    duration_s: float
    summary: str = ""
    traceback: str = ""
    sync_state: tuple[int, ...] = (0, 0, 0)
    injected_faults: list[str] = field(default_factory=list)
    replace_reason: str = ""
    """Why this rank must not run another test (it could not put its state back, e.g. the test
    destroyed the default process group); empty when it may."""
    failed_at: float | None = None
    """When the test raised on this rank (`time.time()` as the exception was caught), on the
    session's reference clock (see `clock_error_s`); None when it did not fail, or when its time
    cannot be compared with its peers' (torchrun ranks whose clock offsets were not measured)."""
    clock_error_s: float = 0.0
    """How far `failed_at` may be from the reference clock: 0 where all ranks share one clock
    (a pool: one host), the uncertainty of the measured offset under torchrun. The verdict trusts
    only time differences larger than it (`harness.session.verdict.first_failure`)."""
    value: bytes | None = None
    """For an `SpmdCall` that returned on this rank: its return value, pickled by the rank (the
    parent unpickles it); None for a test, and for a call that failed."""
    replicas: ReplicaSnapshot | None = None
    """For a test run with `TestTask.check_replicas`: this rank's digests of the tensors its models
    keep replicated, taken locally after the body (`harness.rank.replicas`; no collective, so a
    failed rank leaves no peer waiting); None when the check was off or could not run."""

    def __reduce__(self) -> tuple[type[RankOutcome], tuple[object, ...]]:
        # Pickled as its constructor's arguments, without the field names: a fifth of the
        # default's cost to unpickle, which the parent pays for every rank of every test and call.
        return RankOutcome, _outcome_fields(self)


_outcome_fields = operator.attrgetter(*(item.name for item in fields(RankOutcome)))


@dataclass
class RankLoss:
    """A rank that gave no outcome: it died, hung and was killed, or could not be reached."""

    rank: int
    cause: str
    """Completes "rank <r> ...", e.g. "was killed by SIGKILL (9)"."""
    stacks: str = ""
    """The rank's Python stacks when it hung (faulthandler), else empty."""
    raised: str = ""
    """The exception the test raised on this rank before it was lost (e.g. a Python error followed
    by gloo's SIGABRT during teardown): `Type: message` on the first line, then the traceback;
    else empty."""
    duration_s: float = 0.0
    """How long the rank ran the test until it was found lost (its death seen, or the parent gave
    up on it: hung, interrupted), as the parent measured it from sending the task; 0.0 when it
    never got the task."""
    after_peer_failed: bool = False
    """The parent stopped this rank because of another rank: it still ran a straggler grace after a
    peer failed, or the traces showed it waited for a peer that will never come. Its loss is a
    consequence, so the verdict can tell which rank failed first (`first_failed_rank`)."""
    failed_at: float | None = field(default_factory=time.time)
    """When whoever made this loss noticed it (`time.time()`, by default when it was made), on the
    session's reference clock: the rank was lost by then at the latest (a rank stopped because of a
    peer was lost exactly then). None when the time cannot be compared with the ranks' clocks."""
    clock_error_s: float = 0.0
    """How far `failed_at` may be from the reference clock (see `RankOutcome.clock_error_s`)."""

    status: ClassVar[Status] = "failed"

    @property
    def summary(self) -> str:
        if self.raised:
            return f"rank {self.rank} {self.cause}, after raising {self.raised_summary}"
        return f"rank {self.rank} {self.cause}"

    @property
    def raised_summary(self) -> str:
        return self.raised.partition("\n")[0]

    def account(self, stderr: str = "", frames: Callable[[str], str] = str, last_lines: int | None = None) -> str:
        """How this rank was lost, the one text every report gives of it: the summary, what it
        raised before, its Python stacks, its stderr (the last `last_lines` lines when given).

        `frames` filters the traceback and the stacks (the verdict shown in the terminal leaves
        the harness's own frames out; the per-rank files keep them whole).
        """
        lines = [self.summary]
        if self.raised:
            lines += [f"--- rank {self.rank} raised, before it was lost ---"]
            lines += [frames(self.raised.partition("\n")[2].rstrip()) or self.raised_summary]
        if self.stacks:
            lines += [f"--- rank {self.rank} Python stacks ---", frames(self.stacks.rstrip())]
        if stderr.strip():
            shown = "\n".join(stderr.rstrip().splitlines()[-last_lines:]) if last_lines else stderr
            lines += [f"--- rank {self.rank} stderr{' (last lines)' if last_lines else ''} ---", shown]
        return "\n".join(lines)


RankResult = RankOutcome | RankLoss
"""Either way, `.rank`, `.status`, `.summary` and `.duration_s` are there."""


@dataclass(frozen=True)
class Shutdown:
    """Ask a worker to leave its process group and exit."""
