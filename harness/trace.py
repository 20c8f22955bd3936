"""Per-rank collective trace: every collective a rank issues during a test, streamed to a file.

Why a trace: torch's own checks catch a divergent collective only when op, shape or dtype differ.
A *same-shape* mismatch (rank 0 all-gathers layer1 while rank 1 all-gathers layer2) silently
corrupts weights. Recording what each rank issued, with a semantic label, lets the parent diff
the ranks after the test (`harness.divergence`), even after a rank was SIGKILLed or hung.

Where the trace hooks in (and why there):
  * The Python entry points of `torch.distributed.distributed_c10d` (re-exported as
    `torch.distributed.*`) and of `torch.distributed._functional_collectives` are replaced by
    thin wrappers. FSDP1 (`dist.all_gather_single` / `dist.all_gather_into_tensor`,
    `dist.reduce_scatter_*`, `dist.all_reduce`), FSDP2 (`_fsdp_collectives`: `dist.all_gather_single`,
    `dist.reduce_scatter_single`, `dist.all_reduce`, and the `*_into_tensor` / `*_tensor` names on
    older torch) and DTensor (`funcol.all_gather_single`, `funcol.reduce_scatter_single`,
    `funcol.all_reduce`, ...) all look these functions up as module attributes at call time.
    Modules that bound a function early (`from torch.distributed.distributed_c10d import broadcast`,
    as DTensor's `_collective_utils` does) are found by scanning `sys.modules` for same-named
    references to the original function and rebinding them.
  * Patching `ProcessGroup` methods instead was rejected: functional collectives reach the C++
    process group through the dispatcher (`torch.ops._c10d_functional.*`), never through the
    Python-visible methods, so DTensor traffic would be missed; and a dispatcher-level mode
    would tax every tensor op, not just collectives.
  * `torch.distributed._broadcast_coalesced` (used to sync module states) is wrapped too.
    Collectives issued from C++ alone (DDP's reducer) are not seen.
A collective that is implemented by calling another traced entry point (e.g.
`all_gather_into_tensor` delegating to `all_gather_single`, `all_gather_object` using
`all_gather`) is recorded once, as the outermost call, thanks to a per-thread re-entrancy flag.
Aliases are recorded under one canonical name so ranks that spell an op differently compare equal.
Under `torch.compile` tracing the wrappers step aside and call the original function, so Dynamo
still sees the functions it knows.

Each record is one line of JSON appended with a single `os.write` before the collective is issued
(a rank that hangs or aborts inside it still shows it), followed by a short `{"done": index}` line
when the call returns (for async ops: when the call returned its Work, not when the work finished).
"""
from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.modules.module as nn_module

__all__ = [
    "CollectiveCall",
    "CollectiveRecord",
    "KNOWN_OPS",
    "begin_test",
    "end_test",
    "install",
    "is_installed",
    "read_trace",
    "register_label_provider",
    "set_interceptor",
]


@dataclass(slots=True)
class CollectiveRecord:
    """One collective as issued by one rank.

    index: position in this rank's trace of the current test (0-based).
    seq: position among this rank's collectives on the same group (same global ranks), 0-based;
         for point-to-point ops, position among this rank's ops in the same direction between the pair.
    group: global ranks of the process group.  peer: the other side of a send/recv (global rank).
    shapes/dtypes/numel: the tensors every member must agree on (the op's inputs; see `_SPECS`).
    uneven: the op legitimately lets shapes differ across ranks (all_to_all with splits).
    fault: description of a fault injected on this call; skipped: the call was never issued.
    completed: the call returned (false for the call a rank was stuck in or died in).
    """

    rank: int
    index: int
    seq: int
    op: str
    group: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    numel: int
    label: str
    peer: int | None = None
    uneven: bool = False
    fault: str = ""
    skipped: bool = False
    completed: bool = False

    @property
    def is_p2p(self) -> bool:
        return self.op in _P2P_SEND_OPS or self.op in _P2P_RECV_OPS

    @property
    def is_send(self) -> bool:
        return self.op in _P2P_SEND_OPS

    def to_json(self) -> str:
        data = {
            "rank": self.rank, "index": self.index, "seq": self.seq, "op": self.op,
            "group": self.group, "shapes": self.shapes, "dtypes": self.dtypes,
            "numel": self.numel, "label": self.label,
        }
        if self.peer is not None:
            data["peer"] = self.peer
        if self.uneven:
            data["uneven"] = True
        if self.fault:
            data["fault"] = self.fault
        if self.skipped:
            data["skipped"] = True
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CollectiveRecord:
        return cls(
            rank=data["rank"], index=data["index"], seq=data["seq"], op=data["op"],
            group=tuple(data["group"]), shapes=tuple(tuple(s) for s in data["shapes"]),
            dtypes=tuple(data["dtypes"]), numel=data["numel"], label=data["label"],
            peer=data.get("peer"), uneven=data.get("uneven", False), fault=data.get("fault", ""),
            skipped=data.get("skipped", False),
        )


