"""Named shapes of programs: what a backend's recorded generated finding says its failures need.

A ``[[generated_finding]]`` entry of a backend's expectations (``conformance.suite.expectations``)
names one of these and a failure text: a failing example whose program has the pattern, and
whose every finding contains one of the entry's texts, shows that known finding and is set
aside, so the campaign goes on looking for others. A pattern is a predicate over the program
alone (plain data), never over what the backend did: over what each operation does, as its
handler states it (``OperationFacts``), never over an operation's type.
"""

from __future__ import annotations

from collections.abc import Callable

from conformance.programs.operations import OperationFacts, facts
from conformance.programs.program import TENSOR_PARALLEL_DEGREE, Program
from conformance.protocol import ShardingStrategy


def _facts(program: Program) -> list[OperationFacts]:
    """What each operation does, in order (its handler's pattern form)."""
    return [facts(op) for op in program.operations]


def gradients_kept_across_steps(program: Program) -> bool:
    """A backward after a step with no ``zero_grad(set_to_none=True)`` between, then another step:
    torch's optimizers keep the gradients a step used, so that second step sees their sum."""
    after_step = False
    pending = False
    for does in _facts(program):
        if does.steps:
            if pending:
                return True
            after_step = True
        elif does.zeroes_gradients:  # zero-filled or dropped: nothing to sum
            after_step = pending = False
        elif does.backward and after_step:
            pending = True
    return False


def zero12_several_synced_backwards_per_step(program: Program) -> bool:
    """Under ZeRO-1 or ZeRO-2 (SHARD_OPTIM_STATE, SHARD_GRAD_AND_OPTIM_STATE), a step that follows
    two or more backward passes that each reduce (outside the no-sync switch) since the gradients
    were last dropped: the step must see their sum."""
    if program.setup.strategy not in (
        ShardingStrategy.SHARD_OPTIM_STATE,
        ShardingStrategy.SHARD_GRAD_AND_OPTIM_STATE,
    ):
        return False
    synced = 0
    for does in _facts(program):
        if does.backward:
            synced += does.reductions
        elif does.steps:
            if synced >= 2:
                return True
            synced = 0
        elif does.drops_gradients:
            synced = 0
    return False


def zero1_backward(program: Program) -> bool:
    """A backward under SHARD_OPTIM_STATE (ZeRO-1 claims whole gradients after it)."""
    return program.setup.strategy is ShardingStrategy.SHARD_OPTIM_STATE and any(
        does.backward for does in _facts(program)
    )


def hybrid_shard_groups_of_one(program: Program) -> bool:
    """HYBRID_SHARD at world size 2 on one host: a (2, 1) mesh, shard groups of one rank each,
    so every gradient must be all-reduced across the replica dimension."""
    return program.world_size == 2 and ShardingStrategy.HYBRID_SHARD in (
        program.setup.strategy,
        program.setup.other_strategy,
    )


def native_checkpoint_before_first_step(program: Program) -> bool:
    """A native checkpoint saved while the optimizer holds no state yet (no step since it was
    made), then loaded into a fresh model and optimizer."""
    stepped = False
    for does in _facts(program):
        if does.steps:
            stepped = True
        elif does.native_checkpoint and not stepped:
            return True
        elif does.fresh_optimizer:
            stepped = False
    return False


def frozen_parameters(program: Program) -> bool:
    """A model with frozen blocks (parameters with requires_grad=False) and a backward."""
    return bool(program.model.frozen) and any(does.backward for does in _facts(program))


def checkpointed_backward(program: Program) -> bool:
    """A model whose blocks are activation-checkpointed, and a backward (which recomputes them)."""
    return program.model.checkpointed and any(does.backward for does in _facts(program))


def checkpointed_nested_unit_order_checked(program: Program) -> bool:
    """Activation-checkpointed blocks, a unit nested inside a block's unit (``nested``), the
    forward-order check on, and two or more training forwards (the check compares the second
    iteration's order with the first's)."""
    return (
        program.model.checkpointed
        and program.setup.unit_plan == "nested"
        and program.setup.check_exec_order
        and sum(does.training_forwards for does in _facts(program)) >= 2
    )


