"""Per-test isolation inside a warm rank: what a test may change is put back afterwards.

A warm worker runs many tests; each must start from the same state a fresh process would
give it, or results would depend on test order. `TestIsolation` covers the interpreter state a
test body commonly changes (seeds, dtype, grad mode, warnings, environment, cwd, process groups,
torch.distributed's functions, and torch's device settings: `harness.rank.device_state`) and
runs in both modes; `ProcessIsolation` covers process-wide
state only a process the harness owns may reset (file descriptors 0-2, signal handlers and
timers, child processes) and runs in pool workers only: under torchrun the process is pytest's.
"""

from __future__ import annotations

import faulthandler
import gc
import operator
import os
import random
import signal
import sys
import types
import warnings
import weakref
from contextlib import ExitStack
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.device_mesh as device_mesh
import torch.distributed.distributed_c10d as c10d

from harness.message_text import describe_exception
from harness.process import procfs
from harness.rank import group_reuse
from harness.rank.device_state import CudaState, current_settings, restore_settings

_current_seed = 0
# Before torch 2.9 (at least 2.6; pytorch/pytorch#154976 fixed it in June 2025) a gloo group's
# destructor joins its worker threads while holding the GIL, and a worker that is still dropping
# the last reference to a Python-owned tensor of a finished collective waits for the GIL: the
# rank hangs for good. So there, the groups a test destroyed are released when the next test
# starts, when their workers have long been idle; a leak shows one test later.
GLOO_DESTRUCTOR_HOLDS_GIL = tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 9)


def current_seed() -> int:
    """The seed the running test started with."""
    return _current_seed


# MPS is seeded at once wherever it exists, and so is a custom device backend (privateuse1).
_SEEDED_AT_ONCE = torch.backends.mps.is_available() or torch._C._get_privateuse1_backend_name() != "privateuseone"
# The devices `torch.manual_seed` seeds lazily (queued until initialized), by their `is_initialized`
# (each where this torch has it).
_LAZY_DEVICE_CHECKS = tuple(
    check
    for name in ("cuda", "xpu", "mtia")
    if (check := getattr(getattr(torch, name, None), "is_initialized", None)) is not None
)
_lazily_seeded: int | None = None
"""The seed `torch.manual_seed` last queued for the accelerators not initialized yet (see `seed_everything`)."""


def seed_everything(seed: int) -> None:
    """Same seed on every rank: ranks build identical models unless a test asks otherwise."""
    global _current_seed, _lazily_seeded
    _current_seed = seed
    random.seed(seed)
    if seed == _lazily_seeded and not _accelerator_initialized():
        # `torch.manual_seed` also queues the seed for every accelerator that is not initialized
        # yet, capturing the Python stack each time (`traceback.format_stack`: ~0.3 ms, most of a
        # parent-side SPMD call's cost). That queued seed is still this one and still pending, and
        # no uninitialized accelerator has drawn a number: seeding the CPU generator is all that is left.
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)  # also seeds every CUDA device
        _lazily_seeded = seed
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


def _accelerator_initialized() -> bool:
    """Whether a device `torch.manual_seed` seeds besides the CPU has been initialized (then it is
    seeded at once, each time), or one that is always seeded at once exists (MPS, a custom backend)."""
    return _SEEDED_AT_ONCE or any(is_initialized() for is_initialized in _LAZY_DEVICE_CHECKS)


def sync_state() -> tuple[int, int, int]:
    """(default-group collective sequence number, process groups created so far, digest of the
    groups kept for later tests) of this rank.

    Both counters only grow over the worker's life, so ranks that report equal values have issued
    as many default-group collectives and created as many groups as each other; equal digests say
    they keep the same groups (`harness.rank.group_reuse`), so a later request is served from the
    kept groups on every rank or on none (`harness.messages.RankOutcome.sync_state`). Costs three
    reads: a call on the light path of a parent-side SPMD call reports it too."""
    default_group = c10d._get_default_group()
    return (default_group._get_sequence_number_for_group(), c10d._world.group_count, group_reuse.digest())