@dataclass(frozen=True)
class _OpSpec:
    """How to read one entry point's arguments.

    inputs: parameters holding the tensors all members must agree on (recorded shapes/dtypes).
    outputs: parameters the op writes into; a functional op (`functional=True`) returns its output.
    uneven_when: parameters that, when not None, let input shapes differ across ranks.
    peer: (global-rank parameter, group-rank parameter) of a point-to-point op.
    """

    op: str
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    group: str = "group"
    functional: bool = False
    always_uneven: bool = False
    uneven_when: tuple[str, ...] = ()
    peer: tuple[str, str] | None = None


_P2P_SEND_OPS = frozenset({"send", "isend", "send_object_list"})
_P2P_RECV_OPS = frozenset({"recv", "irecv", "recv_object_list"})

_GATHER_INTO_TENSOR = _OpSpec("all_gather_into_tensor", ("input_tensor",), ("output_tensor",))
_REDUCE_SCATTER_TENSOR = _OpSpec("reduce_scatter_tensor", ("input",), ("output",))
_SEND = dict(inputs=("tensor",), peer=("dst", "group_dst"))
_RECV = dict(inputs=("tensor",), outputs=("tensor",), peer=("src", "group_src"))

# torch.distributed.distributed_c10d entry points, by attribute name.
_C10D_SPECS: dict[str, _OpSpec] = {
    "all_reduce": _OpSpec("all_reduce", ("tensor",), ("tensor",)),
    "all_reduce_coalesced": _OpSpec("all_reduce_coalesced", ("tensors",), ("tensors",)),
    "broadcast": _OpSpec("broadcast", ("tensor",), ("tensor",)),
    "reduce": _OpSpec("reduce", ("tensor",), ("tensor",)),
    "all_gather": _OpSpec("all_gather", ("tensor",), ("tensor_list",)),
    "all_gather_single": _GATHER_INTO_TENSOR,
    "all_gather_into_tensor": _GATHER_INTO_TENSOR,
    "_all_gather_base": _GATHER_INTO_TENSOR,
    "all_gather_coalesced": _OpSpec("all_gather_coalesced", ("input_tensor_list",), ("output_tensor_lists",)),
    "reduce_scatter": _OpSpec("reduce_scatter", ("input_list",), ("output",)),
    "reduce_scatter_single": _REDUCE_SCATTER_TENSOR,
    "reduce_scatter_tensor": _REDUCE_SCATTER_TENSOR,
    "_reduce_scatter_base": _REDUCE_SCATTER_TENSOR,
    "all_to_all": _OpSpec("all_to_all", ("input_tensor_list",), ("output_tensor_list",), always_uneven=True),
    "all_to_all_single": _OpSpec("all_to_all_single", ("input",), ("output",),
                                 uneven_when=("output_split_sizes", "input_split_sizes")),
    "barrier": _OpSpec("barrier"),
    "monitored_barrier": _OpSpec("monitored_barrier"),
    "send": _OpSpec("send", **_SEND),
    "isend": _OpSpec("isend", **_SEND),
    "recv": _OpSpec("recv", **_RECV),
    "irecv": _OpSpec("irecv", **_RECV),
    "all_gather_object": _OpSpec("all_gather_object"),
    "gather_object": _OpSpec("gather_object"),
    "broadcast_object_list": _OpSpec("broadcast_object_list"),
    "scatter_object_list": _OpSpec("scatter_object_list"),
    "send_object_list": _OpSpec("send_object_list", peer=("dst", "group_dst")),
    "recv_object_list": _OpSpec("recv_object_list", peer=("src", "group_src")),
    "scatter": _OpSpec("scatter", ("tensor",), ("tensor",)),
    "gather": _OpSpec("gather", ("tensor",), ("gather_list",)),
}

