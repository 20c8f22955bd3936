"""`ShardedOptimizer`: the optimizer of a model with SHARD_OPTIM_STATE (ZeRO-1) or
SHARD_GRAD_AND_OPTIM_STATE (ZeRO-2) units.

Each rank's inner optimizer is built over this rank's partition of every such unit
(`partition.OptimPartition.params`) instead of the unit's replicated parameters, so it creates
state only for its chunk; parameters of units with other strategies (already sharded, or NO_SHARD)
and unmanaged parameters are passed through unchanged.  `step()` hands each ZeRO-1 partition its
piece of the averaged gradients (a ZeRO-2 partition stores its gradient already), steps the inner
optimizer, then all-gathers the updated chunks into the replicated parameters (one all-gather per
unit, issued together and waited in order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

from engine.partition import OptimPartition
from engine.state import unit_of
from engine.unit import ShardedUnit

# Builds the inner optimizer from parameters or parameter groups, as torch optimizers take them:
# e.g. functools.partial(torch.optim.Adam, lr=1e-3).
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


class ShardedOptimizer:
    """``ShardedOptimizer(model, make_optimizer, params=None)``.

    ``params``: what you would give a torch optimizer for ``model`` (an iterable of parameters or
    of parameter-group dicts); default ``model.parameters()``.  Each parameter of a
    SHARD_OPTIM_STATE or SHARD_GRAD_AND_OPTIM_STATE unit is replaced by this rank's partition of
    it (with flat parameters, a unit's ``_flat_param`` by the unit's partition chunk), and
    ``make_optimizer`` is called with the result.  The inner optimizer is ``.optimizer`` (give it to LR schedulers);
    ``param_groups``, ``state``, ``state_dict()`` and ``load_state_dict()`` are its own (per rank,
    partition parameters).  For state dicts keyed by FQNs use ``engine.optim_state_dict`` /
    ``engine.load_optim_state_dict``.  ``step()`` is collective: call it on every rank.
    """

    def __init__(self, model: nn.Module, make_optimizer: OptimizerFactory, params: Iterable[Any] | None = None) -> None:
        # Exposed (replicated) parameter -> (its unit, the partition parameters standing for it).
        replaced: dict[int, tuple[ShardedUnit, list[nn.Parameter]]] = {}
        for module in model.modules():
            unit = unit_of(module)
            partition = unit.optim_partition if unit is not None else None
            if partition is None:
                continue
            exposed = unit.optimizer_params
            if partition.flat:
                replaced[id(exposed[0])] = (unit, list(partition.params))
            else:
                for param, piece in zip(exposed, partition.params):
                    replaced[id(param)] = (unit, [piece])
        self._replicated: list[torch.Tensor] = []  # their gradients are cleared by zero_grad
        stepped: dict[int, ShardedUnit] = {}

        def translate(group_params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
            translated: list[torch.Tensor] = []
            for param in group_params:
                entry = replaced.get(id(param))
                if entry is None:
                    translated.append(param)
                    continue
                unit, pieces = entry
                stepped.setdefault(id(unit), unit)
                self._replicated.append(param)
                translated.extend(pieces)
            return translated

        given = list(model.parameters() if params is None else params)
        if given and isinstance(given[0], dict):
            inner_params: Any = [{**group, "params": translate(_as_list(group["params"]))} for group in given]
        else:
            inner_params = translate(given)
        # Units in model order, identical on every rank: the order of the all-gathers in step().
        self._units = list(stepped.values())
        self.optimizer = make_optimizer(inner_params)

    # -- what callers of a torch optimizer use -------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the partitions' gradients and the replicated parameters' (as torch does)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for param in self._replicated:
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:  # as torch.optim.Optimizer.zero_grad (gradients may be views: no detach_)
                grad = param.grad
                if grad.grad_fn is not None:
                    param.grad = grad = grad.detach()
                grad.requires_grad_(False)
                grad.zero_()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step this rank's partitions, then all-gather them into the replicated parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()  # its backward produces the gradients this step uses
        for unit in self._units:
            if unit.partitions_grads:  # ZeRO-2: the partition's gradients are stored already
                _partition(unit).refresh()
            else:
                _partition(unit).load_grads(unit.exposure.stored_grad_views())
        self.optimizer.step()
        gathers = [_partition(unit).start_gather(unit.label) for unit in self._units]
        try:
            for gather in gathers:
                gather.finish()
        except BaseException:
            for gather in gathers:
                gather.abandon()
            raise
        return loss

    def __repr__(self) -> str:
        return f"ShardedOptimizer({self.optimizer!r}, units={[unit.module_fqn for unit in self._units]})"


def _partition(unit: ShardedUnit) -> OptimPartition:
    partition = unit.optim_partition
    assert partition is not None  # only ZeRO-1 / ZeRO-2 units are stepped here
    return partition


def _as_list(params: Any) -> list[torch.Tensor]:
    return [params] if isinstance(params, torch.Tensor) else list(params)