def _clear_dtensor_caches() -> None:
    """Forget what DTensor cached about this test's meshes.

    Besides stale answers (a new mesh equal to a destroyed one must not resolve to its dead
    groups), these caches hold meshes strongly, and a torch DeviceMesh holds its process groups:
    the redistribute planner cache (keyed by a weak reference to the mesh, but its value, the
    planner, refers to the mesh) and the cached transform plans would keep every mesh of every
    test, with each gloo group's threads, alive for the rank's whole life.
    """
    if "torch.distributed.tensor" not in sys.modules:
        return  # no test of this worker used DTensor: nothing cached (and its debug module costs seconds to import)
    _clear_sharding_propagation_caches()
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    if redistribute is None:
        return
    clear_planners = getattr(redistribute, "clear_redistribute_planner_cache", None)  # torch >= 2.10
    if clear_planners is not None:
        clear_planners()
    transform_infos = getattr(redistribute, "_gen_transform_infos", None)
    if hasattr(transform_infos, "cache_clear"):  # a functools cache on torch versions that have it
        transform_infos.cache_clear()
    collective_utils = sys.modules.get("torch.distributed.tensor._collective_utils")
    topology_info = getattr(getattr(collective_utils, "MeshTopoInfo", None), "build_from_mesh", None)
    if hasattr(topology_info, "cache_clear"):  # lru_cache keyed by the mesh itself
        topology_info.cache_clear()


def _clear_sharding_propagation_caches() -> None:
    """Both of DTensor's sharding-propagation caches (its Python LRU cache and the C++ fast path).

    `torch.distributed.tensor.debug._clear_sharding_prop_cache` does this too, but importing that
    module pulls in torch._dynamo and inductor (~0.8 s of CPU on every rank that used DTensor),
    so the two caches are reached directly, each only where this torch version has it.
    """
    api = sys.modules.get("torch.distributed.tensor._api")
    dispatcher = getattr(getattr(api, "DTensor", None), "_op_dispatcher", None)
    propagate = getattr(getattr(dispatcher, "sharding_propagator", None), "propagate_op_sharding", None)
    if hasattr(propagate, "cache_clear"):
        propagate.cache_clear()
    # torch 2.6: a thread-local wrapper without cache_clear around the lru_cache. Its keys compare
    # meshes by equality, so a stale entry handed the next test's equal mesh this test's dead one.
    propagate_cache = getattr(propagate, "cache", None)
    if hasattr(propagate_cache, "cache_clear"):
        propagate_cache.cache_clear()
    clear_fast_path = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_fast_path is not None:
        clear_fast_path()


class _ModuleFunctions:
    """The functions and classes of some modules, by identity, to put back the ones a test replaced.

    A test that monkeypatches `dist.all_reduce` (or c10d's) would otherwise leave the patch, and
    not the harness's traced wrapper, to every later test of the rank. Only callables are
    compared: modules gain attributes legitimately (lazy submodule imports).
    """

    def __init__(self, modules: tuple[types.ModuleType, ...]) -> None:
        self._snapshot = []
        for module in modules:
            functions = {name: value for name, value in vars(module).items() if _is_function_like(value)}
            # Read back all at once (C speed) after each test: hundreds of names, compared one by
            # one in Python only when one changed (a tenth of a millisecond per test otherwise).
            current = operator.itemgetter(*functions) if len(functions) > 1 else None
            self._snapshot.append((module, functions, tuple(functions.values()), current))

    def restore(self) -> list[str]:
        restored = []
        for module, functions, values, current in self._snapshot:
            namespace = vars(module)
            if current is not None:
                try:
                    if not any(map(operator.is_not, current(namespace), values)):
                        continue
                except KeyError:
                    pass  # a test deleted one: put back below
            for name, value in functions.items():
                if namespace.get(name) is not value:
                    setattr(module, name, value)
                    restored.append(f"{module.__name__}.{name}")
        return restored


def _encoded_environ() -> dict[Any, Any] | None:
    """A copy of os.environ's encoded mapping (CPython's `os._Environ._data`), None without one."""
    data = getattr(os.environ, "_data", None)
    return dict(data) if isinstance(data, dict) else None


def _is_function_like(value: object) -> bool:
    return callable(value) and not isinstance(value, types.ModuleType)


