"""What a program uses of the script's parts (``_Uses``), the backends a script is written for, and
the text helpers every template shares.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from conformance.programs.program import (
    Backward,
    Operation,
    OptimRoundTrip,
    Program,
    SaveLoad,
    SetMode,
    Setup,
    SwapRoute,
    Unshard,
)
from conformance.protocol import ApiForm, ShardingStrategy

FSDP1 = "torch-fsdp1"


FSDP2 = "torch-fsdp2"


ZERO = "torch-zero"


EXPORTABLE_BACKENDS = (FSDP1, FSDP2, ZERO)


ORDER_WARNING = "Forward order differs from that of the first iteration"
"""FSDP1's later-iteration warning (``conformance.programs.run`` checks the same text)."""


TWO_D_MESH_WORDS = "\n    2-D: every unit over `mesh`, the dp dimension of the (dp, tp) mesh."


def script_name(backend_name: str) -> str:
    """The file a backend's repro is written to (one per backend: each export overwrites it, so
    while hypothesis shrinks, the last one written is the minimal program)."""
    return f"{backend_name}-generated-repro.py"


# -- what the program uses -------------------------------------------------------------------
@dataclass(frozen=True)
class Uses:
    """Everything the templates branch on, read once from the backend and the program."""

    backend: str
    program: Program
    ops: tuple[Operation, ...]

    @classmethod
    def of(cls, backend: str, program: Program) -> Uses:
        return cls(backend=backend, program=program, ops=program.operations)

    def has(self, kind: type) -> bool:
        return any(isinstance(op, kind) for op in self.ops)

    def all_of(self, kind: type) -> list:
        return [op for op in self.ops if isinstance(op, kind)]

    @property
    def setup(self) -> Setup:
        return self.program.setup

    @property
    def strategies(self) -> set[ShardingStrategy]:
        return {self.setup.strategy, *([self.setup.other_strategy] if self.setup.other_strategy else [])}

    @property
    def mixed_precision(self) -> bool:
        return self.setup.param_dtype is not None

    @property
    def tensor_parallel(self) -> bool:
        """2-D: blocks 0 and 1 tensor-parallel over the "tp" dimension of a (dp, tp) mesh, the model
        sharded over "dp"; the ranks of one dp group feed the same batch."""
        return self.setup.tensor_parallel

    @property
    def data_ranks(self) -> str:
        """The script's name for the number of distinct batches a pass sees."""
        return "DP_SIZE" if self.tensor_parallel else "WORLD_SIZE"

    @property
    def divergent_route(self) -> bool:
        """The misuse program: only odd ranks swap, and the first iteration must be refused."""
        return self.program.divergent_order

    @property
    def swaps(self) -> bool:
        return self.has(SwapRoute)

    @property
    def no_sync(self) -> bool:
        return any(isinstance(op, Backward) and op.no_sync for op in self.ops)

    @property
    def order_checked(self) -> bool:
        """Whether forward-order warnings are checked (FSDP1 with check_exec_order, not the misuse)."""
        return self.setup.check_exec_order and not self.divergent_route

    @property
    def route_can_differ(self) -> bool:
        """Whether a training forward may run in another order than the first (then one warning is
        due), as ``run`` decides it: units below the root, two blocks to swap, and a swap."""
        return self.setup.unit_plan != "none" and self.program.model.depth >= 2 and self.swaps

    @property
    def grads_checked(self) -> bool:
        """Whether the gradients are compared after each backward: where the backend shows them
        (``UNSHARD_WITH_GRADS``) in full precision on the device, and not 2-D, as ``run`` checks
        them. torch-fsdp1 declares {UNSHARD_WITH_GRADS, FLAT_PARAMETERS} unsupported (its
        summon_full_params refuses with_grads with flat parameters), so only with use_orig_params
        there."""
        if self.tensor_parallel:
            return False
        if self.backend == ZERO:
            return True
        if self.backend != FSDP1:
            return False
        return not self.mixed_precision and not self.setup.offload_params and self.setup.use_orig_params

    @property
    def reads_grads(self) -> bool:
        """Whether the script compares gradients anywhere (after backward, or inside an unshard)."""
        return self.grads_checked or self.unshard_reads_grads

    @property
    def unshard_reads_grads(self) -> bool:
        return any(isinstance(op, Unshard) and op.with_grads for op in self.ops)

    @property
    def shows(self) -> bool:
        """Whether the run reads the sharded model's named parameters (unshard, gradient checks)."""
        return self.has(Unshard) or self.grads_checked

    @property
    def save_kinds(self) -> set[str]:
        return {op.kind for op in self.ops if isinstance(op, SaveLoad)}

    @property
    def optim_kinds(self) -> set[str]:
        return {op.kind for op in self.ops if isinstance(op, OptimRoundTrip)}

    @property
    def native(self) -> bool:
        return "native" in self.save_kinds

    @property
    def rebuilds(self) -> bool:
        """Whether the program goes on with a freshly built and sharded model (a load of any kind)."""
        return bool(self.save_kinds or self.optim_kinds)

    @property
    def sharded_state_dicts(self) -> bool:
        """Whether the script needs the sharded model state dict (a sharded save or optimizer round
        trip, a native checkpoint)."""
        return bool((self.save_kinds | self.optim_kinds) & {"sharded", "native"})

    @property
    def zero_optimizer(self) -> bool:
        return self.backend == ZERO and self.setup.strategy is ShardingStrategy.SHARD_OPTIM_STATE

    @property
    def mesh(self) -> str | None:
        """The mesh the units need besides the default group: "2-D" (a (dp, tp) mesh), "hybrid" or
        "replicate" (FSDP2 NO_SHARD)."""
        if self.tensor_parallel:
            return "2-D"
        if ShardingStrategy.HYBRID_SHARD in self.strategies:
            return "hybrid"
        if self.backend == FSDP2 and ShardingStrategy.NO_SHARD in self.strategies:
            return "replicate"
        return None

    @property
    def mode_changes(self) -> bool:
        return self.has(SetMode)

    @property
    def optimizer_class(self) -> str:
        return "torch.optim.Adam" if self.setup.optimizer == "adam" else "torch.optim.SGD"


