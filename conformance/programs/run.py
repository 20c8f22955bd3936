"""Rank side: run a generated program on a backend, next to its oracle, checking after each operation.

:func:`run_program` is what the parent's SPMD call runs on every rank. It opens the backend as a
scenario's ``backend`` fixture does (``conformance.suite.backend_fixture.opened_backend``: labels,
call sites, vacuity), runs the operations through the adapter protocol and the same operations
on the rank's :class:`~conformance.programs.shadow.Shadow`, and checks, after each operation:

- the losses of every forward against the oracle's for this rank (per-dtype bounds);
- the parameters (a full state dict, or an unshard where that is what the backend has) after
  every step, load and write, and the gradients after backward where the backend shows them
  (``UNSHARD_WITH_GRADS``), against the oracle's;
- the storage claim of the strategy (``conformance.protocol.storage``) after backward and at rest
  after a step (original parameters only: flat buffers are ``test_unshard_params``'s);
- forward-order warnings where the backend declares ``EXEC_ORDER_CHECK`` and the program turns it
  on: in the first training pass whose order differs from the first iteration's (one per unit
  out of order: torch FSDP1 warns for each within that iteration), and in no other pass, eval
  forwards included; and a first iteration whose order differs between ranks
  refused.

Every check that issues a collective runs on every rank in the same order, whatever the others
found, so a finding never turns into a hang; findings are returned, not raised. What the backend
raises is raised (the harness reports it with the rank's traceback). The cross-rank trace diff is
the harness's (the parent asks for the trace).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fixtures
import harness
from conformance.programs.model import Block, GeneratedModel, build_model
from conformance.programs.operations import handler_for
from conformance.programs.program import TENSOR_PARALLEL_DEGREE, Program
from conformance.programs.shadow import FRESH_SEED_OFFSET, PARAMETER_GROUPS, Shadow, make_optimizer
from conformance.programs.storage_probe import StorageProbe
from conformance.programs.tolerances import bounds_for, dtype_named
from conformance.protocol import (
    BackendAdapter,
    Capability,
    DeferredInit,
    Phase,
    ShardingSpec,
    StateDictKind,
    Stored,
    declared_fqn,
)
from conformance.suite.backend_fixture import opened_backend
from conformance.suite.vacuity import StorageClaimNotMet
from fixtures.compare import Tolerance, differences, report

ORDER_WARNING = "Forward order differs from that of the first iteration"
"""The seed's later-iteration warning (FSDP1's), which a backend with EXEC_ORDER_CHECK issues."""


@dataclass
class ProgramReport:
    """One rank's account of a program: what it found wrong, how far it got."""

    rank: int
    findings: list[str] = field(default_factory=list)
    operations_run: int = 0
    refused: str = ""
    """The backend's error for a first iteration whose order differs between ranks (expected)."""
    unsupported: str = ""
    """The skip reason, when the adapter refused a program it declares support for."""
    sharded: bool = False
    """Whether the backend showed that it sharded anything (the vacuity evidence)."""
    raised_at: float | None = None
    """When the backend raised and the program ended early on this rank (``time.time()``; None
    when it did not): its peers may have gone on into collectives it never issued, and raised
    in turn, as a consequence."""
    root_cause: list[str] = field(default_factory=list)
    """What this rank found at the first operation it found anything at, as data: the check of
    each finding (``"the full state dict after the step"``, ``"SaveLoad raised KeyError"``), no
    numbers. A campaign tells findings apart by it; what the checks find after it is its
    consequence."""


def run_program(selection: str, program: Program) -> ProgramReport:
    """Run ``program`` on this rank with the ``--backend`` ``selection`` (an SPMD call)."""
    ctx = harness.call_context()
    return program_report(selection, program, rank=ctx.rank, device=ctx.device, local_rank=ctx.local_rank)


def program_report(
    selection: str, program: Program, *, rank: int, device: torch.device, local_rank: int
) -> ProgramReport:
    """Run ``program`` on this rank of a world of ``program.world_size`` and say what it found."""
    report = ProgramReport(rank=rank)
    with opened_backend(selection, rank=rank, world_size=program.world_size, device=device, local_rank=local_rank) as (
        adapter,
        watch,
    ):
        try:
            ProgramRun(adapter, program, report, rank, device).run()
        except pytest.skip.Exception as skipped:
            report.unsupported = str(skipped.msg)
            return report
        # One program need not show sharding (a forward and backward under DDP shows nothing
        # the suite can see); the generated test requires that some program of the run did.
        vacuous = watch.finding(body_passed=not report.refused)
        if isinstance(vacuous, StorageClaimNotMet):
            report.findings.append(f"rank {rank}, at the end: {vacuous}")
            if not report.root_cause:
                report.root_cause.append("the storage claim showed nothing sharded")
        report.sharded = vacuous is None and not report.refused
    return report


