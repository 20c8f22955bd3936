"""The full parameters gathered on the root with unshard's options: ``Unshard(writeback,
rank0_only, offload_to_cpu, with_grads, write)``."""

from __future__ import annotations

import itertools

import torch

import fixtures
from conformance.programs.export.uses import unshard_parameters
from conformance.programs.operations import handler
from conformance.programs.program import Unshard
from conformance.protocol import Holding, Phase, ShardingStrategy, storage_claim

WRITE = 0.01
"""What a write inside unshard adds to every parameter."""


class UnshardHandler(handler.OperationHandler):
    kind = Unshard

    def examples(self) -> list[Unshard]:
        return [
            Unshard(writeback, rank0_only, offload, grads, write)
            for writeback, rank0_only, offload, grads, write in itertools.product((False, True), repeat=5)
            if not (write and not writeback)
        ]

    def choices(self, context: handler.DrawContext, state: handler.DrawState) -> list[Unshard]:
        if context.two_d:
            return []
        return [u for u in _options(context) if not u.with_grads or state.grads_exist]

    def advance(self, state: handler.DrawState, op: Unshard) -> None:
        pass  # a write moves parameters, which no operation's precondition reads

    def facts(self, op: Unshard) -> handler.OperationFacts:
        return handler.OperationFacts(writes_parameters=op.write)

    def oracle(self, shadow: handler.Shadow, op: Unshard) -> None:
        if op.write:
            shadow.add_to_parameters(WRITE)

    def run(self, run: handler.ProgramRun, op: Unshard) -> bool:
        expected = run.shadow.params()
        expected_grads = run.shadow.grads()
        with run.adapter.unshard(
            run.sharded,
            writeback=op.writeback,
            rank0_only=op.rank0_only,
            offload_to_cpu=op.offload_to_cpu,
            with_grads=op.with_grads,
        ):
            if not op.rank0_only or run.rank == 0:
                shown = run.shown(grads=False)
                run.compare(shown, expected, run.bounds.params, "full parameters inside unshard")
                if op.with_grads and expected_grads:
                    run.compare_grads(run.shown(grads=True), "gradients inside unshard")
            if op.write:
                with torch.no_grad():
                    for param in run.sharded.parameters():
                        param.add_(WRITE)
        self.oracle(run.shadow, op)
        if op.write:
            run.check_params("after the write inside unshard(writeback=True)")
        return False

    def script_lines(self, uses: handler.Uses, op: Unshard) -> list[str]:
        options = ", ".join(f"{name}=True" for name in unshard_parameters(uses) if getattr(op, name))
        return [f"run.unshard({options})"]


def _options(context: handler.DrawContext) -> list[Unshard]:
    """Every unshard the backend admits with this program's setup, simplest first."""
    setup = context.setup
    if setup.param_dtype is not None:
        return []  # what unshard shows under mixed precision is a backend fact of its own
    # Units whose parameters are whole on every rank at rest: NO_SHARD and ZeRO-1/2, or
    # HYBRID_SHARD with shard groups of one rank (a world of 2 on one host: a (2, 1) mesh).
    strategies = {s for s in (setup.strategy, setup.other_strategy) if s is not None}
    world_size = context.world_size
    unsharded_units = any(storage_claim(s).parameters[Phase.AT_REST] is Holding.WHOLE for s in strategies) or (
        ShardingStrategy.HYBRID_SHARD in strategies and fixtures.hybrid_shard_group_size(world_size, world_size) == 1
    )
    options = []
    for writeback in (False, True):
        for rank0_only in (False, True):
            for offload_to_cpu in (False, True):
                for with_grads in (False, True):
                    if writeback and rank0_only:
                        continue  # a misuse the backends refuse (Misuse.UNSHARD_RANK0_ONLY_WITH_WRITEBACK)
                    if with_grads and (setup.offload_params or offload_to_cpu):
                        continue  # torch FSDP1 gathers offloaded gradients into device buffers only
                    if offload_to_cpu and unsharded_units:
                        continue  # a misuse the backends refuse (Misuse.UNSHARD_OFFLOAD_TO_CPU_NO_SHARD)
                    for write in (False, True) if writeback else (False,):
                        op = Unshard(writeback, rank0_only, offload_to_cpu, with_grads, write)
                        if context.admits(op.requirements()):
                            options.append(op)
    return options
