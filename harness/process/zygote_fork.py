"""Start the session's zygote by forking pytest itself, when that gives what a cold start gives.

A cold zygote (`python -m harness.rank.zygote`) is a new interpreter that imports torch again: about
two seconds of CPU and of wall time before a session's first distributed test, although pytest
has usually imported torch by then (test modules import it at collection). Forking pytest skips
that, but only where the child can be turned into what the cold zygote is; see
[Note: a zygote forked from pytest]. `refusal` says why not where it cannot, and the launcher
then starts the zygote cold exactly as before.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import io
import logging
import os
import runpy
import signal
import site
import sys
import sysconfig
import threading
import warnings
from types import ModuleType
from typing import NoReturn

from harness.process.fork_probe import forks_are_marked_bad

# [Note: a zygote forked from pytest]
# The child of the fork is a copy of a pytest process in the middle of a test; before it serves
# forks it must be what `python -m harness.rank.zygote` started with the session's environment is:
#   - process: its own session (as `start_new_session`), death signal and subreaper armed by
#     `harness.rank.zygote` itself; no interval timer survives a fork (pytest-timeout's SIGALRM).
#   - fds: 0 on /dev/null, 1 and 2 on zygote.log, the socket to the parent; every other fd
#     (pytest's capture files and their saved copies, the faulthandler file, the parent's pipes
#     to other ranks) is closed. `sys.stdin/stdout/stderr` are new streams on fds 0-2, as an
#     interpreter makes them; the old stream objects are kept alive, never finalised, so that
#     closing them cannot close a reused fd number.
#   - signals: every Python handler back to SIG_DFL, then SIGINT, SIGPIPE and SIGXFSZ as a new
#     interpreter sets them; no wakeup fd; faulthandler's registrations removed and re-armed
#     on the new stderr.
#   - hooks pytest installs while a test runs: `sys.excepthook`, `sys.unraisablehook`,
#     `threading.excepthook`, trace and profile functions, the warnings filters and
#     `showwarning` (pytest records warnings into a list), the root logger's handlers and level
#     (pytest captures logging) are put back as they were when this module was imported, at
#     plugin load, before any test ran, and so are every other logger's, but for handlers that write
#     nowhere (pytest 9.1+ attaches its handlers to non-propagating loggers too, and a conftest
#     may add a file handler, which its import in the child adds again); pytest's import hooks
#     leave `sys.meta_path`.
#   - modules: pytest, its plugins, conftests, the project's packages and every module loaded
#     from outside the interpreter's installed paths (test modules) are dropped from
#     `sys.modules` and imported anew, as a cold zygote and its ranks import them: a rank
#     never sees a module object the parent changed. What stays is the standard library and
#     installed packages (torch). If one of those holds a module that must be dropped, the
#     fork is refused (it would keep the parent's copy alive beside a fresh one).
#   - environment: the session's (`os.environ` replaced; `tempfile` recomputes its directory);
#     torch's intra-op thread count as OMP_NUM_THREADS would have set it at a fresh import.
#   - garbage: everything inherited is frozen first (`gc.freeze`): no finaliser of a pytest
#     object runs in the child; it leaves with `os._exit` (no atexit handler of pytest runs).
# What cannot be reset is refused before the fork (`refusal`): another thread (a fork copies
# only the calling one, and whatever lock another held stays held), torch not imported (nothing
# to gain), CUDA initialised, interpreter start-up variables (PYTHON*) that differ from the
# session's or interpreter options (`-W error`) that a new interpreter would not get, no /proc
# (cannot count threads). Torch's own global state (a seed, the default dtype an in-process test
# set) is the parent's; each rank's test isolation resets it per test (`harness.rank.isolation`), as
# it does between tests on one rank.

# Taken at plugin load, before any test: what a fresh interpreter plus the session's plugins
# imports had, and what pytest replaces while a test runs.
_WARNING_FILTERS = list(warnings.filters)
_SHOWWARNING = warnings.showwarning
_SHOWWARNMSG = getattr(warnings, "_showwarnmsg_impl", None)
_ROOT_HANDLERS = list(logging.getLogger().handlers)
_ROOT_LEVEL = logging.getLogger().level
_LOGGER_HANDLERS = {
    name: list(logger.handlers)
    for name, logger in logging.Logger.manager.loggerDict.items()
    if isinstance(logger, logging.Logger)
}
_START_ENV = {key: value for key, value in os.environ.items() if key.startswith("PYTHON") and key != "PYTHONPATH"}

# Top-level packages dropped whatever their location: pytest's and the project's own.
_DROPPED_PACKAGES = frozenset({"pytest", "_pytest", "pluggy", "py", "iniconfig", "conftest", "harness", "conformance"})
_DROPPED_PREFIXES = ("pytest_", "xdist")

_KEPT_ALIVE: list[object] = []
"""Stream objects replaced in the child: never finalised (see the Note)."""


def refusal(env: dict[str, str]) -> str:
    """Why the zygote must start cold instead of as a fork of this process ("" if it can fork)."""
    if not hasattr(os, "fork") or not os.path.isdir("/proc/self/task"):
        return "this platform has no fork or no /proc to count threads"
    torch = sys.modules.get("torch")
    if torch is None:
        return "pytest has not imported torch"
    threads = _thread_count()
    if threads != 1:
        return f"pytest has {threads} threads (a fork copies only one)"
    if torch.cuda.is_initialized():
        return "pytest initialised CUDA, which a forked child cannot use"
    if forks_are_marked_bad():
        return (
            "pytest asked the CUDA runtime (torch.cuda.is_available or device_count), so torch marks "
            "its forks unable to use CUDA"
        )
    start = {key: value for key, value in env.items() if key.startswith("PYTHON") and key != "PYTHONPATH"}
    if start != _START_ENV:
        return "the session's PYTHON* variables differ from pytest's start-up ones"
    options = _interpreter_options(getattr(sys, "orig_argv", []))
    if options:
        return f"pytest's interpreter was started with options a new one would not have ({' '.join(options)})"
    _, holder = _modules_to_drop()
    if holder:
        return f"the module {holder}, which must stay, refers to a module of pytest or of the project"
    return ""


def _interpreter_options(argv: list[str]) -> list[str]:
    """The options before the script, `-m` or `-c` in an interpreter's command line (`-W error`)."""
    options: list[str] = []
    index = 1
    while index < len(argv) and argv[index].startswith("-") and argv[index] not in ("-", "-m", "-c"):
        takes_value = argv[index] in ("-W", "-X")
        options.extend(argv[index : index + 1 + takes_value])
        index += 1 + takes_value
    return options