# torch.distributed._broadcast_coalesced is a C++ builtin without an inspectable signature.
_BROADCAST_COALESCED = _OpSpec("broadcast_coalesced", ("tensors",), ("tensors",), group="process_group")
_BROADCAST_COALESCED_PARAMS = ("process_group", "tensors", "buffer_size", "src")

_FUNCOL_GATHER = _OpSpec("funcol.all_gather", ("self",), functional=True)
_FUNCOL_REDUCE_SCATTER = _OpSpec("funcol.reduce_scatter", ("self",), functional=True)
_FUNCOL_ALL_TO_ALL = _OpSpec("funcol.all_to_all_single", ("self",), functional=True,
                             uneven_when=("output_split_sizes", "input_split_sizes"))
_FUNCOL_GATHER_COALESCED = _OpSpec("funcol.all_gather_coalesced", ("self",), functional=True)
_FUNCOL_RS_COALESCED = _OpSpec("funcol.reduce_scatter_coalesced", ("inputs",), functional=True)

# torch.distributed._functional_collectives entry points (DTensor, user code).
_FUNCOL_SPECS: dict[str, _OpSpec] = {
    "all_gather_single": _FUNCOL_GATHER,
    "all_gather_single_autograd": _FUNCOL_GATHER,
    "all_gather_tensor": _FUNCOL_GATHER,
    "all_gather_tensor_autograd": _FUNCOL_GATHER,
    "all_gather_tensor_inplace": _OpSpec("funcol.all_gather", ("input_tensor",), ("output_tensor",)),
    "all_gather_inplace": _OpSpec("funcol.all_gather", ("tensor",), ("tensor_list",)),
    "reduce_scatter_single": _FUNCOL_REDUCE_SCATTER,
    "reduce_scatter_single_autograd": _FUNCOL_REDUCE_SCATTER,
    "reduce_scatter_tensor": _FUNCOL_REDUCE_SCATTER,
    "reduce_scatter_tensor_autograd": _FUNCOL_REDUCE_SCATTER,
    "reduce_scatter_tensor_inplace": _OpSpec("funcol.reduce_scatter", ("input",), ("output",)),
    "all_reduce": _OpSpec("funcol.all_reduce", ("self",), functional=True),
    "all_reduce_inplace": _OpSpec("funcol.all_reduce", ("tensor",), ("tensor",)),
    "all_reduce_coalesced": _OpSpec("funcol.all_reduce_coalesced", ("self",), functional=True),
    "all_gather_single_coalesced": _FUNCOL_GATHER_COALESCED,
    "all_gather_into_tensor_coalesced": _FUNCOL_GATHER_COALESCED,
    "reduce_scatter_single_coalesced": _FUNCOL_RS_COALESCED,
    "reduce_scatter_tensor_coalesced": _FUNCOL_RS_COALESCED,
    "all_to_all_single": _FUNCOL_ALL_TO_ALL,
    "all_to_all_single_autograd": _FUNCOL_ALL_TO_ALL,
    "all_to_all_inplace": _OpSpec("funcol.all_to_all_single", ("input",), ("output",),
                                  uneven_when=("output_split_sizes", "input_split_sizes")),
    "broadcast": _OpSpec("funcol.broadcast", ("self",), functional=True),
    "permute_tensor": _OpSpec("funcol.permute_tensor", ("self",), functional=True),
}

KNOWN_OPS: frozenset[str] = frozenset(
    spec.op for spec in (*_C10D_SPECS.values(), *_FUNCOL_SPECS.values(), _BROADCAST_COALESCED)
)
"""Every op name a record can carry (canonical names; aliases are folded)."""

# Segments that wrappers insert into module paths; dropped so labels read like the user's FQNs.
_WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


@dataclass
class CollectiveCall:
    """A collective about to be issued, as handed to an interceptor's runner (see `set_interceptor`)."""

    record: CollectiveRecord
    issue: Callable[[], Any]
    """Issues the real collective and returns its result."""
    _spec: _OpSpec
    _params: dict[str, Any] = field(repr=False)

    @property
    def functional(self) -> bool:
        return self._spec.functional

    @property
    def async_op(self) -> bool:
        return bool(self._params.get("async_op"))

    def output_tensors(self, result: Any) -> list[torch.Tensor]:
        """The tensors this collective wrote, given `issue()`'s result; waits for async work first."""
        if self._spec.functional:
            from torch.distributed._functional_collectives import AsyncCollectiveTensor
            return [t.wait() if isinstance(t, AsyncCollectiveTensor) else t for t in _flatten_tensors(result)]
        if self.async_op and result is not None:
            result.wait()
        return _flatten_tensors(*(self._params.get(name) for name in self._spec.outputs))

    def skipped_result(self) -> Any:
        """What the caller gets back when the collective is not issued at all."""
        if self._spec.functional:
            raise ValueError(
                f"cannot skip functional collective {self.record.op}: its caller needs the result "
                "tensor; inject 'delay', 'corrupt', 'raise', 'exit' or 'hang' instead")
        if self.async_op:
            future: torch.futures.Future = torch.futures.Future()
            future.set_result(None)
            return torch._C._distributed_c10d._create_work_from_future(future)
        if self._spec.op in ("recv", "irecv"):
            return self.record.peer if self.record.peer is not None else -1
        return None


