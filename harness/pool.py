"""A warm pool of N rank processes: spawn, dispatch one test, wait with deadlines, kill cleanly.

The pool owns process lifetimes and nothing else: it knows nothing about pytest. Each rank runs
`python -m harness.worker` in its own session, so killing its process group removes everything
the rank started. The ranks rendezvous through a FileStore in the pool's private directory and
start with torchrun's environment (`harness.rank_env`), whose MASTER_PORT is a TCPStore the
parent hosts on an OS-assigned loopback port, so concurrent sessions on one machine never collide.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

from harness.devices import DeviceKind, GpuReservation
from harness.messages import RankLoss, RankResult, Shutdown, TestTask, WorkerConfig, WorkerReady
from harness.paths import RankFiles
from harness.rank_env import AgentStore, rank_environment

SESSION_ENV = "FSDP_HARNESS_SESSION"
_HARNESS_ROOT = str(Path(__file__).resolve().parent.parent)


@dataclass(frozen=True)
class PoolKey:
    world_size: int
    device_kind: DeviceKind
    collective_timeout_s: float


class PoolStartError(RuntimeError):
    pass


def tail(path: str, limit: int = 4000) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - limit))
            text = handle.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return ("...\n" if size > limit else "") + text


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "closed its pipe to the parent but kept running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} ({-returncode})"
    return f"exited with code {returncode} while running the test"


class _RankProcess:
    def __init__(
        self, rank: int, popen: subprocess.Popen[bytes], to_rank: Connection, from_rank: Connection, files: RankFiles
    ) -> None:
        self.rank = rank
        self.popen = popen
        self.to_rank = to_rank
        self.from_rank = from_rank
        self.files = files

    def exit_code(self, timeout_s: float = 5.0) -> int | None:
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        # The rank leads its own session and process group (start_new_session), so one killpg
        # also ends whatever the test started in it; wait() reaps the rank so no zombie stays.
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.popen.wait()
        self.to_rank.close()
        self.from_rank.close()


class WorkerPool:
    """N warm ranks of one (world size, device, timeout) kind."""

    def __init__(
        self,
        key: PoolKey,
        run_dir: str,
        rank_fixture_modules: tuple[str, ...],
        session_tag: str,
        label_providers: tuple[str, ...] = (),
    ) -> None:
        self.key = key
        self.run_dir = run_dir
        self._rank_fixture_modules = rank_fixture_modules
        self._label_providers = label_providers
        self._session_tag = session_tag
        self._ranks: list[_RankProcess] = []
        self._agent_store: AgentStore | None = None
        self._gpus: GpuReservation | None = None

    def rank_files(self, rank: int) -> RankFiles:
        return RankFiles(self.run_dir, rank)

    def start(self, timeout_s: float = 300.0) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        if self.key.device_kind == "cuda":
            try:
                self._gpus = GpuReservation(self.key.world_size)
            except RuntimeError as error:
                raise PoolStartError(str(error)) from None
        self._agent_store = AgentStore()
        try:
            for rank in range(self.key.world_size):
                self._ranks.append(self._spawn(rank))
            self._await_ready(timeout_s)
        except BaseException:
            self.kill()
            raise

    def _spawn(self, rank: int) -> _RankProcess:
        files = RankFiles(self.run_dir, rank)
        parent_to_child = os.pipe()
        child_to_parent = os.pipe()
        assert self._agent_store is not None
        env = rank_environment(
            os.environ,
            rank=rank,
            world_size=self.key.world_size,
            master_port=self._agent_store.port,
            cuda_devices=self._gpus.names if self._gpus is not None else None,
        )
        env[SESSION_ENV] = self._session_tag
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: N ranks must not oversubscribe the cores
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_HARNESS_ROOT, env.get("PYTHONPATH", "")) if p)
        with open(files.stdout, "wb") as out, open(files.stderr, "wb") as err:
            popen = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "harness.worker",
                    str(parent_to_child[0]),
                    str(child_to_parent[1]),
                    str(os.getpid()),
                ],
                pass_fds=(parent_to_child[0], child_to_parent[1]),
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=env,
            )
        # Close our copies of the rank's ends at once: the rank must be the only holder of the
        # result pipe's write end, or its death would not show as EOF (see `run`).
        os.close(parent_to_child[0])
        os.close(child_to_parent[1])
        proc = _RankProcess(
            rank,
            popen,
            Connection(parent_to_child[1], readable=False),
            Connection(child_to_parent[0], writable=False),
            files,
        )
        proc.to_rank.send(
            WorkerConfig(
                rank=rank,
                world_size=self.key.world_size,
                local_rank=rank,
                device_kind=self.key.device_kind,
                store_path=os.path.join(self.run_dir, "store"),
                collective_timeout_s=self.key.collective_timeout_s,
                run_dir=self.run_dir,
                sys_path=list(sys.path),
                rank_fixture_modules=self._rank_fixture_modules,
                label_providers=self._label_providers,
            )
        )
        return proc

    def _await_ready(self, timeout_s: float) -> None:
        waiting = {proc.from_rank: proc for proc in self._ranks}
        deadline = time.monotonic() + timeout_s
        while waiting:
            ready = wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                ranks = sorted(proc.rank for proc in waiting.values())
                raise PoolStartError(f"ranks {ranks} did not join the world within {timeout_s:.0f} s")
            for conn in ready:
                proc = waiting.pop(conn)
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    raise PoolStartError(
                        f"rank {proc.rank} {describe_exit(proc.exit_code())} during start-up:\n"
                        f"{tail(proc.files.stderr)}"
                    ) from None
                assert isinstance(message, WorkerReady), message

    def run(self, task: TestTask, deadline_s: float, straggler_grace_s: float) -> dict[int, RankResult]:
        """Run `task` on every rank; ranks that neither answer nor die in time are reported hung.

        Once a rank has failed, the others get only `straggler_grace_s` more: a failed rank
        usually leaves its peers blocked in a collective, and waiting for the collective
        timeout would only delay the report.
        """
        # How a rank's death is noticed: the parent waits on the ranks' result pipes, and the
        # write end of a rank's pipe is held only by that rank, so its death shows as EOF at
        # once (then `exit_code` says how it died). A grandchild that inherited the fd (a test
        # that forked) keeps the pipe open after the rank died: then only the deadline or the
        # straggler grace ends the wait, and the rank is reported hung.
        results: dict[int, RankResult] = {}
        pending: dict[Connection, _RankProcess] = {}
        for proc in self._ranks:
            try:
                proc.to_rank.send(task)
                pending[proc.from_rank] = proc
            except OSError:
                results[proc.rank] = RankLoss(proc.rank, describe_exit(proc.exit_code()))
        started = time.monotonic()
        deadline = started + deadline_s
        failed_at: float | None = time.monotonic() if results else None
        while pending:
            limit = deadline if failed_at is None else min(deadline, failed_at + straggler_grace_s)
            ready = wait(list(pending), timeout=max(0.0, limit - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                proc = pending.pop(conn)
                try:
                    result: RankResult = conn.recv()
                except (EOFError, OSError):
                    result = RankLoss(proc.rank, describe_exit(proc.exit_code()))
                results[proc.rank] = result
                if failed_at is None and (isinstance(result, RankLoss) or result.status == "failed"):
                    failed_at = time.monotonic()
        if pending:
            stacks = self._dump_stacks(list(pending.values()))
            waited = time.monotonic() - started
            for proc in pending.values():
                if failed_at is not None and failed_at + straggler_grace_s < deadline:
                    cause = (
                        f"hung: still running {waited:.1f} s into the test, "
                        f"{straggler_grace_s:.0f} s after another rank failed"
                    )
                else:
                    cause = f"hung: no result within the {deadline_s:.0f} s test deadline"
                results[proc.rank] = RankLoss(proc.rank, cause, stacks.get(proc.rank, ""))
        return dict(sorted(results.items()))

    def _dump_stacks(self, procs: list[_RankProcess], wait_s: float = 2.0) -> dict[int, str]:
        """Ask hung ranks for their Python stacks (faulthandler on SIGUSR1) before they are killed."""
        for proc in procs:
            # Empty the file first: the rank holds it in append mode, so its dump starts at
            # offset 0 and a non-zero size below means this dump has begun.
            open(proc.files.stacks, "w").close()
            try:
                os.kill(proc.popen.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        stacks: dict[int, str] = {}
        for proc in procs:
            while time.monotonic() < deadline and os.path.getsize(proc.files.stacks) == 0:
                time.sleep(0.02)
            time.sleep(0.05)  # let faulthandler finish writing every thread
            stacks[proc.rank] = tail(proc.files.stacks, 20000) or "(no stack: the rank did not answer SIGUSR1)"
        return stacks

    def close(self, timeout_s: float = 5.0) -> None:
        """Polite shutdown (ranks leave their process group), then kill whatever remains."""
        for proc in self._ranks:
            try:
                proc.to_rank.send(Shutdown())
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for proc in self._ranks:
            try:
                proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        for proc in self._ranks:
            proc.kill()
        self._ranks.clear()
        if self._agent_store is not None:
            self._agent_store.close()
            self._agent_store = None
        if self._gpus is not None:
            self._gpus.release()
            self._gpus = None
