"""Deliberately broken backends: every built-in adapter with one defect injected from outside.

A conformance suite is only as good as the bugs it catches. Each *mutation* here breaks a
backend the way real sharding bugs do, without touching the backend's code: through its public
behaviour (hooks on the module ``shard()`` returns, a global optimizer hook, the unshard
context), or by corrupting the collectives it issues through the harness's collective trace
(``harness.rank.tracing.set_interceptor``, the hook ``harness.rank.faults`` is built on; the harness clears
it after every test). ``tests/conformance_tests/test_mutants.py`` runs the scenarios that must catch
each mutation and checks that they fail naming a parameter and the size of its difference.

The classes are also module attributes named ``<backend>__<mutation>``
(``torch_fsdp2__sum_grads``), so a whole run can use one: ``--backend
mutant_backends:torch_fsdp2__sum_grads`` with this directory on ``PYTHONPATH`` (and an empty
``--expectations-dir``: their ``name`` is ``<backend>+<mutation>``, which has no file).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from conformance.protocol import (
    ApiForm,
    BackendAdapter,
    BackendEnv,
    ShardingSpec,
    UnshardRequest,
    declared_fqn,
)
from conformance.suite import registry
from harness.rank import tracing

REDUCE_SCATTER_OPS = frozenset({"reduce_scatter_tensor", "reduce_scatter", "funcol.reduce_scatter"})
ALL_GATHER_OPS = frozenset({"all_gather_into_tensor", "all_gather", "funcol.all_gather"})
STALE_RANK = 1

MUTATIONS: dict[str, str] = {
    "sum_grads": "gradients summed over ranks instead of averaged",
    "doubled_reduce_scatter": "every reduce-scatter's output doubled",
    "swapped_all_gather": "the chunks of ranks 0 and 1 swapped in every all-gather's output",
    "zeroed_all_gather": "rank 1's chunk zeroed in every all-gather's output",
    "stale_shard": f"rank {STALE_RANK}'s shards never take an optimizer step",
    "stale_unshard_view": f"rank {STALE_RANK}'s unshard view shows the parameters as sharded",
}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


# -- collective corruption -----------------------------------------------------------------


def _chunks(outputs: list[torch.Tensor], group_size: int) -> list[torch.Tensor] | None:
    """The per-rank pieces of an all-gather's output: the list itself, or equal slices of one
    contiguous output tensor (None when the output cannot be sliced in place)."""
    if len(outputs) == group_size:
        return outputs
    if len(outputs) == 1 and outputs[0].is_contiguous() and outputs[0].numel() % group_size == 0:
        return list(outputs[0].view(-1).chunk(group_size))
    return None


def _completed_work() -> Any:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(None)
    return torch._C._distributed_c10d._create_work_from_future(future)


def _corrupting(ops: frozenset[str], corrupt: Callable[[list[torch.Tensor], int], None]) -> tracing.Interceptor:
    """An interceptor that issues every collective in ``ops`` and then ``corrupt``s its
    floating-point outputs (``corrupt(outputs, group size)``), on every rank alike. Integer
    outputs (a backend's own order checks) are left alone: the mutation is about values.

    An async call is completed here and answered with an already completed work: gloo copies
    an async reduce-scatter's result into the output again at every ``wait()``, which would
    undo a corruption made before the caller's own wait.
    """

    def run(call: tracing.CollectiveCall) -> Any:
        result = call.issue()
        outputs = [t for t in call.output_tensors(result) if t.is_floating_point()]
        with torch.no_grad():
            if outputs:
                corrupt(outputs, len(call.record.group))
        if call.async_op and not call.spec.functional and result is not None:
            return _completed_work()
        return result

    def intercept(record: tracing.CollectiveRecord) -> tracing.Runner | None:
        return run if record.op in ops else None

    return intercept


def _double(outputs: list[torch.Tensor], group_size: int) -> None:
    for tensor in outputs:
        tensor.mul_(2)


def _swap_first_two(outputs: list[torch.Tensor], group_size: int) -> None:
    chunks = _chunks(outputs, group_size) if group_size > 1 else None
    if chunks is not None:
        first = chunks[0].clone()
        chunks[0].copy_(chunks[1])
        chunks[1].copy_(first)


def _zero_second(outputs: list[torch.Tensor], group_size: int) -> None:
    chunks = _chunks(outputs, group_size) if group_size > 1 else None
    if chunks is not None:
        chunks[1].zero_()


INTERCEPTORS: dict[str, tracing.Interceptor] = {
    "doubled_reduce_scatter": _corrupting(REDUCE_SCATTER_OPS, _double),
    "swapped_all_gather": _corrupting(ALL_GATHER_OPS, _swap_first_two),
    "zeroed_all_gather": _corrupting(ALL_GATHER_OPS, _zero_second),
}


# -- behaviour-level mutations -------------------------------------------------------------


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by ``factor``."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


# Global optimizer hooks of stale-shard mutants: removed when the next mutant is built and by
# whoever ran the mutant (remove_step_hooks), so one test's hook never acts in the next.
_step_hooks: list[Any] = []


def remove_step_hooks() -> None:
    """Remove the stale-shard optimizer hooks registered so far."""
    while _step_hooks:
        _step_hooks.pop().remove()


def _keep_shards_stale(sharded: nn.Module) -> None:
    """After every optimizer step over ``sharded``'s parameters, put rank 1's shards back."""
    params = list(sharded.parameters())
    initial = [_local(p).detach().clone() for p in params]
    ids = {id(p) for p in params}

    def restore(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if not stepped & ids:
            return
        with torch.no_grad():
            for param, value in zip(params, initial):
                local = _local(param)
                if local.shape == value.shape:
                    local.copy_(value)

    _step_hooks.append(register_optimizer_step_post_hook(restore))


def mutant_name(base: type[BackendAdapter], mutation: str, known: Mapping[str, str]) -> str:
    """The adapter name of ``base``'s mutant with ``mutation``; a ValueError naming the known
    mutations when ``mutation`` is not one of ``known``."""
    if mutation not in known:
        raise ValueError(f"unknown mutation {mutation!r}; known: {sorted(known)}")
    return f"{base.name}+{mutation.replace('_', '-')}"


def named_class(mutant_cls: type[BackendAdapter], base: type[BackendAdapter], mutation: str) -> type[BackendAdapter]:
    """``mutant_cls`` with a class name that says its base and mutation (in reprs and reports)."""
    mutant_cls.__name__ = mutant_cls.__qualname__ = f"{base.__name__}_{mutation}"
    return mutant_cls


def mutant(base: type[BackendAdapter], mutation: str) -> type[BackendAdapter]:
    """``base`` with ``mutation`` (a key of :data:`MUTATIONS`)."""

    class Mutant(base):  # type: ignore[valid-type, misc]
        name = mutant_name(base, mutation, MUTATIONS)

        def __init__(self, env: BackendEnv) -> None:
            super().__init__(env)
            remove_step_hooks()
            self._as_sharded: dict[str, torch.Tensor] = {}

        def _shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
            # The parameters before sharding: what a stale full view shows.
            self._as_sharded = {n: p.detach().clone() for n, p in model.named_parameters()}
            sharded = super()._shard(model, spec, form)
            if mutation in INTERCEPTORS:
                tracing.set_interceptor(INTERCEPTORS[mutation])
            elif mutation == "sum_grads":
                factor = float(dist.get_world_size())
                sharded.register_forward_hook(lambda module, args, out: _ScaleGrad.apply(out, factor))
            elif mutation == "stale_shard" and self.env.rank == STALE_RANK:
                _keep_shards_stale(sharded)
            return sharded

        @contextlib.contextmanager
        def _unshard(self, model: nn.Module, request: UnshardRequest) -> Iterator[None]:
            with super()._unshard(model, request):
                if mutation != "stale_unshard_view" or self.env.rank != STALE_RANK:
                    yield
                    return
                with _stale_view(self, model):
                    yield

    return named_class(Mutant, base, mutation)


@contextlib.contextmanager
def _stale_view(adapter: Any, model: nn.Module) -> Iterator[None]:
    """Show the parameters as they were before sharding; put back on exit whatever the caller
    did not change, so only the view is stale (writeback does not persist the stale values)."""
    shown = {declared_fqn(adapter, n): p for n, p in model.named_parameters()}
    stale = {
        name: value for name, value in adapter._as_sharded.items() if name in shown and shown[name].shape == value.shape
    }
    real = {name: shown[name].detach().clone() for name in stale}
    with torch.no_grad():
        for name, value in stale.items():
            shown[name].copy_(value.to(shown[name].device, shown[name].dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            for name, value in stale.items():
                if torch.equal(shown[name], value.to(shown[name].device, shown[name].dtype)):
                    shown[name].copy_(real[name])


def _attribute(backend: str, mutation: str) -> str:
    return f"{backend.replace('-', '_')}__{mutation}"


for _backend in registry.BUILTIN:
    for _mutation in MUTATIONS:
        globals()[_attribute(_backend, _mutation)] = mutant(registry.load(_backend), _mutation)


def selection(backend: str, mutation: str) -> str:
    """The ``--backend`` value of ``backend`` with ``mutation``."""
    return f"{__name__}:{_attribute(backend, mutation)}"