Runner = Callable[[CollectiveCall], Any]
Interceptor = Callable[[CollectiveRecord], "Runner | None"]


class _ThreadState(threading.local):
    """Per-thread state: the stack of running module forwards and the re-entrancy flag."""

    def __init__(self) -> None:
        self.modules: list[torch.nn.Module] = []
        self.busy = False


class _TestState:
    """What is being recorded for the current test (one instance per test)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.next_index = 0
        self.seq_by_key: dict[tuple, int] = {}
        self.rank: int | None = None


_thread = _ThreadState()
_lock = threading.Lock()
_test: _TestState | None = None
_interceptor: Interceptor | None = None
_label_providers: list[Callable[[], str | None]] = []
_group_ranks_cache: dict[Any, tuple[int, ...]] = {}
_child_path_cache: dict[tuple[int, int], tuple[weakref.ref, weakref.ref, str | None]] = {}
_dtype_names: dict[torch.dtype, str] = {}
_installed = False
_is_compiling = torch.compiler.is_compiling


# ----------------------------------------------------------------------------------- public API

def install() -> None:
    """Wrap every collective entry point of this process (idempotent) and start tracking module
    forwards for labels. Recording only happens between `begin_test` and `end_test`."""
    global _installed
    if _installed:
        return
    import torch.distributed._functional_collectives as funcol

    replacements: dict[int, _Replacement] = {}

    def add(owner: Any, name: str, spec: _OpSpec, positions: dict[str, int] | None = None) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return
        known = replacements.get(id(original))
        if known is None:
            wrapper = _make_wrapper(spec, original, positions if positions is not None else _param_positions(original))
            known = replacements[id(original)] = _Replacement(original, wrapper, {getattr(original, "__name__", name)})
        known.names.add(name)

    for name, spec in _C10D_SPECS.items():
        add(c10d, name, spec)
    add(dist, "_broadcast_coalesced", _BROADCAST_COALESCED,
        {p: i for i, p in enumerate(_BROADCAST_COALESCED_PARAMS)})
    for name, spec in _FUNCOL_SPECS.items():
        add(funcol, name, spec)
    _rebind_everywhere(replacements)
    nn_module.register_module_forward_pre_hook(_push_module)
    nn_module.register_module_forward_hook(_pop_module, always_call=True)
    _installed = True


def is_installed() -> bool:
    return _installed


def begin_test(trace_path: str) -> None:
    """Start recording into `trace_path` (created or truncated); ends any test still open."""
    global _test
    end_test()
    fd = os.open(trace_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    _thread.modules.clear()
    _test = _TestState(fd)


def end_test() -> None:
    """Stop recording and close the trace file; forget groups and module names of this test."""
    global _test
    test, _test = _test, None
    if test is not None:
        os.close(test.fd)
    _group_ranks_cache.clear()
    _child_path_cache.clear()


def register_label_provider(provider: Callable[[], str | None]) -> Callable[[], None]:
    """Add a source of semantic labels (e.g. a backend adapter naming the FQNs being gathered).

    The first provider returning a non-None string labels the collective; otherwise the label is the
    FQN of the innermost running module forward. Returns a function that removes the provider.
    """
    _label_providers.append(provider)

    def remove() -> None:
        if provider in _label_providers:
            _label_providers.remove(provider)
    return remove


def set_interceptor(interceptor: Interceptor | None) -> None:
    """Install the one interceptor (used by `harness.faults`), or remove it with None.

    The interceptor sees each record before it is written (it may set `fault` / `skipped`) and
    returns a runner that issues the call its own way, or None to issue it normally. It is consulted
    even when no test is recording, so fault injection also works under torchrun.
    """
    global _interceptor
    _interceptor = interceptor


def read_trace(path: str) -> list[CollectiveRecord]:
    """Records of one rank's trace file; a last line cut short by a killed rank is ignored."""
    with open(path, encoding="utf-8") as handle:
        lines = handle.read().split("\n")
    records: dict[int, CollectiveRecord] = {}
    for number, line in enumerate(lines, start=1):
        if not line:
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # no trailing newline: the write was cut short
                continue
            raise ValueError(f"{path}:{number}: corrupt trace line {line[:80]!r}") from None
        if "done" in data:
            if data["done"] in records:
                records[data["done"]].completed = True
        else:
            record = CollectiveRecord.from_json(data)
            records[record.index] = record
    return sorted(records.values(), key=lambda r: r.index)


