"""Deliberately broken backends for the unshard-params and checkpoint scenario families.

``mutant_backends`` breaks training (reductions, gathers, steps); the defects here are of the
kinds the unshard and checkpoint seeds were written for, each injected from outside the backend
(through the adapter protocol's storage accessors or, for freed memory, the storage the backend
itself reports), so the backend's own code stays untouched:

* ``leaked_unshard_buffer``: the unshard context marks its units resharded again on exit but
  leaves their gathered buffer's memory allocated (a reshard that forgets ``resize_(0)``). Only
  the exact storage check sees it where the backend's resharded flag is a state flag
  (reference, FSDP2); for FSDP1 the flag is the storage itself.
* ``writeback_ignored``: ``writeback=True`` persists nothing (the context discards changes as
  with ``writeback=False``: a writeback flag not passed on). On every rank alike, so that every
  rank fails at the same check and none runs on into collectives its peers never issue.
* ``loaded_one_ulp_off``: loading a state dict leaves one stored element one ulp off on every
  rank (a cast or copy that rounds).
* ``renamed_state_dict_key``: the state dict names one parameter with a wrapper component left
  in its key (a key cleaner that misses a path).

``tests/conformance_tests/test_unshard_checkpoint_mutants.py`` runs the scenarios that must catch each one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import mutant_backends  # tests/conformance_tests/mutant_backends.py
import torch
import torch.nn as nn

from conformance.protocol import BackendAdapter, StateDictKind, UnshardRequest

MUTATIONS: dict[str, str] = {
    "leaked_unshard_buffer": "the unshard context leaves its gathered buffers allocated after exit",
    "writeback_ignored": "writeback=True persists nothing",
    "loaded_one_ulp_off": "loading a state dict leaves one stored element one ulp off",
    "renamed_state_dict_key": "one state-dict key keeps a wrapper component",
}


# -- leaked unshard buffers: per backend, the buffer its storage report reads -------------------


def _gathered_buffers(adapter: BackendAdapter, model: nn.Module) -> list[torch.Tensor]:
    """Every buffer the backend gathers units into, allocated or not (the storage that
    ``unsharded_storage_numel`` reads)."""
    name = adapter.name.split("+")[0]
    if name == "reference":
        import engine

        return [unit._full for unit in engine.units(model) if unit.topology.shard_group is not None]
    if name == "torch-fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        handles = [m._handle for m in model.modules() if isinstance(m, FSDP) and m._handle is not None]
        return [h.flat_param._full_param_padded for h in handles if h.uses_sharded_strategy]
    if name == "torch-fsdp2":
        from torch.distributed.fsdp import FSDPModule

        from conformance.adapters.torch_fsdp2 import _param_groups

        return [
            output
            for module in model.modules()
            if isinstance(module, FSDPModule)
            for group in _param_groups(module)
            for fsdp_param in group.fsdp_params
            for output in fsdp_param.all_gather_outputs
        ]
    raise ValueError(f"leaked_unshard_buffer has no buffer accessor for {adapter.name}")


def _storage_sizes(buffers: list[torch.Tensor]) -> list[int]:
    return [buffer.untyped_storage().nbytes() for buffer in buffers]


# -- the mutant class ---------------------------------------------------------------------------


def mutant(base: type[BackendAdapter], mutation: str) -> type[BackendAdapter]:
    """``base`` with ``mutation`` (a key of :data:`MUTATIONS`)."""

    class Mutant(base):  # type: ignore[valid-type, misc]
        name = mutant_backends.mutant_name(base, mutation, MUTATIONS)

        @contextlib.contextmanager
        def _unshard(self, model: nn.Module, request: UnshardRequest) -> Iterator[None]:
            if mutation == "leaked_unshard_buffer":
                buffers = _gathered_buffers(self, model)
                with super()._unshard(model, request):
                    peak = _storage_sizes(buffers)
                    yield
                for buffer, size in zip(buffers, peak):
                    if buffer.untyped_storage().nbytes() < size:
                        buffer.untyped_storage().resize_(size)  # the memory comes back, unowned
                return
            if mutation == "writeback_ignored" and request.writeback:
                names = [self.original_fqn(name) for name, _ in model.named_parameters()]
                before = {name: self.local_shard(model, name) for name in names}
                with super()._unshard(model, request):
                    yield
                for name, value in before.items():
                    self.set_local_shard(model, name, value)
                return
            with super()._unshard(model, request):
                yield

        def _load_state_dict(self, model: nn.Module, state_dict: Mapping[str, Any], kind: StateDictKind) -> None:
            super()._load_state_dict(model, state_dict, kind)
            if mutation != "loaded_one_ulp_off":
                return
            for name, _ in model.named_parameters():
                fqn = self.original_fqn(name)
                stored = self.local_shard(model, fqn)
                if stored.numel():
                    flat = stored.reshape(-1)
                    flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype))
                    self.set_local_shard(model, fqn, stored)
                    return

        def _state_dict(self, model: nn.Module, kind: StateDictKind) -> dict[str, Any]:
            state = super()._state_dict(model, kind)
            if mutation != "renamed_state_dict_key" or not state:
                return state
            first = next(iter(state))
            parent, _, leaf = first.rpartition(".")
            renamed = f"{parent}._wrapped_module.{leaf}" if parent else f"_wrapped_module.{leaf}"
            return {(renamed if key == first else key): value for key, value in state.items()}

    return mutant_backends.named_class(Mutant, base, mutation)
