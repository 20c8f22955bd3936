"""Runs one parent-side SPMD call inside a rank (`harness.messages.SpmdCall`, sent by
`harness.session.spmd.SpmdWorld.run`) and turns whatever happened into a `RankOutcome` whose
`value` is the function's pickled return value.

It shares the test runner's pieces rather than copying them (`harness.rank.runner`: the module
import with assertion rewriting, the failure text, the raised file, the harness-error outcome,
the fault bookkeeping; the runner's `TestIsolation` and trace file). Two paths:

* `isolate=True`: bracketed as a test is (`TestIsolation.enter` / `exit`: seeds, process groups
  created in the call destroyed, garbage collected, ...), whose sync state tells the parent
  whether the world may be reused;
* `isolate=False`, the light path: seeded, nothing else; its sync state is read directly
  (`harness.rank.isolation.sync_state`, two counters). No file is opened, truncated or closed, no
  garbage is collected and nothing is imported after the first call of a function.

With `trace=True` the call's collectives are recorded as a test's are (`tracing.begin_test` /
`end_test` on the rank's trace file), so the parent's one-sided watch and trace diff work alike.
Like the test runner, it never lets an exception escape.
"""

from __future__ import annotations

import importlib
import io
import pickle
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from harness.message_text import describe_exception
from harness.messages import RankOutcome, SpmdCall, Status
from harness.rank import rank_fixtures
from harness.rank.runner import (
    TestRunner,
    format_failure,
    harness_failure,
    import_test_module,
    note_raised,
    run_bracketed,
)

_PROTOCOL = pickle.HIGHEST_PROTOCOL


class CallResolutionError(RuntimeError):
    """The function a call names, or its arguments, could not be had on this rank."""


class _HostPickler(pickle.Pickler):
    """Pickles a return value with its device tensors copied to the host: the parent never touches
    a GPU (its device memory belongs to the ranks), so a CUDA tensor comes back as a CPU one."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            return obj.detach().cpu().__reduce_ex__(_PROTOCOL)
        return NotImplemented


class CallRunner:
    """Runs `SpmdCall`s for one rank, beside its `TestRunner` (whose isolation and files it uses)."""

    def __init__(self, tests: TestRunner) -> None:
        self._tests = tests
        self.rank = tests.rank
        self._functions: dict[tuple[str, str, str | None], tuple[ModuleType, Callable[..., Any]]] = {}
        self._on_host = tests.device.type == "cpu"
        self._context_bytes = b""
        self._rank_context = self._context_with({})
        self._sys_path: list[str] = []

    def _context_with(self, options: dict[str, Any]) -> rank_fixtures.RankContext:
        tests = self._tests
        return rank_fixtures.RankContext(tests.rank, tests.world_size, tests.local_rank, tests.device, options=options)

    def sys_path(self, call: SpmdCall) -> list[str]:
        """The session's sys.path for this call (see `_decode_context`)."""
        self._decode_context(call)
        return self._sys_path

    def _decode_context(self, call: SpmdCall) -> rank_fixtures.RankContext:
        """The call's `RankContext` (what `call_context()` returns) with its forwarded options, and its
        sys.path: unpickled and built again only when they changed since the last call."""
        if call.context != self._context_bytes:
            options, self._sys_path = pickle.loads(call.context)
            self._rank_context = self._context_with(options)
            self._context_bytes = call.context
        return self._rank_context

    def run(self, call: SpmdCall) -> RankOutcome:
        started = time.perf_counter()
        try:
            return self._run(call, started)
        except BaseException as error:  # noqa: BLE001 - the harness's own steps failed, not the function
            return harness_failure(self.rank, started, error)

    def _run(self, call: SpmdCall, started: float) -> RankOutcome:
        return run_bracketed(
            self._tests, started, lambda: self._invoke(call), seed=call.seed, isolate=call.isolate, trace=call.trace
        )

    def _invoke(self, call: SpmdCall) -> tuple[Status, str, str, float | None, bytes | None]:
        """Resolve the function and its arguments, call it, pickle what it returned: (status,
        summary, traceback, when it failed, the pickled value)."""
        try:
            function = self._function(call)
            args, kwargs = self._arguments(call)
            rank_fixtures.enter_call(self._decode_context(call))
            try:
                returned = function(*args, **kwargs)
            finally:
                rank_fixtures.enter_call(None)
        except BaseException as error:  # noqa: BLE001 - SystemExit and friends fail the call, not the rank
            failed_at = time.time()
            summary, failure = describe_exception(error), format_failure(error, __file__)
            note_raised(self._tests.raised_path, summary, failure)
            return "failed", summary, failure, failed_at, None
        try:
            value = self._pickle(returned)
        except Exception as error:  # noqa: BLE001 - any pickling failure has the same fix
            summary = (
                f"the value {call.module_name}.{call.qualname} returned on rank {self.rank} "
                f"(a {type(returned).__qualname__}) cannot be sent to the parent: {describe_exception(error)}"
            )
            fix = (
                "return plain data (numbers, strings, lists, dicts, dataclasses of a module the parent imports) "
                "or tensors (detached: `.detach()`), not modules, process groups, handles or generators"
            )
            return "failed", summary, f"{summary}\nfix: {fix}", time.time(), None
        return "passed", "", "", None, value

    def _function(self, call: SpmdCall) -> Callable[..., Any]:
        """The function a call names, imported as the parent imported its module (cached)."""
        key = (call.module_name, call.qualname, call.module_file)
        known = self._functions.get(key)
        if known is not None and sys.modules.get(call.module_name) is known[0]:
            return known[1]
        try:
            module = sys.modules.get(call.module_name)
            stale = call.module_file is not None and getattr(module, "__file__", None) != call.module_file
            if module is None or stale:
                if call.module_file is not None:
                    module = import_test_module(call.module_name, call.module_file)
                else:
                    module = importlib.import_module(call.module_name)
            found: Any = module
            for part in call.qualname.split("."):
                found = getattr(found, part)
        except Exception as error:
            raise CallResolutionError(
                f"rank {self.rank} cannot find {call.module_name}.{call.qualname}, the function of this SPMD "
                f"call ({describe_exception(error)}): the ranks import it by the name the parent knows it by, with "
                "the session's sys.path. Define it at module level of a module importable by that name (a test "
                "module collected with pytest's default 'prepend' import mode, or a helper module on sys.path)"
            ) from error
        self._functions[key] = (module, found)
        return found

    def _arguments(self, call: SpmdCall) -> tuple[tuple[Any, ...], dict[str, Any]]:
        try:
            args, kwargs = pickle.loads(call.arguments)
        except Exception as error:
            raise CallResolutionError(
                f"rank {self.rank} cannot unpickle the arguments of {call.module_name}.{call.qualname} "
                f"({describe_exception(error)}): an argument's class must be importable by the same name on "
                "the ranks; pass plain data or tensors, or build the object inside the function"
            ) from error
        return args, kwargs

    def _pickle(self, value: Any) -> bytes:
        if self._on_host:
            return pickle.dumps(value, _PROTOCOL)
        buffer = io.BytesIO()
        _HostPickler(buffer, _PROTOCOL).dump(value)
        return buffer.getvalue()