def optimizer_params(uses: Uses, module: str) -> str:
    """What the script hands its optimizer for ``module``: its parameter groups, or its parameters."""
    return f"parameter_groups({module})" if uses.setup.param_groups else f"{module}.parameters()"


def block(text: str, **values: object) -> str:
    """A dedented template with ``<<name>>`` replaced (no braces to escape in the code)."""
    text = textwrap.dedent(text)
    for name, value in values.items():
        text = text.replace(f"<<{name}>>", str(value))
    return text.strip("\n") + "\n"


def indented(lines: list[str], levels: int) -> str:
    pad = "    " * levels
    return "\n".join(pad + line if line else "" for line in lines)


def uses_ddp_wrapper(uses: Uses) -> bool:
    return uses.backend == ZERO and uses.setup.form is ApiForm.WRAPPER


def tolerance_literal(tolerance: object) -> str:
    return f"({tolerance.rtol!r}, {tolerance.atol!r}, {tolerance.scaled_atol!r})"  # type: ignore[attr-defined]


# -- expressions several templates write ----------------------------------------------------
def attribute_of(fqn: str) -> str:
    """``blocks.0.linear`` as the Python expression ``model.blocks[0].linear``."""
    text = "model"
    for part in fqn.split("."):
        text += f"[{part}]" if part.isdigit() else f".{part}"
    return text


def sync_off_call(uses: Uses) -> str:
    if uses.backend == FSDP1 or uses_ddp_wrapper(uses):
        return "self.sharded.no_sync()"
    return "gradient_sync_off(self.sharded)"


def data_rank_expression(uses: Uses) -> str:
    """Whose batch this rank feeds: its own, or its dp group's under 2-D."""
    return "self.data_rank" if uses.tensor_parallel else "self.rank"


def unshard_parameters(uses: Uses) -> list[str]:
    """The options the script's unshard takes: those the program's unshards use, and FSDP1's
    writeback always (summon_full_params defaults it to True, the suite's unshard to False)."""
    ops = uses.all_of(Unshard)

    def used(name: str) -> bool:
        return any(getattr(op, name) for op in ops)

    if uses.backend == FSDP1:
        return ["writeback", *(name for name in ("rank0_only", "offload_to_cpu", "with_grads", "write") if used(name))]
    if uses.backend == ZERO:
        return [name for name in ("with_grads", "write") if used(name)]
    return []