# ------------------------------------------------------------------------------------ recording

def _make_wrapper(spec: _OpSpec, original: Callable, positions: dict[str, int]) -> Callable:
    """A drop-in replacement for `original` that records (and lets faults intercept) each call."""

    @functools.wraps(original)
    def traced(*args: Any, **kwargs: Any) -> Any:
        if _is_compiling():
            return original(*args, **kwargs)
        thread = _thread
        if thread.busy or (_test is None and _interceptor is None):
            return original(*args, **kwargs)
        thread.busy = True
        try:
            params = _Params(args, kwargs, positions)
            record = _build_record(spec, params)
            if record is None:
                return original(*args, **kwargs)
            runner = _interceptor(record) if _interceptor is not None else None
            test = _test
            if test is not None:
                os.write(test.fd, (record.to_json() + "\n").encode())
            if runner is None:
                result = original(*args, **kwargs)
            else:
                call = CollectiveCall(record, lambda: original(*args, **kwargs), spec, params.as_dict(spec))
                result = runner(call)
            if test is not None and test is _test:
                os.write(test.fd, b'{"done":%d}\n' % record.index)
            return result
        finally:
            thread.busy = False

    traced.__trace_original__ = original  # type: ignore[attr-defined]
    return traced


class _Params:
    """Positional-or-keyword argument lookup without the cost of `Signature.bind`."""

    __slots__ = ("args", "kwargs", "positions")

    def __init__(self, args: tuple, kwargs: dict, positions: dict[str, int]) -> None:
        self.args, self.kwargs, self.positions = args, kwargs, positions

    def get(self, name: str) -> Any:
        position = self.positions.get(name)
        if position is not None and position < len(self.args):
            return self.args[position]
        return self.kwargs.get(name)

    def as_dict(self, spec: _OpSpec) -> dict[str, Any]:
        names = {*spec.outputs, "async_op"}
        return {name: self.get(name) for name in names}


def _build_record(spec: _OpSpec, params: _Params) -> CollectiveRecord | None:
    """The record for this call, or None when this rank is not a member of the call's group."""
    if spec.op.startswith("funcol."):
        import torch.distributed._functional_collectives as funcol
        if funcol._are_we_tracing():
            return None
        group = _funcol_group_ranks(params.get(spec.group))
    else:
        group = _c10d_group_ranks(params.get(spec.group))
    if group is None:
        return None
    tensors = _flatten_tensors(*(params.get(name) for name in spec.inputs))
    shapes = tuple(tuple(t.shape) for t in tensors)
    dtypes = tuple(_dtype_name(t.dtype) for t in tensors)
    numel = sum(t.numel() for t in tensors)
    uneven = spec.always_uneven or any(params.get(name) is not None for name in spec.uneven_when)
    peer = _peer(spec, params, group) if spec.peer else None
    label = _current_label()
    with _lock:
        test = _test
        if test is None:
            index, seq, rank = -1, -1, dist.get_rank()
        else:
            if test.rank is None:
                test.rank = dist.get_rank()
            rank = test.rank
            index = test.next_index
            test.next_index += 1
            if spec.peer:
                key: tuple = ("p2p", rank, peer) if spec.op in _P2P_SEND_OPS else ("p2p", peer, rank)
            else:
                key = group
            seq = test.seq_by_key.get(key, 0)
            test.seq_by_key[key] = seq + 1
    return CollectiveRecord(rank=rank, index=index, seq=seq, op=spec.op, group=group, shapes=shapes,
                            dtypes=dtypes, numel=numel, label=label, peer=peer, uneven=uneven)


def _flatten_tensors(*values: Any) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    stack = list(reversed(values))
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, (list, tuple)):
            stack.extend(reversed(value))
    return tensors


def _dtype_name(dtype: torch.dtype) -> str:
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).removeprefix("torch.")
    return name


