"""Collectives below Python: a kernel on the dispatcher's autograd key of every process-group op.

Every collective a `ProcessGroup` runs passes through one of torch's dispatcher ops, whoever asked
for it: `ProcessGroup::allreduce` and its siblings are `c10d::allreduce_` and so on
(`torch/csrc/distributed/c10d/Ops.cpp`), and functional collectives are `_c10d_functional::*`.
DDP's reducer (its bucket all-reduces, from C++, in backward), DDP's start-up shape check, a
`ProcessGroup` method called directly, a compiled graph's functional collectives: none of them
passes through the Python entry points that `harness.rank.tracing` wraps, all of them pass here.

Why the autograd key: those ops have kernels for the backend keys (CPU, CUDA, PrivateUse1) and
none for autograd, so a Python kernel registered there runs first for any real tensor and hands
the call on below autograd (a redispatch with the call's keys past autograd), where torch's own
kernel runs as before. It costs one Python call per collective, nothing for any other op (a dispatcher-wide
`TorchDispatchMode` would tax every tensor op). Functional collectives call their process group
from C++ below the autograd layer, which is why their own ops are hooked too, and why a
`c10d` kernel never sees them twice.

What is not seen here, and why that is fine: calls on a group this rank is not a member of (torch
returns in Python, where the tracer records them) and object collectives (Python, recorded there).
A Python entry point that the tracer already records calls these ops inside its record; the
tracer's per-thread flag makes them pass straight through (`harness.rank.tracing`).

`install` returns what could not be hooked on this torch, which the tracer writes as a note in
every trace (so a report never says "no divergence" about collectives it could not see).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from harness.rank.collective_ops import C10D_DISPATCHED, FUNCTIONAL_DISPATCHED, DispatchedSpec

__all__ = ["OnDispatch", "OnWait", "install"]

OnDispatch = Callable[[DispatchedSpec, Callable[[], Any], tuple, dict, dict[str, int]], Any]
"""Called for each hooked op: (its spec, a callable that runs torch's kernel, its positional and
keyword arguments, and the positions of its schema's arguments by name)."""
OnWait = Callable[[torch.Tensor], None]
"""Called after `_c10d_functional::wait_tensor` returned, with the tensor waited for."""

_libraries: list[Any] = []
"""The registrations' libraries: a registration lives as long as its library object."""
_installed: list[str] | None = None


def install(on_dispatch: OnDispatch, on_wait: OnWait) -> list[str]:
    """Hook every op of the tables in `harness.rank.collective_ops` (once per process); returns the
    ops that could not be hooked on this torch, each with why (empty when all were)."""
    global _installed
    if _installed is not None:
        return _installed
    missing: list[str] = []
    for namespace, table in (("c10d", C10D_DISPATCHED), ("_c10d_functional", FUNCTIONAL_DISPATCHED)):
        try:
            library = torch.library.Library(namespace, "IMPL")
        except Exception as error:  # noqa: BLE001 - a torch without the namespace: said in the note
            missing.append(f"{namespace}::* ({type(error).__name__}: {error})")
            continue
        _libraries.append(library)
        for name, spec in table.items():
            op = _overload(namespace, name)
            if op is None:
                continue  # this torch has no such op: nothing can call it either
            try:
                _register(library, name, _kernel(op, spec, on_dispatch))
            except Exception as error:  # noqa: BLE001 - one op that cannot be hooked is named, the rest go on
                missing.append(f"{namespace}::{name} ({type(error).__name__}: {error})")
        if namespace == "_c10d_functional":
            wait = _overload(namespace, "wait_tensor")
            if wait is not None:
                try:
                    _register(library, "wait_tensor", _wait_kernel(wait, on_wait))
                except Exception as error:  # noqa: BLE001 - as above
                    missing.append(f"{namespace}::wait_tensor ({type(error).__name__}: {error})")
    _installed = missing
    return missing


def _overload(namespace: str, name: str) -> Any:
    try:
        return getattr(getattr(torch.ops, namespace), name).default
    except (AttributeError, RuntimeError):
        return None


def _register(library: Any, name: str, kernel: Callable[..., Any]) -> None:
    with warnings.catch_warnings():
        # Functional collectives have an autograd-key entry of their own (their composite kernel's
        # alias); torch warns once that it is overridden. The kernel below hands on to the same
        # composite kernel, below autograd.
        warnings.simplefilter("ignore")
        # with_keyset: the kernel gets the call's dispatch keys and redispatches below autograd
        # with them (`OpOverload.redispatch`), half the cost of calling the op again under an
        # `_AutoDispatchBelowAutograd` guard (bench/trace_overhead.py).
        library.impl(name, kernel, "Autograd", with_keyset=True)


def _kernel(op: Any, spec: DispatchedSpec, on_dispatch: OnDispatch) -> Callable[..., Any]:
    positions = {argument.name: index for index, argument in enumerate(op._schema.arguments)}
    below_autograd = torch._C._after_autograd_keyset
    redispatch = op.redispatch

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        def run() -> Any:
            return redispatch(keyset & below_autograd, *args, **kwargs)

        return on_dispatch(spec, run, args, kwargs, positions)

    kernel.__name__ = f"harness_traced_{spec.op.replace('.', '_')}"
    return kernel


def _wait_kernel(op: Any, on_wait: OnWait) -> Callable[..., Any]:
    below_autograd = torch._C._after_autograd_keyset
    redispatch = op.redispatch

    def wait_kernel(keyset: Any, tensor: torch.Tensor) -> Any:
        result = redispatch(keyset & below_autograd, tensor)
        on_wait(tensor)
        return result

    return wait_kernel