class TestIsolation:
    """Snapshot taken once per worker (after the trace is installed); `enter` before and `exit`
    after every test."""

    def __init__(self) -> None:
        self._debug_level = dist.get_debug_level()
        self._environ = dict(os.environ)
        # The environment as os.environ keeps it (encoded), compared after each test without
        # decoding every variable; None where this Python keeps it otherwise.
        self._environ_data = _encoded_environ()
        self._cwd = os.getcwd()
        self._default_dtype = torch.get_default_dtype()
        self._device_settings = current_settings()
        self._cuda = CudaState()
        self._groups_before: set[Any] = set()
        self._stack = ExitStack()
        self._functions = _ModuleFunctions((dist, c10d, funcol))
        # Process groups tests created that were still referenced once their test ended.
        self._leaked_groups: list[weakref.ref[dist.ProcessGroup]] = []
        # The last test's destroyed groups, held until the next test starts (GLOO_DESTRUCTOR_HOLDS_GIL),
        # and weak references to those released then, checked for leaks when that test ends.
        self._held_groups: list[dist.ProcessGroup] = []
        self._released_groups: list[weakref.ref[dist.ProcessGroup]] = []
        # What the last test left behind that does not stop the rank, for its stderr (take_notes).
        self._notes: list[str] = []
        # Groups kept for later tests (harness.rank.group_reuse) when the last test ended.
        self._kept_groups: set[Any] = set()

    def enter(self, seed: int, reuse_groups: bool = True) -> None:
        self._released_groups = [weakref.ref(group) for group in self._held_groups]
        self._held_groups = []
        self._groups_before = set(c10d._world.pg_map)
        if not reuse_groups:
            group_reuse.forget_all()  # what earlier tests kept is destroyed with this test's groups
            self._groups_before -= self._kept_groups
        group_reuse.begin_test(reuse_groups)
        seed_everything(seed)
        torch.set_default_dtype(self._default_dtype)
        self._cuda.enter()
        torch.set_grad_enabled(True)
        if torch.are_deterministic_algorithms_enabled():
            # Only when a test turned it on: the setter imports torch._inductor and torch._dynamo
            # (seconds), which would otherwise be every fresh rank's first-test cost.
            torch.use_deterministic_algorithms(False)
        dist.set_debug_level(self._debug_level)
        self._stack.enter_context(warnings.catch_warnings())
        warnings.resetwarnings()
        warnings.simplefilter("default")

    def exit(self) -> tuple[tuple[int, ...], str]:
        """Undo the test's changes; return the sync state the parent compares across ranks, and why
        this rank cannot run another test ("" when it can)."""
        self._stack.close()
        kept = group_reuse.end_test()
        self._functions.restore()
        restore_settings(self._device_settings)
        cuda_failure = self._cuda.exit()
        if cuda_failure:
            return (0, 0, 0), cuda_failure
        if not dist.is_initialized():
            group_reuse.forget_all()
            return (0, 0, 0), "the test destroyed the default process group"
        destroyed, failure = _destroy_groups_created_since(self._groups_before | kept, self._held_groups)
        self._kept_groups = kept
        if failure:
            return (0, 0, 0), failure
        if GLOO_DESTRUCTOR_HOLDS_GIL:
            destroyed, self._released_groups = self._released_groups, []
        else:
            self._held_groups = []
        _clear_dtensor_caches()  # a new mesh equal to a destroyed one must not resolve to its dead groups
        mesh_resources = getattr(device_mesh, "_mesh_resources", None)
        if mesh_resources is not None and hasattr(mesh_resources, "mesh_stack"):
            mesh_resources.mesh_stack.clear()
        # torch 2.6 to 2.8 at least: submesh -> root mesh and flattened-dim maps keyed by mesh
        # *equality*, so the next test's equal submesh found this test's root mesh, whose groups
        # are destroyed ("Could not resolve the process group registered under the name 3").
        for cache in ("child_to_root_mapping", "root_to_flatten_mapping", "flatten_name_to_root_dims"):
            mapping = getattr(mesh_resources, cache, None)
            if isinstance(mapping, dict):
                mapping.clear()
        self._collect_garbage()
        leaked_memory = self._cuda.leaked_memory()  # after the collection: what the test's objects still hold
        if leaked_memory:
            self._notes.append(leaked_memory)
        self._leaked_groups = [ref for ref in [*self._leaked_groups, *destroyed] if ref() is not None]
        data = _encoded_environ()
        if (data != self._environ_data) if data is not None else (os.environ != self._environ):
            os.environ.clear()
            os.environ.update(self._environ)
        if os.getcwd() != self._cwd:
            os.chdir(self._cwd)
        return sync_state(), ""

    def take_notes(self) -> list[str]:
        """What the last test left behind that the rank survives (device memory still allocated),
        one line each, for that test's stderr; forgotten once taken."""
        notes, self._notes = self._notes, []
        return notes

    def leaked_groups(self) -> list[str]:
        """Names of destroyed process groups that something still references: an object of a
        test or of a backend outlived its test (torch FSDP1 and DeepSpeed keep their models in
        reference cycles through tensor hooks, which the garbage collector cannot break while
        autograd also refers to the tensors). Each keeps its backend's threads: gloo's loop and
        worker threads run on, and dozens of them slow every later test of the rank."""
        names = []
        for ref in self._leaked_groups:
            group = ref()
            if group is not None:
                names.append(str(getattr(group, "group_name", "?")))
        return names

    @staticmethod
    def _collect_garbage() -> None:
        """Collect what the test left in reference cycles, now rather than in a later test.

        Sharded models are cyclic (module -> hook -> unit -> module), so refcounting alone never
        frees them: without this, their process groups (and threads), memory and any `__del__`
        that issues work would live on into later tests until a full collection happens to run.
        A full collection of an interpreter holding torch scans ~250k objects (~0.15 s); what
        survives is therefore frozen (`gc.freeze`), so each collection scans only the objects
        created since the previous test (well under 1 ms for most tests). What is frozen was
        still reachable when the test ended: imported modules and caches.
        """
        gc.collect()
        gc.freeze()