def _thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def _installed_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    roots.update(getattr(site, "getsitepackages", list)())
    roots.add(site.getusersitepackages())
    return tuple(os.path.join(os.path.realpath(root), "") for root in roots if root)


def _location(module: object) -> str | None:
    """Where a module was loaded from (None: built in, or not a real module, like `torch.classes`)."""
    if not issubclass(type(module), ModuleType):
        return None
    spec = getattr(module, "__spec__", None)
    origin = getattr(spec, "origin", None) or getattr(module, "__file__", None)
    if isinstance(origin, str) and os.path.isabs(origin):
        return os.path.realpath(origin)
    paths = getattr(spec, "submodule_search_locations", None)
    first = next(iter(paths), None) if paths is not None else None  # a namespace package
    return os.path.realpath(first) if isinstance(first, str) else None


def _modules_to_drop() -> tuple[list[str], str]:
    """The modules a cold zygote would import anew (or never), and a module that must be kept
    (the standard library's, torch's) but holds one of them, if any."""
    roots = _installed_roots()
    paths = sysconfig.get_paths()
    stdlib = tuple(os.path.join(os.path.realpath(paths[key]), "") for key in ("stdlib", "platstdlib"))
    installed = tuple(root for root in roots if not root.startswith(stdlib) or "-packages" in root)
    dropped: dict[str, int] = {}
    for name, module in list(sys.modules.items()):
        top = name.partition(".")[0]
        location = _location(module)
        if (
            top in _DROPPED_PACKAGES
            or top.startswith(_DROPPED_PREFIXES)
            or (location is not None and not location.startswith(roots))
        ):
            dropped[name] = id(module)
    # Whatever else refers to a dropped module goes too (a pytest plugin installed beside torch),
    # unless it must stay: then the fork is refused.
    changed = True
    while changed:
        changed = False
        ids = set(dropped.values())
        for name, module in list(sys.modules.items()):
            if name in dropped or not issubclass(type(module), ModuleType) or name in ("__main__", "__mp_main__"):
                continue
            held = [v for v in list(vars(module).values()) if issubclass(type(v), ModuleType) and id(v) in ids]
            if not held:
                continue
            location = _location(module)
            in_stdlib = location is None or (location.startswith(stdlib) and not location.startswith(installed))
            if name.partition(".")[0] == "torch" or in_stdlib:
                return sorted(dropped), f"{name} (it refers to {held[0].__name__})"
            dropped[name] = id(module)
            changed = True
    return sorted(dropped), ""


