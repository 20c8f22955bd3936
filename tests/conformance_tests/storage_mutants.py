"""The storage family's mutant: a built-in adapter whose backend is replaced by plain DDP.

``replicating(base)`` keeps everything ``base`` declares (its strategies, forms, names) and
shards nothing: the wrapper form is torch's ``DistributedDataParallel``, the composable form
broadcasts the parameters from rank 0 and all-reduces (averages) each gradient as it is
accumulated, and the optimizer is the factory's own, over whole parameters. It trains exactly
like the single-process oracle, so every oracle comparison passes; only the storage claim of the
strategy it declares (``conformance/test_storage.py``, the vacuity check) can tell. The storage
hooks are the protocol's defaults, which read a plain module correctly, so what the scenario
reports is the backend's storage and not a broken introspection.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from conformance.protocol import ApiForm, BackendAdapter, BackendHooks, Capability, ShardingSpec

# Introspection the replicated model cannot answer in the base adapter's terms (its units,
# its unsharded buffers): left undeclared so scenarios read storage through the hooks only.
_UNIT_INTROSPECTION = frozenset(
    {
        Capability.INTROSPECT_STORAGE,
        Capability.INTROSPECT_UNSHARDED,
        Capability.INTROSPECT_UNIT_FQNS,
        Capability.INTROSPECT_EVENTS,
    }
)


def _replicate_in_place(model: nn.Module) -> nn.Module:
    """DDP without a wrapper: same start on every rank, gradients averaged as they accumulate."""
    world_size = dist.get_world_size()
    with torch.no_grad():
        for param in model.parameters():
            dist.broadcast(param, src=0)

    def average(param: torch.Tensor) -> None:
        dist.all_reduce(param.grad)
        param.grad.div_(world_size)

    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(average)
    return model


def replicating(base: type[BackendAdapter]) -> type[BackendAdapter]:
    """``base``'s declarations over plain data parallelism (see the module docstring)."""

    class ReplicatesEverything(base):  # type: ignore[valid-type, misc]
        name = f"{base.name}+ddp"
        WRAPPER_COMPONENTS = base.WRAPPER_COMPONENTS | {"module"}

        def capabilities(self) -> frozenset[Capability]:
            return super().capabilities() - _UNIT_INTROSPECTION

        def _shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
            if form is ApiForm.WRAPPER:
                return DistributedDataParallel(model)
            return _replicate_in_place(model)

        # Plain torch for the whole training loop and every storage read.
        make_optimizer = BackendHooks.make_optimizer
        zero_grad = BackendHooks.zero_grad
        backward = BackendHooks.backward
        step = BackendHooks.step
        named_parameter = BackendHooks.named_parameter
        local_shard = BackendHooks.local_shard
        local_grad_shard = BackendHooks.local_grad_shard
        local_optim_state = BackendHooks.local_optim_state
        collective_label = BackendHooks.collective_label

        def close(self) -> None:
            BackendHooks.close(self)

        def __repr__(self) -> str:  # pragma: no cover - shown in failures only
            return f"<{self.name}>"

    ReplicatesEverything.__name__ = ReplicatesEverything.__qualname__ = f"{base.__name__}ReplicatesEverything"
    return ReplicatesEverything


def _attribute(backend: str) -> str:
    return f"{backend.replace('-', '_')}__replicating"


def selection(backend: str) -> str:
    """The ``--backend`` value of built-in ``backend``'s replicating twin (this module is on
    ``sys.path`` as ``storage_mutants``: tests/conformance_tests is a test directory)."""
    return f"{__name__}:{_attribute(backend)}"


def __getattr__(name: str) -> type[BackendAdapter]:
    """``<backend>__replicating``: the twin of a built-in backend, built on first use (loading
    DeepSpeed's adapter only where it is selected)."""
    from conformance.suite import registry

    if name.endswith("__replicating"):
        backend = name[: -len("__replicating")].replace("_", "-")
        if backend in registry.BUILTIN or backend in registry.OPTIONAL_BUILTIN:
            return replicating(registry.load(backend))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