def _destroy_groups_created_since(
    existing: set[Any], keep: list[dist.ProcessGroup]
) -> tuple[list[weakref.ref[dist.ProcessGroup]], str]:
    """Destroy the groups not in `existing`, appending them to `keep`; weak references to them
    (this frame and `keep` hold the only strong ones), or why one could not be destroyed."""
    created = [group for group in c10d._world.pg_map if group not in existing]
    keep.extend(created)
    for group in created:
        try:
            dist.destroy_process_group(group)
        except Exception as error:  # noqa: BLE001 - any failure leaves groups behind: replace the rank
            return [], f"a process group the test created could not be destroyed ({describe_exception(error)})"
    return [weakref.ref(group) for group in created], ""


_STD_FDS = (0, 1, 2)


class ProcessIsolation:
    """Process-wide state of a pool worker, snapshotted once it is set up and put back after each test.

    * fds 0, 1, 2 (a test's `os.dup2(devnull, 1)` would otherwise send every later test's output,
      and the harness's own truncation of the capture file, to /dev/null) and `sys.stdin/stdout/stderr`;
    * Python signal handlers, the signal mask and interval timers (a test's `signal.alarm` must not
      fire in the next test), and faulthandler: the fatal-signal dumps and the SIGUSR1 stack dump
      the parent asks hung ranks for (a test's own SIGUSR1 handler would otherwise silence it);
    * child processes: whatever the test started and left running is ended (SIGKILL), including
      descendants in new sessions (the worker is a child subreaper, see `harness.process.procfs`).
    Must run in the main thread (signal handlers can only be set there).
    """

    def __init__(self, stack_file: IO[str]) -> None:
        self._stack_file = stack_file
        self._fds = {fd: os.dup(fd) for fd in _STD_FDS}  # non-inheritable copies of the originals
        self._fd_ids = {fd: _fd_identity(fd) for fd in _STD_FDS}
        self._streams = (sys.stdin, sys.stdout, sys.stderr)
        self._handlers = {sig: signal.getsignal(sig) for sig in _catchable_signals()}
        self._mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        self.arm_stack_dumps()

    def arm_stack_dumps(self) -> None:
        """(Re-)install faulthandler for fatal signals (to stderr) and SIGUSR1 (to the stacks file).

        faulthandler keeps its own record of what it installed: after a test replaced a handler,
        registering again would change nothing, so each is removed first.
        """
        faulthandler.disable()
        faulthandler.enable(file=sys.stderr, all_threads=True)
        faulthandler.unregister(signal.SIGUSR1)
        faulthandler.register(signal.SIGUSR1, file=self._stack_file, all_threads=True)

    def restore(self) -> tuple[list[str], str]:
        """Put everything back; return notes for the test's stderr and a reason to replace the rank ("" if none)."""
        notes: list[str] = []
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass  # closed or pointing at a closed fd: its buffered output is lost either way
        for fd, saved in self._fds.items():
            if _fd_identity(fd) != self._fd_ids[fd]:
                os.dup2(saved, fd)
                notes.append(f"fd {fd} was redirected by the test; restored")
        sys.stdin, sys.stdout, sys.stderr = (
            stream if not stream.closed else os.fdopen(fd, mode, closefd=False, buffering=1 if fd else -1)
            for fd, mode, stream in zip(_STD_FDS, ("r", "w", "w"), self._streams)
        )
        self._streams = (sys.stdin, sys.stdout, sys.stderr)
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)
        for sig, handler in self._handlers.items():
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
        self.arm_stack_dumps()
        ended, survivors = procfs.end_descendants()
        if ended:
            notes.append(f"ended {len(ended)} process(es) the test left running: {', '.join(ended)}")
        replace = f"processes {survivors} the test started did not die on SIGKILL" if survivors else ""
        return notes, replace


def _fd_identity(fd: int) -> tuple[int, int] | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None  # closed by the test
    return st.st_dev, st.st_ino


def _catchable_signals() -> list[signal.Signals]:
    uncatchable = {signal.SIGKILL, signal.SIGSTOP}
    return [sig for sig in signal.valid_signals() if isinstance(sig, signal.Signals) and sig not in uncatchable]
