"""The files of a traced torchrun run (``harness.tools.trace_script``) and the processes behind them:
a run's files in DIR (who started, how each rank ended, who reports), DIR's lock, and whether a
rank's process is still running on this host.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

# A rank's state in this run, as the other ranks see it from DIR.
ENDED, DEAD, ALIVE, ELSEWHERE, NOT_STARTED = "ended", "dead", "alive", "elsewhere", "not started"


PF_EXITING = 0x4
"""A task's flag (/proc/<pid>/stat) from the moment it starts to exit: set before its sockets close."""


def proc_stat(pid: int) -> tuple[str, int, int, str, int] | None:
    """(state, parent, process group, start time in clock ticks, flags) of a process, None when there
    is none."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            fields = handle.read().rpartition(")")[2].split()
        return fields[0], int(fields[1]), int(fields[2]), fields[19], int(fields[6])
    except (OSError, IndexError, ValueError):
        return None


def is_running(pid: int, start: str) -> bool:
    """Whether the process `pid` that started at `start` still runs: not a zombie, not exiting (a
    rank gloo aborted is still listed while it exits, and its peers' calls fail before it is gone),
    no SIGKILL pending."""
    stat = proc_stat(pid)
    if stat is None or stat[0] in ("Z", "X") or stat[3] != start or stat[4] & PF_EXITING:
        return False
    kill_bit = 1 << (signal.SIGKILL - 1)
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("SigPnd", "ShdPnd") and int(value, 16) & kill_bit:
                return False
    return True


def rank_of(path: Path) -> int:
    """The rank in a file name `rank-<r>.<suffix>`."""
    number = path.name.removeprefix("rank-").partition(".")[0]
    return int(number) if number.isdigit() else -1


def this_host() -> str:
    """Where pids mean the same processes: host name, boot, pid namespace."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError):
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    with contextlib.suppress(OSError):
        parts.append(os.readlink("/proc/self/ns/pid"))
    return " ".join(parts)


def own_processes(pid: int) -> set[int]:
    """The processes a rank started: its descendants, and its process group's members when it leads
    one (torchrun starts each rank in a session of its own)."""
    parents: dict[int, int] = {}
    group: set[int] = set()
    leads = os.getpgrp() == pid
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (stat := proc_stat(int(entry))) is not None:
                parents[int(entry)] = stat[1]
                if leads and stat[2] == pid:
                    group.add(int(entry))
    found, frontier = set(), [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, its_parent in parents.items() if its_parent == parent and child not in found]
        found.update(children)
        frontier.extend(children)
    return (found | group) - {pid}


def run_identity() -> str:
    """What every rank of this torchrun run sees alike, and the next run does not."""
    env = os.environ
    restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    if "TORCHELASTIC_RUN_ID" in env and env.get("LOCAL_WORLD_SIZE") == env.get("WORLD_SIZE"):
        agent = os.getppid()  # one host: torchrun's agent started every rank
        stat = proc_stat(agent)
        return f"agent {this_host()} {agent} {stat[3] if stat else ''} {restart}"
    address, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and address and port:
        import torch.distributed as dist

        try:  # several hosts: the first rank to ask draws the key in torchrun's store
            store = dist.TCPStore(address, int(port), is_master=False, timeout=timedelta(seconds=10))
            key = f"harness.tools.trace_script/run/{restart}"
            return "store " + store.compare_set(key, "", os.urandom(8).hex()).decode()
        except (RuntimeError, ValueError, OSError):
            pass
    keys = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")
    return "env " + " ".join([*(env.get(key, "") for key in keys), restart])


@dataclass(frozen=True)
class End:
    """How the script ended on a rank, kept in `rank-<r>.end` as data."""

    kind: str
    """returned, exited, raised, os._exit, signal, stopped"""
    code: int
    """the rank's exit status"""
    detail: str = ""
    """the exception, the signal's name, the stop's reason"""
    checks: tuple[str, ...] = ()
    """what `end_of_run_checks` said"""

    def describe(self) -> str:
        if self.kind == "returned":
            return "returned"
        if self.kind == "exited":
            return f"exited with status {self.code}"
        if self.kind == "raised":
            return f"raised {self.detail}"
        if self.kind == "os._exit":
            return f"called os._exit({self.code})"
        if self.kind == "signal":
            return f"was ended by {self.detail}"
        return f"was stopped ({self.detail})"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "code": self.code, "detail": self.detail, "checks": list(self.checks)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> End:
        return cls(str(data["kind"]), int(data["code"]), str(data.get("detail", "")), tuple(data.get("checks", ())))


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Whole or not at all: a reader never sees half a file."""
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    scratch.write_text(json.dumps(data), encoding="utf-8")
    os.replace(scratch, path)


def latest_run(directory: Path) -> str | None:
    """The run of the newest pid file in `directory`."""
    newest: tuple[float, str] | None = None
    for path in directory.glob("rank-*.pid"):
        data = read_json(path)
        with contextlib.suppress(OSError):
            if data is not None and (newest is None or path.stat().st_mtime > newest[0]):
                newest = (path.stat().st_mtime, str(data.get("run", "")))
    return newest[1] if newest else None


class RunFiles:
    """One run's files in DIR: who started, who ended, who reports."""

    def __init__(self, directory: Path, run: str) -> None:
        self.directory, self.run = directory, run

    def trace(self, rank: int) -> Path:
        return self.directory / f"rank-{rank}.jsonl"

    def pid_file(self, rank: int) -> Path:
        return self.directory / f"rank-{rank}.pid"

    def end_file(self, rank: int) -> Path:
        return self.directory / f"rank-{rank}.end"

    @property
    def claim_file(self) -> Path:
        return self.directory / f"report-{self.run}.claim"

    @property
    def stop_file(self) -> Path:
        return self.directory / f"stop-{self.run}"

    def started(self, rank: int) -> dict[str, Any] | None:
        data = read_json(self.pid_file(rank))
        return data if data is not None and data.get("run") == self.run else None

    def started_ranks(self) -> list[int]:
        ranks = (rank_of(path) for path in self.directory.glob("rank-*.pid"))
        return sorted(rank for rank in ranks if rank >= 0 and self.started(rank) is not None)

    def end(self, rank: int) -> End | None:
        data = read_json(self.end_file(rank))
        if data is None or data.get("run") != self.run:
            return None
        with contextlib.suppress(KeyError, TypeError, ValueError):
            return End.from_json(data)
        return None

    def write_end(self, rank: int, end: End) -> None:
        write_json(self.end_file(rank), {"run": self.run, **end.to_json()})

    def state(self, rank: int, host: str) -> str:
        if self.end(rank) is not None:
            return ENDED
        started = self.started(rank)
        if started is None:
            return NOT_STARTED
        if started.get("host") != host:
            return ELSEWHERE
        return ALIVE if is_running(int(started["pid"]), str(started["start"])) else DEAD

    def states(self, world_size: int, host: str) -> dict[int, str]:
        return {rank: self.state(rank, host) for rank in range(world_size)}

    def claim(self, rank: int) -> bool:
        """Whether this rank is the one that reports this run (the first to ask, across ranks)."""
        try:
            fd = os.open(self.claim_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps({"rank": rank, "pid": os.getpid()}))
        return True

    def claimed(self) -> bool:
        return self.claim_file.exists()

    def describe(self, world_size: int, host: str) -> list[str]:
        """Each rank's end, as the report says it."""
        said = []
        for rank, state in self.states(world_size, host).items():
            end = self.end(rank)
            if end is not None:
                said.append(f"rank {rank} {end.describe()}")
            elif state == DEAD:
                said.append(f"rank {rank} died (killed by a signal, or aborted: gloo aborts on a size mismatch)")
            elif state == ALIVE:
                said.append(f"rank {rank} was still running")
            elif state == ELSEWHERE:
                said.append(f"rank {rank} (on another host) had not ended")
            else:
                said.append(f"rank {rank} never started under harness.tools.trace_script")
        return said

    def check_lines(self, world_size: int) -> list[str]:
        """What the ranks' end-of-run checks said, a line once for the ranks that said it."""
        said: dict[str, list[int]] = {}
        for rank in range(world_size):
            for line in end.checks if (end := self.end(rank)) else ():
                said.setdefault(line, []).append(rank)
        return [
            f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}: {line}"
            for line, ranks in said.items()
        ]

    def forget(self, ranks: list[int]) -> None:
        """Remove this run's own files (its traces stay: the next run's ranks overwrite them)."""
        for rank in ranks:
            for path in (self.pid_file(rank), self.end_file(rank)):
                data = read_json(path)
                if data is not None and data.get("run") == self.run:
                    path.unlink(missing_ok=True)
        self.claim_file.unlink(missing_ok=True)
        self.stop_file.unlink(missing_ok=True)


@contextlib.contextmanager
def locked(directory: Path):
    """DIR's lock while a rank starts (a rank of the next run must not truncate a trace the first one
    still reads); given up after 10 s (a file system without locks)."""
    import fcntl

    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            except OSError:
                break
        yield
    finally:
        os.close(fd)