class ProgramRun:
    """One program on this rank: the sharded model, its oracle, and the checks every operation's
    rank step (``conformance.programs.operations``) runs after it. A step reads and sets the
    state below (the model, the oracle, the iteration counters, the first route) and reports
    through :meth:`find`; every check that issues a collective runs on every rank alike."""

    def __init__(
        self, adapter: BackendAdapter, program: Program, report: ProgramReport, rank: int, device: torch.device
    ):
        self.adapter = adapter
        self.program = program
        self.report = report
        self.rank = rank
        self.data_rank = program.data_rank(rank)
        self.world_size = program.world_size
        self.device = device
        self.setup = program.setup
        self.bounds = bounds_for(self.setup.param_dtype)
        self.shadow = Shadow(program)
        self.iteration = 0
        self.evals = 0
        self.spec = self._spec()
        self.frozen = frozenset(
            f"blocks.{index}.linear.{name}" for index in program.model.frozen for name in ("weight", "bias")
        )
        self.order_checked = self.setup.check_exec_order and self.setup.unit_plan != "none" and program.model.depth >= 2
        self.op_index = -1
        self.root_op: int | None = None  # the operation this rank first found something at

    # -- set-up -------------------------------------------------------------------------------
    def _spec(self) -> ShardingSpec:
        setup = self.setup
        fields: dict[str, Any] = {
            "strategy": setup.strategy,
            "param_dtype": dtype_named(setup.param_dtype),
            "reduce_dtype": torch.float32 if setup.reduce_fp32 else None,
            "offload_params": setup.offload_params,
            "use_orig_params": setup.use_orig_params,
            "check_exec_order": setup.check_exec_order,
        }
        if setup.unit_plan == "auto":
            fields["auto_wrap_classes"] = (Block,)
        elif setup.unit_plan != "none":
            fields["manual_units"] = self.program.unit_fqns()
        if setup.unit_plan == "mixed" and setup.other_strategy is not None:
            fields["strategy_overrides"] = {"blocks.0": setup.other_strategy}
        strategies = {setup.strategy, setup.other_strategy}
        if setup.tensor_parallel:
            # Built once per program: every model it shards (a fresh one per load) shares it.
            self.mesh_2d = init_device_mesh(
                self.device.type,
                (self.world_size // TENSOR_PARALLEL_DEGREE, TENSOR_PARALLEL_DEGREE),
                mesh_dim_names=("dp", "tp"),
            )
            fields["mesh"] = self.mesh_2d["dp"]
        elif any(s is not None and s.name == "HYBRID_SHARD" for s in strategies):
            fields["mesh"] = fixtures.hybrid_mesh(self.world_size, self.device)
        return ShardingSpec(**fields)

    def build(self, seed: int) -> None:
        """Build and shard the model (values from ``seed``) and make its optimizer."""
        model = build_model(self.program.model, seed, self.device)
        self.numels = {name: param.numel() for name, param in model.named_parameters()}
        if self.setup.tensor_parallel:
            plan = {"blocks.0.linear": ColwiseParallel(), "blocks.1.linear": RowwiseParallel()}
            parallelize_module(model, self.mesh_2d["tp"], plan)
        if self.program.model.deferred_init:
            # The same model built on the meta device; the backend materializes it with the
            # values of the one just built (which only the init reads).
            source, model = model, build_model(self.program.model, seed, torch.device("meta"))
            init = DeferredInit(fixtures.deferred_fill(source, model))
            self.model: GeneratedModel = model
            self.sharded: nn.Module = self.adapter.shard_deferred(model, self.spec, self.setup.form, init)
        else:
            self.model = model
            self.sharded = self.adapter.shard(model, self.spec, self.setup.form)
        self.optimizer = self._make_optimizer()
        self.first_route: list[int] | None = None
        self.order_warned = False
        self.divergent_route = False
        self.probes = self._probes()

    @contextlib.contextmanager
    def fresh_model(self) -> Iterator[None]:
        """A freshly built and sharded model (other values: seed + FRESH_SEED_OFFSET) and its new
        optimizer, for a load into them; when the block ends, the route and the mode the program
        had are the new model's too (a block that raises ends the program: nothing to carry)."""
        swapped, training = self.model.swapped, self.shadow.model.training
        self.build(self.program.seed + FRESH_SEED_OFFSET)
        yield
        self.model.swapped = swapped
        if not training:
            self.sharded.train(False)

    def _probes(self) -> list[tuple[StorageProbe, frozenset[str]]]:
        """One storage probe per strategy in the spec, each with the parameters it leaves to the
        others (and the frozen ones, which store no gradient). Original parameters only, and
        only where there is something to share (world size > 1)."""
        if not self.setup.use_orig_params or self.world_size < 2 or self.setup.tensor_parallel:
            # Flat buffers are test_unshard_params'; a tensor-parallel parameter's share is the
            # 2-D layout test_2d checks (a claim over dp of what tp already split).
            return []
        other = self.setup.other_strategy if self.setup.unit_plan == "mixed" else None
        block0 = frozenset(name for name in self.numels if name.startswith("blocks.0."))
        plain = dataclasses.replace(self.spec, strategy_overrides={})
        probes = [(self._probe(plain), block0 if other is not None else frozenset())]
        if other is not None:
            probes.append((self._probe(dataclasses.replace(plain, strategy=other)), frozenset(self.numels) - block0))
        return probes

    def _probe(self, spec: ShardingSpec) -> StorageProbe:
        return StorageProbe(
            self.adapter, self.sharded, spec, self.numels, rank=self.rank, world_size=self.world_size, where="storage"
        )

    def _make_optimizer(self) -> Any:
        kind = self.setup.optimizer

        def factory(params: Any) -> torch.optim.Optimizer:
            return make_optimizer(kind, params)

        if self.setup.param_groups:
            return self.adapter.make_optimizer_with_groups(self.sharded, factory, PARAMETER_GROUPS)
        return self.adapter.make_optimizer(self.sharded, factory)

    # -- the program ------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self.build(self.program.seed)
        except BaseException as error:
            if _is_outcome(error):
                raise
            self.find(
                f"sharding the model raised {_described(error)}", f"sharding the model raised {type(error).__name__}"
            )
            self.report.raised_at = time.time()
            return
        # A backend that stores its model in the compute dtype (DeepSpeed's bf16/fp16 mode, float32
        # only as its optimizer's master copy) starts from those rounded values: so does the oracle.
        self.shadow.round_to(self._stored_in_compute_dtype(), dtype_named(self.setup.param_dtype))
        self.check_storage(Stored.PARAMETERS, Phase.AT_REST)
        for index, op in enumerate(self.program.operations):
            self.op_index = index
            try:
                stop = handler_for(op).run(self, op)  # the operation and its checks
            except BaseException as error:
                if _is_outcome(error):
                    raise
                # The program cannot go on; what the checks found before stays in the report.
                # Ranks that raised alike (the usual case: the same call on the same program)
                # all return; a rank left waiting for a peer is stopped by the harness.
                self.find(f"raised {_described(error)}", f"{type(op).__name__} raised {type(error).__name__}")
                self.report.raised_at = time.time()
                return
            self.report.operations_run = index + 1
            if stop:
                return
        self.check_params("at the end")

    def _where(self) -> str:
        if self.op_index < 0:
            return "before the first operation"
        op = self.program.operations[self.op_index]
        return f"op {self.op_index} ({op.describe()})"

    def find(self, text: str, check: str) -> None:
        """Report ``text`` at this operation; ``check`` names what found it, without numbers and
        without the operation: a check that runs after several kinds of operation (the full state
        dict at the end of any program) finds one defect, whichever operation came last."""
        self.report.findings.append(f"rank {self.rank}, {self._where()}: {text}")
        if self.root_op is None:
            self.root_op = self.op_index
        if self.op_index == self.root_op:
            self.report.root_cause.append(check)

    # -- checks -------------------------------------------------------------------------------
    def shown(self, grads: bool) -> dict[str, torch.Tensor]:
        shown = {}
        for name, param in self.sharded.named_parameters():
            value = param.grad if grads else param
            if value is not None:
                shown[declared_fqn(self.adapter, name)] = value.detach().float().cpu().clone()
        return shown

    def compare(
        self, actual: dict[str, Any], expected: dict[str, torch.Tensor], tolerance: Tolerance, what: str
    ) -> None:
        actual = {
            name: value.detach().float().cpu()
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
            else value
            for name, value in actual.items()
        }
        found = differences(actual, expected, tolerance)
        if found:
            self.find(report(f"{what} differ from the oracle's", found, len(expected), tolerance), what)

    def _admits(self, *needed: Capability) -> bool:
        """Whether the backend declares what a check needs, with this program's spec (the rule of
        ``require_all``: a check never runs into a declared absence)."""
        requirements = {*needed, *self.spec.feature_capabilities(), *self.spec.conditions()}
        if not all(self.adapter.supports(capability) for capability in needed):
            return False
        return not any(combination <= requirements for combination in self.adapter.unsupported_combinations())

    def _stored_in_compute_dtype(self) -> set[str]:
        """The parameters of which this rank stores a part in the compute dtype (``local_shard``,
        no collective), by the names the oracle's model has."""
        compute = dtype_named(self.setup.param_dtype)
        if compute is None:
            return set()
        stored = set()
        for name, _ in self.sharded.named_parameters():
            fqn = self.adapter.original_fqn(name)
            if self.adapter.local_shard(self.sharded, fqn).dtype == compute:
                stored.add(fqn)
        return stored

    def in_compute_dtype(self, state: dict[str, Any]) -> set[str]:
        """The entries a backend keeps in the compute dtype (``MIXED_PRECISION_UNSHARD.
        shows_compute_dtype``: its model parameters live in low precision, float32 only in its
        optimizer, DeepSpeed's case)."""
        compute = dtype_named(self.setup.param_dtype)
        if compute is None or not self.adapter.MIXED_PRECISION_UNSHARD.shows_compute_dtype:
            return set()
        return {name for name, value in state.items() if isinstance(value, torch.Tensor) and value.dtype == compute}

    def compare_state(self, state: dict[str, Any], what: str) -> set[str]:
        """A full state dict against the oracle's; entries the backend keeps in the compute dtype
        against the oracle's rounded to it, one ulp of it allowed on top (the float32 masters may
        straddle a rounding boundary). Returns those entries."""
        sharded_values = sorted(name for name, value in state.items() if _is_sharded_tensor(value))
        if sharded_values:
            self.find(
                f"{what} holds DTensors or ShardedTensors for {sharded_values}: a full state dict holds plain, "
                "whole tensors (StateDictKind.FULL)",
                "a full state dict holds DTensors or ShardedTensors",
            )
        rounded = self.in_compute_dtype(state)
        expected = self.shadow.state()
        self.compare(
            {k: v for k, v in state.items() if k not in rounded},
            {k: v for k, v in expected.items() if k not in rounded},
            self.bounds.params,
            what,
        )
        if rounded:
            compute = dtype_named(self.setup.param_dtype)
            assert compute is not None
            one_ulp = dataclasses.replace(self.bounds.params, rtol=self.bounds.params.rtol + torch.finfo(compute).eps)
            self.compare(
                {k: state[k] for k in rounded},
                {k: expected[k].to(compute).float() for k in rounded if k in expected},
                one_ulp,
                f"{what} (in {compute}, as the backend keeps them)",
            )
        return rounded

    def check_params(self, when: str) -> None:
        """The full parameters against the oracle's (collective: every rank, same order)."""
        if self._admits(Capability.FULL_STATE_DICT):
            state = self.adapter.state_dict(self.sharded, StateDictKind.FULL)
            self.compare_state(state, f"the full state dict {when}")
        elif self._admits(Capability.UNSHARD) and self.setup.param_dtype is None:
            with self.adapter.unshard(self.sharded, writeback=False):
                shown = self.shown(grads=False)
            self.compare(shown, self.shadow.params(), self.bounds.params, f"the full parameters {when}")

    def check_grads(self) -> None:
        """The full gradients after a backward, where the backend shows them (collective)."""
        if not (
            self._admits(Capability.UNSHARD, Capability.UNSHARD_WITH_GRADS)
            and self.setup.param_dtype is None
            and not self.setup.offload_params
            and not self.setup.tensor_parallel
        ):
            return
        with self.adapter.unshard(self.sharded, writeback=False, with_grads=True):
            shown = self.shown(grads=True)
        self.compare_grads(shown, "the full gradients after backward")

    def compare_grads(self, shown: dict[str, torch.Tensor], what: str) -> None:
        """Gradients against the oracle's; a frozen parameter must show none (its own finding)."""
        frozen_shown = sorted(name for name in shown if name in self.frozen)
        if frozen_shown:
            self.find(
                f"frozen parameters (requires_grad=False) show a gradient inside unshard(with_grads=True): "
                f"{frozen_shown}; torch leaves their .grad None",
                "frozen parameters show a gradient",
            )
        trained = {name: grad for name, grad in shown.items() if name not in self.frozen}
        self.compare(trained, self.shadow.grads(), self.bounds.grads, what)

    def check_storage(self, stored: Stored, phase: Phase) -> None:
        """The strategy's storage claim for ``stored`` at ``phase`` (collective: every rank)."""
        if stored is Stored.OPTIMIZER_STATE and (self.setup.optimizer != "adam" or not _has_state(self.optimizer)):
            return  # plain SGD keeps none; nothing stepped yet (or a fresh optimizer): none yet
        for probe, left_to_others in self.probes:
            if stored is not Stored.PARAMETERS and not set(self.numels) - left_to_others - self.frozen:
                continue  # every parameter this claim covers is frozen: no gradient, no state
            optimizer = self.optimizer if stored is Stored.OPTIMIZER_STATE else None
            before = len(probe.problems)
            probe.check(stored, phase, optimizer=optimizer, exempt=left_to_others | self.frozen)
            for problem in probe.problems[before:]:
                self.find(problem, f"the storage claim for {stored.name} {phase.name}")

    def check_order_warnings(self, caught: list[warnings.WarningMessage], route: list[int], training: bool) -> None:
        issued = [str(w.message) for w in caught if ORDER_WARNING in str(w.message)]
        expected = int(
            training
            and self.order_checked
            and self.first_route is not None
            and not self.order_warned
            and route != self.first_route
        )
        if expected:
            self.order_warned = True
        if not self.setup.check_exec_order:
            return
        if expected and not issued:
            self.find(
                f"a training forward whose order differs from the first iteration's ({route} after "
                f"{self.first_route}) issued no forward-order warning",
                "no forward-order warning",
            )
        elif issued and not expected:
            what = "a training" if training else "an eval"
            self.find(
                f"{what} forward issued forward-order warnings it should not: {issued}",
                "a forward-order warning unasked",
            )

    def check_sharded_layout(self, state: dict[str, Any]) -> None:
        """A sharded state dict's DTensors shard dimension 0 over the (first) data-parallel mesh dim."""
        for name, value in state.items():
            if isinstance(value, DTensor) and value.dim() >= 1:
                first = value.placements[0]
                if isinstance(first, Shard) and first.dim != 0:
                    self.find(
                        f"sharded state dict entry {name!r} is laid out {value.placements} over its mesh: "
                        f"dimension {first.dim} sharded over data parallelism, where rows (Shard(0)) are "
                        "what every backend's sharded state dict holds",
                        "the sharded state dict's layout",
                    )

    def shared_directory(self) -> str:
        """One new directory, the same on every rank (made by rank 0)."""
        made = [tempfile.mkdtemp(prefix="generated-checkpoint-") if self.rank == 0 else ""]
        dist.broadcast_object_list(made, src=0)
        os.makedirs(made[0], exist_ok=True)
        return made[0]


def _has_state(optimizer: Any) -> bool:
    """Whether ``optimizer`` (a torch optimizer, or a backend's own) holds any state yet."""
    state = getattr(optimizer, "state", None)
    return bool(state) if state is not None else True


def _described(error: BaseException) -> str:
    """``Type: message`` and the innermost frames of ``error``'s traceback (where it was raised)."""
    frames = traceback.extract_tb(error.__traceback__)[-4:]
    where = "; ".join(f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name}" for frame in frames)
    return f"{type(error).__name__}: {error} (at {where})"


def _is_sharded_tensor(value: Any) -> bool:
    """A DTensor, or torch's older ShardedTensor: what a full state dict must not hold."""
    return isinstance(value, DTensor) or type(value).__name__ == "ShardedTensor"


def _is_outcome(error: BaseException) -> bool:
    """What must leave the program as it came: an interrupt, an exit, or pytest's own outcome (a
    skip: the adapter refused the program as unsupported). A library's BaseException (torch's
    CheckpointException is one) is the backend's failure, a finding like any other."""
    return isinstance(
        error, (KeyboardInterrupt, SystemExit, GeneratorExit, pytest.skip.Exception, pytest.fail.Exception)
    )
