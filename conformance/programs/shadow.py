"""The single-process oracle of a generated program: the same operations on one unsharded model.

Data parallelism over N ranks optimises the mean of the ranks' local losses; the shadow runs
each backward pass as ``fixtures.oracle_pass`` does (every rank's batch, the rank-averaged
gradient added; under mixed precision each rank's pass in low precision, averaged in the
reduction dtype), and every other operation as plain torch does it. Each rank runs its own
shadow next to the backend (CPU, float32 masters), so the checks after each operation are local.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch

import fixtures
from conformance.programs.model import GeneratedModel, build_model
from conformance.programs.program import LOCAL_BATCH, Program
from conformance.programs.tolerances import dtype_named
from conformance.protocol import ParameterGroups

# The learning rate the per-dtype bounds were measured with (conformance/test_training_numerics.py):
# a doubled, dropped or overwritten gradient moves parameters far beyond them.
SGD_LR = 1e-3
ADAM_LR = 1e-3
EVAL_ITERATIONS = 1_000_000
"""Eval forwards read data iterations from here on, apart from the training passes' iterations."""
FRESH_SEED_OFFSET = 7919
"""A model built to load a checkpoint into starts from other values (seed + this)."""


WEIGHT_DECAY = 0.1
"""A parameter-group program's weight decay for weights (biases: none)."""


def no_decay_for_biases(fqn: str) -> str:
    return "no_decay" if fqn.endswith("bias") else "decay"


PARAMETER_GROUPS = ParameterGroups(
    group_of=no_decay_for_biases,
    options={"decay": {"weight_decay": WEIGHT_DECAY}, "no_decay": {"weight_decay": 0.0}},
)
"""The groups of a program with ``Setup.param_groups``: a backend that drops them steps every
weight without its decay."""


def make_optimizer(kind: str, params: Iterable[Any]) -> torch.optim.Optimizer:
    """The program's optimizer: picklable by name, so the ranks and the oracle build the same."""
    if kind == "adam":
        return torch.optim.Adam(params, lr=ADAM_LR)
    return torch.optim.SGD(params, lr=SGD_LR)


class Shadow:
    def __init__(self, program: Program) -> None:
        self.program = program
        self.device = torch.device("cpu")
        self.model: GeneratedModel = build_model(program.model, program.seed, self.device)
        self.optimizer = self._make_optimizer()
        dtype = dtype_named(program.setup.param_dtype)
        self.precision = (
            None if dtype is None else fixtures.Precision(dtype, torch.float32 if program.setup.reduce_fp32 else None)
        )
        self.iteration = 0
        self.evals = 0

    def _make_optimizer(self) -> torch.optim.Optimizer:
        params: Iterable[Any] = self.model.parameters()
        if self.program.setup.param_groups:
            params = PARAMETER_GROUPS.split(self.model.named_parameters())
        return make_optimizer(self.program.setup.optimizer, params)

    def backward(self) -> list[float]:
        """One forward + backward pass of every data rank; returns their losses."""
        losses = fixtures.oracle_pass(
            self.model,
            seed=self.program.seed,
            iteration=self.iteration,
            world_size=self.program.data_parallel_size,
            batch_size=LOCAL_BATCH,
            extra_rows_per_rank=self.program.extra_rows_per_rank,
            device=self.device,
            precision=self.precision,
        )
        self.iteration += 1
        return losses.tolist()

    def eval_losses(self) -> list[float]:
        """Every data rank's loss of one forward under no_grad, in the model's current mode."""
        compute = self.model
        if self.precision is not None:
            compute = copy.deepcopy(self.model)  # parameters in low precision, buffers kept, as the backends do
            with torch.no_grad():
                for param in compute.parameters():
                    param.data = param.data.to(self.precision.param_dtype)
        losses = []
        with torch.no_grad():
            for rank in range(self.program.data_parallel_size):
                (x,) = fixtures.local_batch(
                    compute,
                    seed=self.program.seed,
                    iteration=EVAL_ITERATIONS + self.evals,
                    rank=rank,
                    batch_size=self.program.batch_size(rank),
                    device=self.device,
                )
                if self.precision is not None:
                    x = x.to(self.precision.param_dtype)
                losses.append(compute.loss(compute(x)).item())
        self.evals += 1
        return losses

    def zero_grad(self, set_to_none: bool) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.optimizer.step()

    def grad_norm(self) -> float:
        """The total 2-norm of the gradients (the averaged ones a single process holds)."""
        grads = [p.grad.detach().reshape(-1) for p in self.model.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.cat(grads))) if grads else 0.0

    def clip(self, max_norm: float) -> float:
        """Clip the gradients to total norm ``max_norm`` as torch does; the norm before."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def set_mode(self, train: bool) -> None:
        self.model.train(train)

    def swap_route(self) -> None:
        self.model.swapped = not self.model.swapped

    def add_to_parameters(self, value: float) -> None:
        with torch.no_grad():
            for param in self.model.parameters():
                param.add_(value)

    def reload(self, keep_optimizer: bool) -> None:
        """A save and load into a fresh model: values kept, gradients gone, the optimizer's state
        kept only with it (a native checkpoint)."""
        for param in self.model.parameters():
            param.grad = None
        if not keep_optimizer:
            self.optimizer = self._make_optimizer()

    def round_to(self, names: set[str], dtype: torch.dtype | None) -> None:
        """Round the named parameters to ``dtype`` (what a state dict in that dtype restores)."""
        if dtype is None or not names:
            return
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if name in names:
                    param.copy_(param.to(dtype).float())

    def state(self) -> dict[str, torch.Tensor]:
        return {name: value.detach().clone() for name, value in self.model.state_dict().items()}

    def params(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}

    def grads(self) -> dict[str, torch.Tensor]:
        return {name: p.grad.detach().clone() for name, p in self.model.named_parameters() if p.grad is not None}
