"""Semantic labels for collectives: which unit (FQNs) a rank meant when it issued one.

Two same-shaped collectives of different units (rank 0 all-gathers `layer1`, rank 1 `layer2`)
only differ in their label, so the trace diff is as good as the labels. Sources, first wins:

  1. label providers: callables returning a label or None, registered with
     `register_label_provider` or listed as `module:attr` in the `collective_label_providers`
     ini option (loaded in every rank by `load_label_providers`). Backends that issue
     collectives outside any module forward (FSDP's backward gathers and reduce-scatters) name
     them this way;
  2. the FQN of the innermost running module forward, relative to the outermost one, from a
     per-thread stack kept by global forward hooks (`track_module_forwards`);
  3. outside any forward (or in the outermost one), the torch FSDP1 / FSDP2 unit being gathered or
     reduced, from `harness.rank.torch_fsdp_labels`, for any test that uses torch FSDP.
"""

from __future__ import annotations

import importlib
import itertools
import threading
import weakref
from collections.abc import Callable

import torch
import torch.nn.modules.module as nn_module

from harness.rank import ddp_buckets, tensor_names, torch_fsdp_labels

LabelProvider = Callable[[], "str | None"]

_providers: list[LabelProvider] = []
# (id(parent), id(child)) -> (weak parent, weak child, path): ids are only trusted while both
# referents are alive, so a recycled id never returns a stale path.
_child_paths: dict[tuple[int, int], tuple[weakref.ref, weakref.ref, str | None]] = {}
_tracking = False


class _ModuleStack(threading.local):
    """The module forwards running on this thread, outermost first."""

    def __init__(self) -> None:
        self.modules: list[torch.nn.Module] = []


_stack = _ModuleStack()


def register_label_provider(provider: LabelProvider) -> Callable[[], None]:
    """Add a source of semantic labels (e.g. a backend adapter naming the FQNs being gathered).

    The first provider returning a non-None string labels the collective; otherwise the label is the
    FQN of the innermost running module forward. Returns a function that removes the provider.
    """
    _providers.append(provider)

    def remove() -> None:
        if provider in _providers:
            _providers.remove(provider)

    return remove


def load_label_providers(specs: tuple[str, ...]) -> None:
    """Register `module:attr` callables (the `collective_label_providers` ini option)."""
    for spec in specs:
        module_name, _, attr = spec.partition(":")
        try:
            provider = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as error:
            raise RuntimeError(
                f"collective label provider {spec!r} cannot be loaded ({error}); "
                "fix the 'collective_label_providers' ini option"
            ) from error
        register_label_provider(provider)


def track_module_forwards() -> None:
    """Keep the per-thread stack of running module forwards (idempotent, process-wide)."""
    global _tracking
    if _tracking:
        return
    nn_module.register_module_forward_pre_hook(_push_module)
    # always_call: a forward that raises still pops, or every later label would be wrong.
    nn_module.register_module_forward_hook(_pop_module, always_call=True)
    _tracking = True


def current_label() -> str:
    """The label of a collective issued now, on this thread."""
    for provider in _providers:
        label = provider()
        if label is not None:
            return label
    # An FSDP2 unit's all-gather or reduce-scatter is named by its parameters, in forward too
    # (torch_fsdp_labels.gathering_unit). Else a running forward names its own collectives (FSDP1's
    # pre-forward gathers included); outside one (FSDP1's backward), the unit FSDP is working on.
    return torch_fsdp_labels.gathering_unit() or module_label(_stack.modules) or torch_fsdp_labels.current_label() or ""


def begin_test() -> None:
    """Start a test's labels: forget the last test's state, and wrap the FSDP entry points torch
    has imported by now rather than at this test's first outermost forward.

    Otherwise whether an FSDP collective issued before any forward (an unshard right after
    sharding) is labelled by unit would depend on whether this process ran a forward since it
    imported FSDP, in any earlier test: a rank that ran a reference forward alone (rank 0) would
    label it and the others not."""
    reset()
    try:
        torch_fsdp_labels.maybe_install()
    except Exception:  # noqa: BLE001 - labels are never worth failing a test (as in _push_module)
        pass


def reset() -> None:
    """Forget this thread's module stack, the cached module paths and tensor names (between tests)."""
    _stack.modules.clear()
    _child_paths.clear()
    tensor_names.reset()
    ddp_buckets.reset()
    torch_fsdp_labels.reset()


def module_label(modules: list[torch.nn.Module]) -> str:
    """FQN of the innermost running module relative to the outermost one, wrapper segments dropped."""
    # A module called on its own (not from its container's forward) is named by its path under
    # a container the test registered with `harness.name_tensor(model)`, if any.
    outermost = tensor_names.named_path(modules[0]) if modules else ""
    parts: list[str] = [outermost] if outermost else []
    for parent, child in itertools.pairwise(modules):
        if parent is child:
            continue
        path = _child_path(parent, child)
        if path is None:  # called from outside its parent's tree: name it from here on by type
            parts = [type(child).__name__]
        elif path:
            parts.append(path)
    return tensor_names.strip_path_components(".".join(parts))


def _child_path(parent: torch.nn.Module, child: torch.nn.Module) -> str | None:
    key = (id(parent), id(child))
    cached = _child_paths.get(key)
    if cached is not None and cached[0]() is parent and cached[1]() is child:
        return cached[2]
    path = next((name for name, sub in parent.named_modules(remove_duplicate=False) if sub is child), None)
    _child_paths[key] = (weakref.ref(parent), weakref.ref(child), path)
    return path


def _push_module(module: torch.nn.Module, _inputs: object) -> None:
    if not _stack.modules:  # an outermost forward: its tensors can be named in the trace
        try:
            tensor_names.note_outermost_module(module)
            torch_fsdp_labels.maybe_install()  # before FSDP's own pre-forward hooks gather anything
        except Exception:  # noqa: BLE001 - this hook runs inside the user's forward: never break it
            pass
    _stack.modules.append(module)


def _pop_module(module: torch.nn.Module, _inputs: object, _output: object) -> None:
    modules = _stack.modules
    if modules and modules[-1] is module:
        modules.pop()
        if not modules:  # an outermost forward ended: a DDP module's buckets are reduced next, from C++
            try:
                ddp_buckets.note_forward(module)
            except Exception:  # noqa: BLE001 - as in _push_module
                pass
        return
    for position in range(len(modules) - 1, -1, -1):  # unbalanced after an exception elsewhere
        if modules[position] is module:
            del modules[position]
            return