def _c10d_group_ranks(group: Any) -> tuple[int, ...] | None:
    if group is c10d.GroupMember.NON_GROUP_MEMBER:
        return None
    ranks = _group_ranks_cache.get(group)
    if ranks is None:
        process_group = c10d._get_default_group() if group is None else group
        ranks = _group_ranks_cache[group] = tuple(dist.get_process_group_ranks(process_group))
    return ranks


def _funcol_group_ranks(group: Any) -> tuple[int, ...] | None:
    """Global ranks of a functional-collective group argument, without creating any group."""
    if isinstance(group, tuple) and len(group) == 2 and not isinstance(group[0], int):  # (DeviceMesh, dim)
        mesh, dim = group
        return _c10d_group_ranks(mesh.get_group(dim))
    if isinstance(group, (list, tuple)):
        if group and isinstance(group[0], (list, tuple)):  # MPMD: the row holding this rank
            me = dist.get_rank()
            return next((tuple(row) for row in group if me in row), None)
        return tuple(group)
    if isinstance(group, str):
        ranks = _group_ranks_cache.get(group)
        if ranks is None:
            process_group = torch._C._distributed_c10d._resolve_process_group(group)
            ranks = _group_ranks_cache[group] = tuple(dist.get_process_group_ranks(process_group))
        return ranks
    if group is None or isinstance(group, dist.ProcessGroup):
        return _c10d_group_ranks(group)
    return _c10d_group_ranks(group.get_group())  # 1-D DeviceMesh


def _peer(spec: _OpSpec, params: _Params, group: tuple[int, ...]) -> int | None:
    assert spec.peer is not None
    global_name, group_name = spec.peer
    peer = params.get(global_name)
    if peer is None:
        group_peer = params.get(group_name)
        peer = group[group_peer] if group_peer is not None else None
    return peer


# --------------------------------------------------------------------------------------- labels

def _push_module(module: torch.nn.Module, _inputs: Any) -> None:
    _thread.modules.append(module)


def _pop_module(module: torch.nn.Module, _inputs: Any, _output: Any) -> None:
    modules = _thread.modules
    if modules and modules[-1] is module:
        modules.pop()
        return
    for position in range(len(modules) - 1, -1, -1):  # unbalanced after an exception elsewhere
        if modules[position] is module:
            del modules[position]
            return


def _current_label() -> str:
    for provider in _label_providers:
        label = provider()
        if label is not None:
            return label
    return _module_label(_thread.modules)


def _module_label(modules: list[torch.nn.Module]) -> str:
    """FQN of the innermost running module relative to the outermost one, wrapper segments dropped."""
    parts: list[str] = []
    for parent, child in zip(modules, modules[1:]):
        if parent is child:
            continue
        path = _child_path(parent, child)
        if path is None:  # called from outside its parent's tree: name it from here on by type
            parts = [type(child).__name__]
        elif path:
            parts.append(path)
    return ".".join(seg for part in parts for seg in part.split(".") if seg not in _WRAPPER_SEGMENTS)


def _child_path(parent: torch.nn.Module, child: torch.nn.Module) -> str | None:
    key = (id(parent), id(child))
    cached = _child_path_cache.get(key)
    if cached is not None and cached[0]() is parent and cached[1]() is child:
        return cached[2]
    path = next((name for name, sub in parent.named_modules(remove_duplicate=False) if sub is child), None)
    _child_path_cache[key] = (weakref.ref(parent), weakref.ref(child), path)
    return path


# ------------------------------------------------------------------------------------- patching

def _param_positions(function: Callable) -> dict[str, int]:
    parameters = inspect.signature(function).parameters.values()
    return {
        p.name: i for i, p in enumerate(parameters)
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    }


@dataclass
class _Replacement:
    original: Callable
    wrapper: Callable
    names: set[str]
    """Attribute names under which the original is published (its own name and aliases)."""


def _rebind_everywhere(replacements: dict[int, _Replacement]) -> None:
    """Replace every module-level reference to an original, under any of its published names, with
    its wrapper, so early `from torch.distributed... import name` bindings are traced too."""
    by_name: dict[str, list[_Replacement]] = {}
    for replacement in replacements.values():
        for name in replacement.names:
            by_name.setdefault(name, []).append(replacement)
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, candidates in by_name.items():
            current = namespace.get(name)
            if current is None:
                continue
            for replacement in candidates:
                if current is replacement.original:
                    namespace[name] = replacement.wrapper