def parameter_groups(program: Program) -> bool:
    """An optimizer in parameter groups by name (``Setup.param_groups``) and a step."""
    return program.setup.param_groups and any(does.steps for does in _facts(program))


def tied_blocks(program: Program) -> bool:
    """Block 1's weight tied to block 0's (``ModelShape.tied``), and a backward."""
    return program.model.tied and any(does.backward for does in _facts(program))


def deferred_init(program: Program) -> bool:
    """A model built on the meta device and materialized by the backend (``ModelShape.deferred_init``),
    and a backward."""
    return program.model.deferred_init and any(does.backward for does in _facts(program))


def uneven_data(program: Program) -> bool:
    """Data ranks feeding different numbers of samples (``Program.uneven_data``), and a backward."""
    return program.uneven_data and any(does.backward for does in _facts(program))


def adam_state_loaded(program: Program) -> bool:
    """Adam's state (moments) loaded into a freshly sharded model's new optimizer."""
    return program.setup.optimizer == "adam" and any(does.optimizer_state_loaded for does in _facts(program))


def stateless_optimizer_state_loaded(program: Program) -> bool:
    """Plain SGD's optimizer state dict (no state, only its parameter groups) loaded into a freshly
    sharded model's new optimizer."""
    return program.setup.optimizer == "sgd" and any(does.optimizer_state_loaded for does in _facts(program))


def optimizer_state_with_exec_order_check(program: Program) -> bool:
    """An optimizer state dict read (a round trip, or a native checkpoint) while the forward-order
    check is on (``check_exec_order``)."""
    return program.setup.check_exec_order and any(
        does.optimizer_state_loaded or does.native_checkpoint for does in _facts(program)
    )


def two_d_full_state_dict(program: Program) -> bool:
    """A 2-D program (tensor-parallel blocks) that reads a full state dict (every program checks
    its parameters through one after a step, a load or at the end)."""
    return program.setup.tensor_parallel


def two_d_uneven_full_load(program: Program) -> bool:
    """A 2-D program whose tensor-parallel rows do not split evenly over dp (the block width over
    tp, over the dp size), loading a full model state dict."""
    if not program.setup.tensor_parallel:
        return False
    tp_rows = program.model.width // TENSOR_PARALLEL_DEGREE
    uneven = tp_rows % program.data_parallel_size != 0
    return uneven and any(does.full_model_load for does in _facts(program))


def native_checkpoint_four_ranks(program: Program) -> bool:
    """A native checkpoint saved and loaded at world size 4 or more."""
    return program.world_size >= 4 and any(does.native_checkpoint for does in _facts(program))


def write_inside_unshard_then_step(program: Program) -> bool:
    """Parameters written inside unshard(writeback=True), then an optimizer step or a native
    checkpoint (what the optimizer holds of the parameters is used again)."""
    written = False
    for does in _facts(program):
        if does.writes_parameters:
            written = True
        elif written and (does.steps or does.native_checkpoint):
            return True
    return False


PATTERNS: dict[str, Callable[[Program], bool]] = {
    "native_checkpoint_four_ranks": native_checkpoint_four_ranks,
    "write_inside_unshard_then_step": write_inside_unshard_then_step,
    "two_d_full_state_dict": two_d_full_state_dict,
    "two_d_uneven_full_load": two_d_uneven_full_load,
    "optimizer_state_with_exec_order_check": optimizer_state_with_exec_order_check,
    "stateless_optimizer_state_loaded": stateless_optimizer_state_loaded,
    "adam_state_loaded": adam_state_loaded,
    "frozen_parameters": frozen_parameters,
    "checkpointed_backward": checkpointed_backward,
    "uneven_data": uneven_data,
    "deferred_init": deferred_init,
    "tied_blocks": tied_blocks,
    "parameter_groups": parameter_groups,
    "checkpointed_nested_unit_order_checked": checkpointed_nested_unit_order_checked,
    "hybrid_shard_groups_of_one": hybrid_shard_groups_of_one,
    "native_checkpoint_before_first_step": native_checkpoint_before_first_step,
    "gradients_kept_across_steps": gradients_kept_across_steps,
    "zero12_several_synced_backwards_per_step": zero12_several_synced_backwards_per_step,
    "zero1_backward": zero1_backward,
}