def fork_zygote(sock_fd: int, parent_pid: int, preload_spec: str, env: dict[str, str], log_fd: int) -> int:
    """Fork the zygote from this process (`refusal` said it may); its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            _become_zygote(sock_fd, parent_pid, preload_spec, env, log_fd)
        finally:
            os._exit(70)  # never back into pytest
    return pid


def _become_zygote(sock_fd: int, parent_pid: int, preload_spec: str, env: dict[str, str], log_fd: int) -> NoReturn:
    gc.freeze()  # nothing inherited is ever collected: no finaliser of pytest's objects runs here
    os.setsid()
    _reset_signals()
    _reset_fds(sock_fd, log_fd)
    _reset_hooks()
    os.environ.clear()
    os.environ.update(env)
    import tempfile

    tempfile.tempdir = None
    torch = sys.modules["torch"]
    threads = env.get("OMP_NUM_THREADS", "")
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(min(int(threads), usable) if threads.isdigit() and int(threads) > 0 else usable)
    dropped, _ = _modules_to_drop()
    for name in dropped:
        sys.modules.pop(name, None)
    importlib.invalidate_caches()
    sys.path_importer_cache.clear()
    print(f"zygote: forked from pytest (pid {parent_pid}) instead of started cold", file=sys.stderr, flush=True)
    sys.argv = ["-m", str(sock_fd), str(parent_pid), preload_spec]
    # What `python -m harness.rank.zygote` does: a new __main__ module runs it (and argv[0] is its file).
    runpy.run_module("harness.rank.zygote", run_name="__main__", alter_sys=True)  # exits
    os._exit(70)


def _reset_signals() -> None:
    signal.set_wakeup_fd(-1)
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            faulthandler.unregister(signum)  # a stack dump on a user signal, installed in C
        except (RuntimeError, ValueError, OSError):
            pass  # not one faulthandler registers
        try:
            if callable(signal.getsignal(signum)):
                signal.signal(signum, signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # a signal Python cannot handle
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # what a new interpreter sets
    if hasattr(signal, "SIGXFSZ"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def _reset_fds(sock_fd: int, log_fd: int) -> None:
    faulthandler.disable()  # pytest's points at a capture fd about to be closed
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd != sock_fd:
            try:
                os.close(fd)
            except OSError:
                pass  # the directory's own fd, already gone
    old = (sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__)
    _KEPT_ALIVE.extend(old)
    encoding = getattr(sys.__stdout__, "encoding", None) or "utf-8"
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = _std_stream(0, "<stdin>", "r", encoding, "strict", False)
    sys.stdout = sys.__stdout__ = _std_stream(1, "<stdout>", "w", encoding, "strict", unbuffered)
    sys.stderr = sys.__stderr__ = _std_stream(2, "<stderr>", "w", encoding, "backslashreplace", True)


def _std_stream(fd: int, name: str, mode: str, encoding: str, errors: str, eager: bool) -> io.TextIOWrapper:
    """A standard stream as the interpreter builds it at start-up for a file (not a terminal)."""
    raw = io.FileIO(fd, mode, closefd=False)  # closefd=False: as the interpreter's own
    raw.name = name  # type: ignore[misc]
    buffer = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
    stream = io.TextIOWrapper(buffer, encoding=encoding, errors=errors, line_buffering=eager and fd == 2)
    if eager and fd == 1:
        stream.reconfigure(write_through=True)  # PYTHONUNBUFFERED
    stream.mode = mode  # type: ignore[misc]
    return stream


def _kept_in_the_child(handler: logging.Handler, at_plugin_load: list[logging.Handler]) -> bool:
    """Whether a forked child keeps ``handler``: one its logger had at plugin load (what a cold
    start's imports give it), or a handler that writes nowhere (a library's ``NullHandler``, added
    when an installed package first used its logger, which the child does not import again).
    Anything else was added since by pytest (its capture and log-file handlers) or by a conftest
    or test module, which the child imports anew and which adds its handler again."""
    if handler in at_plugin_load:
        return True
    return type(handler) is logging.NullHandler


def _reset_hooks() -> None:
    sys.excepthook = sys.__excepthook__
    sys.unraisablehook = sys.__unraisablehook__
    threading.excepthook = threading.__excepthook__
    sys.settrace(None)
    sys.setprofile(None)
    threading.settrace(None)  # type: ignore[arg-type]
    threading.setprofile(None)  # type: ignore[arg-type]
    warnings.filters[:] = _WARNING_FILTERS
    warnings.showwarning = _SHOWWARNING
    if _SHOWWARNMSG is not None:
        warnings._showwarnmsg_impl = _SHOWWARNMSG  # type: ignore[attr-defined]
    warnings._filters_mutated()  # type: ignore[attr-defined]
    root = logging.getLogger()
    root.handlers[:] = _ROOT_HANDLERS
    root.setLevel(_ROOT_LEVEL)
    # Every other logger's handlers as at plugin load. pytest 9.1+ attaches its capture handlers
    # to every non-propagating logger (torch's c10d loggers among them) while a test runs, and a
    # conftest may give a logger a file. Inherited, such a handler writes each record to the
    # parent's stream by fd number, and the child closes those fds: the numbers are reused by the
    # trace file or a gloo socket, which a log line then corrupts (c10d logs each collective at
    # DEBUG under TORCH_DISTRIBUTED_DEBUG=DETAIL).
    for name, logger in logging.Logger.manager.loggerDict.items():
        if isinstance(logger, logging.Logger):
            at_plugin_load = _LOGGER_HANDLERS.get(name, [])
            logger.handlers[:] = [handler for handler in logger.handlers if _kept_in_the_child(handler, at_plugin_load)]
    sys.meta_path[:] = [finder for finder in sys.meta_path if not type(finder).__module__.startswith("_pytest")]
