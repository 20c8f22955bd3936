"""Helpers shared by the torch adapters (names through wrappers, event recording)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from conformance.protocol import BackendAdapter, ShardEvent, StateDictKind, strip_path_components, submodule

# Path components wrappers insert between a module and its children: for finding a unit by its
# original FQN (not for judging names: scenarios strip only an adapter's WRAPPER_COMPONENTS).
_WRAPPER_COMPONENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def dcp_options(kind: StateDictKind) -> StateDictOptions:
    """torch.distributed.checkpoint's options for one of our state dict kinds."""
    return StateDictOptions(full_state_dict=kind is StateDictKind.FULL)


def dcp_save(adapter: BackendAdapter, model: nn.Module, optim: torch.optim.Optimizer, directory: str) -> None:
    """The native checkpoint of a backend whose sharded state dicts are DTensors or
    ShardedTensors: torch.distributed.checkpoint over the sharded model and optimizer state."""
    state = {
        "model": adapter.state_dict(model, StateDictKind.SHARDED),
        "optim": adapter.optim_state_dict(model, optim, StateDictKind.SHARDED),
    }
    dcp.save(state, checkpoint_id=directory)


def dcp_load(adapter: BackendAdapter, model: nn.Module, optim: torch.optim.Optimizer, directory: str) -> None:
    """Load what :func:`dcp_save` wrote: DCP fills this model's sharded state in place."""
    state = {
        "model": adapter.state_dict(model, StateDictKind.SHARDED),
        "optim": adapter.optim_state_dict(model, optim, StateDictKind.SHARDED),
    }
    dcp.load(state, checkpoint_id=directory)
    adapter.load_state_dict(model, state["model"], StateDictKind.SHARDED)
    adapter.load_optim_state_dict(model, optim, state["optim"], StateDictKind.SHARDED)


class TorchAdapter(BackendAdapter):
    """What the torch adapters share: optimizer state goes through torch.distributed.checkpoint,
    which both FSDP versions support."""

    def _optim_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, kind: StateDictKind) -> dict[str, Any]:
        return get_optimizer_state_dict(model, optim, options=dcp_options(kind))

    def _load_optim_state_dict(
        self,
        model: nn.Module,
        optim: torch.optim.Optimizer,
        state_dict: Mapping[str, Any],
        kind: StateDictKind,
    ) -> None:
        set_optimizer_state_dict(model, optim, dict(state_dict), options=dcp_options(kind))

    def _save_checkpoint(self, model: nn.Module, optim: torch.optim.Optimizer, directory: str) -> None:
        dcp_save(self, model, optim, directory)

    def _load_checkpoint(self, model: nn.Module, optim: torch.optim.Optimizer, directory: str) -> None:
        dcp_load(self, model, optim, directory)


def clean_fqn(fqn: str) -> str:
    """The original model's FQN for a name seen through FSDP1 wrappers."""
    return strip_path_components(fqn, _WRAPPER_COMPONENTS)


def parent_and_name(model: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    """The module holding the child at ``fqn`` and the child's attribute name."""
    parent_fqn, _, name = fqn.rpartition(".")
    return submodule(model, parent_fqn), name


@contextlib.contextmanager
def record_transitions(
    watched: Iterable[tuple[str, Any, tuple[str, ...], Callable[[], bool]]],
) -> Iterator[list[ShardEvent]]:
    """Record unshard/reshard state changes of backend objects, by unit FQN.

    ``watched`` holds (unit FQN, object, names of its methods that may change the state,
    probe returning True while unsharded). Each method is shadowed on the instance for the
    duration; a call that flips the probe appends one event. Calls that change nothing (the
    backend's no-op re-entries) are not events, so backends that guard differently compare
    equal.
    """
    events: list[ShardEvent] = []
    patched: list[tuple[Any, str]] = []

    def tracking(unit: str, method: Callable[..., Any], probe: Callable[[], bool]):
        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            before = probe()
            result = method(*args, **kwargs)
            after = probe()
            if after != before:
                events.append(ShardEvent("unshard" if after else "reshard", unit))
            return result

        return call

    try:
        for unit, obj, method_names, probe in watched:
            for method_name in method_names:
                setattr(obj, method_name, tracking(unit, getattr(obj, method_name), probe))
                patched.append((obj, method_name))
        yield events
    finally:
        for obj, method_name in patched:
            delattr(obj, method_name)  # uncover the class attribute again
