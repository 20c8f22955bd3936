"""Rank worker: joins the world once, then runs the test bodies the parent sends until told to stop.

Started by the pool as `python -m harness.worker FD_IN FD_OUT` in its own session (so the pool
can kill it with everything it started). Its stdout/stderr go to per-rank files the parent reads
after each test, so output survives even a rank that dies.
"""
from __future__ import annotations

import ast
import ctypes
import faulthandler
import importlib
import importlib.util
import os
import signal
import sys
import time
import traceback
from contextlib import ExitStack
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from harness import fixtures
from harness.devices import rank_device
from harness.isolation import TestIsolation
from harness.messages import RankOutcome, Shutdown, TestTask, WorkerConfig, WorkerReady
from harness.paths import RankFiles

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """Linux kills us when the parent dies, so a crashed pytest never leaves ranks behind."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: the pool's atexit kill is the remaining guard
    if os.getppid() != parent_pid:
        os._exit(1)


class _OutputCapture:
    """Points fds 1 and 2 at the rank's files; C-level output (gloo, NCCL) is captured too."""

    def __init__(self, files: RankFiles) -> None:
        for fd, path in ((1, files.stdout), (2, files.stderr)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
            os.dup2(target, fd)
            os.close(target)

    @staticmethod
    def flush() -> None:
        sys.stdout.flush()
        sys.stderr.flush()

    def reset(self) -> None:
        self.flush()
        os.ftruncate(1, 0)
        os.ftruncate(2, 0)


def _import_test_module(name: str, file: str) -> ModuleType:
    """Import a test module with pytest's assertion rewriting, as the parent did."""
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__file__", None) == file:
        return module
    package = name.rpartition(".")[0]
    if package:
        importlib.import_module(package)
    source = Path(file).read_bytes()
    tree = ast.parse(source, filename=file)
    try:
        from _pytest.assertion.rewrite import rewrite_asserts

        rewrite_asserts(tree, source, file)
    except ImportError:
        pass  # plain asserts still fail, only with less detail
    code = compile(tree, file, "exec", dont_inherit=True)
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None, f"cannot build an import spec for {file}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _resolve_callable(task: TestTask) -> Callable[..., Any]:
    obj: Any = _import_test_module(task.module_name, task.module_file)
    for part in task.qualname.split("."):
        obj = getattr(obj, part)
        if isinstance(obj, type):
            obj = obj()  # a test class: methods run on a fresh instance, as in pytest
    return obj


def _format_failure(error: BaseException) -> str:
    """Traceback without the worker's own frames: the user's code is what matters."""
    frames = traceback.extract_tb(error.__traceback__)
    keep = [i for i, frame in enumerate(frames) if frame.filename != __file__]
    tb = error.__traceback__
    for _ in range(keep[0] if keep else 0):
        tb = tb.tb_next if tb is not None else None
    return "".join(traceback.format_exception(type(error), error, tb))


class RankWorker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.files = RankFiles(config.run_dir, config.rank)
        self.capture = _OutputCapture(self.files)
        faulthandler.enable(file=sys.stderr, all_threads=True)
        self._stack_file = open(self.files.stacks, "a")  # noqa: SIM115 - lives as long as the process
        faulthandler.register(signal.SIGUSR1, file=self._stack_file, all_threads=True)
        self.device = rank_device(config.device_kind, config.local_rank)
        self._join_world()
        self.isolation = TestIsolation()

    def _join_world(self) -> None:
        cfg = self.config
        store = dist.TCPStore(cfg.store_host, cfg.store_port, is_master=False, timeout=timedelta(seconds=120))
        kwargs: dict[str, Any] = {}
        if cfg.device_kind == "cuda":
            torch.cuda.set_device(self.device)
            kwargs["device_id"] = self.device
        dist.init_process_group(
            "nccl" if cfg.device_kind == "cuda" else "gloo",
            store=store,
            rank=cfg.rank,
            world_size=cfg.world_size,
            timeout=timedelta(seconds=cfg.collective_timeout_s),
            **kwargs,
        )

    def run(self, task: TestTask) -> RankOutcome:
        if sys.path != task.sys_path:
            sys.path[:] = task.sys_path
        self.capture.reset()
        started = time.perf_counter()
        status, summary, failure = "passed", "", ""
        self.isolation.enter(task.seed)
        try:
            with ExitStack() as teardown:
                for module in self.config.rank_fixture_modules:
                    importlib.import_module(module)
                test = _resolve_callable(task)
                ctx = fixtures.RankContext(
                    rank=self.config.rank,
                    world_size=self.config.world_size,
                    local_rank=self.config.local_rank,
                    device=self.device,
                    params=task.params,
                    options=task.options,
                )
                kwargs = dict(task.call_kwargs)
                kwargs.update(fixtures.resolve(task.rank_fixture_names, ctx, teardown))
                test(**kwargs)
        except pytest.skip.Exception as skip:
            status, summary = "skipped", skip.msg
        except pytest.xfail.Exception as xfail:
            status, summary = "xfailed", xfail.msg
        except BaseException as error:  # noqa: BLE001 - SystemExit and friends fail the test, not the rank
            status = "failed"
            first_line = (str(error).strip().splitlines() or [""])[0]
            summary = f"{type(error).__name__}: {first_line}" if first_line else type(error).__name__
            failure = _format_failure(error)
        sync_state = self.isolation.exit()
        self.capture.flush()
        return RankOutcome(
            rank=self.config.rank,
            status=status,  # type: ignore[arg-type]
            duration_s=time.perf_counter() - started,
            summary=summary,
            traceback=failure,
            sync_state=sync_state,
        )


def main() -> None:
    tasks = Connection(int(sys.argv[1]), writable=False)
    results = Connection(int(sys.argv[2]), readable=False)
    _die_with_parent(int(sys.argv[3]))
    config: WorkerConfig = tasks.recv()
    sys.path[:] = config.sys_path
    worker = RankWorker(config)
    results.send(WorkerReady(rank=config.rank, pid=os.getpid(), device=str(worker.device)))
    while True:
        message = tasks.recv()
        if isinstance(message, Shutdown):
            break
        results.send(worker.run(message))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
