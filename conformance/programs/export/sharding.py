"""The script's sharding: the native calls the suite's adapter makes for the program's setup (FSDP1,
FSDP2, DDP with ZeroRedundancyOptimizer).
"""

from __future__ import annotations

from conformance.programs.export.uses import (
    FSDP1,
    FSDP2,
    TWO_D_MESH_WORDS,
    Uses,
    attribute_of,
    block,
    indented,
    optimizer_params,
)
from conformance.protocol import ApiForm, ShardingStrategy


def _units(uses: Uses) -> list[str]:
    """The unit FQNs below the root, innermost first (FSDP2's auto plan: every Block by class)."""
    if uses.setup.unit_plan == "auto":
        return [f"blocks.{index}" for index in range(uses.program.model.depth)]
    fqns = uses.program.unit_fqns()
    return sorted(dict.fromkeys(fqns), key=lambda fqn: -(fqn.count(".") + 1))


def _strategy_for(uses: Uses, fqn: str) -> ShardingStrategy:
    if uses.setup.unit_plan == "mixed" and fqn == "blocks.0" and uses.setup.other_strategy is not None:
        return uses.setup.other_strategy
    return uses.setup.strategy


def _plan_words(uses: Uses) -> str:
    plan = uses.setup.unit_plan
    return {
        "none": "the whole model one unit",
        "auto": "every Block its own unit",
        "leaves": "every block its own unit, innermost first, then the root",
        "nested": "block 0's linear, then every block, then the root (innermost first)",
        "mixed": "every block its own unit (block 0 with a strategy of its own), then the root",
    }[plan]


def sharding_part(uses: Uses) -> str:
    if uses.backend == FSDP1:
        return _fsdp1_sharding(uses)
    if uses.backend == FSDP2:
        return _fsdp2_sharding(uses)
    return _zero_sharding(uses)


def mesh_parameter(uses: Uses) -> tuple[str, str]:
    """The shard function's mesh parameter and the call's argument."""
    return (", mesh: DeviceMesh", ", mesh") if uses.mesh is not None else ("", "")


def _fsdp1_sharding(uses: Uses) -> str:
    setup = uses.setup
    options = [f'"use_orig_params": {setup.use_orig_params},', '"device_id": DEVICE,']
    if uses.mixed_precision:
        reduce = "torch.float32" if setup.reduce_fp32 else "None"
        options.append(f'"mixed_precision": MixedPrecision(param_dtype=PARAM_DTYPE, reduce_dtype={reduce}),')
    if setup.offload_params:
        options.append('"cpu_offload": CPUOffload(offload_params=True),')
    if uses.mesh in ("hybrid", "2-D"):
        options.append('"device_mesh": mesh,')
    body = ["options = {", *("    " + line for line in options), "}"]
    if _deferred(uses):
        body += [
            "# FSDP1's deferred initialization: each FullyShardedDataParallel calls param_init_fn on the",
            "# modules of its subtree not yet wrapped, before it flattens and shards them.",
            'options["param_init_fn"] = init_from(source, model)',
        ]
    for fqn in _units(uses) if setup.unit_plan != "auto" else []:
        target = attribute_of(fqn)
        strategy = _strategy_for(uses, fqn).name
        body += _wrapped_call(f"{target} = FullyShardedDataParallel(", [target, _fsdp1_strategy(strategy), "**options"])
    root = ["model", _fsdp1_strategy(setup.strategy.name)]
    if setup.unit_plan == "auto":
        root.append("auto_wrap_policy=ModuleWrapPolicy({Block})")
    body += _wrapped_call("return FullyShardedDataParallel(", [*root, "**options"])
    parameter, _ = mesh_parameter(uses)
    text = block(
        '''
        def shard(model: Model<<parameter>><<source>>) -> FullyShardedDataParallel:
            """FSDP1 as the suite's torch-fsdp1 adapter applies it:
            <<plan>>.<<mesh_words>>"""
        <<body>>


        def make_sharded_optimizer(sharded: nn.Module) -> torch.optim.Optimizer:
            return make_optimizer(<<params>>, SHARDED_LR)
        ''',
        params=optimizer_params(uses, "sharded"),
        parameter=parameter,
        source=_SOURCE_PARAMETER if _deferred(uses) else "",
        plan=_plan_words(uses),
        mesh_words=TWO_D_MESH_WORDS if uses.tensor_parallel else "",
        body=indented(body, 1),
    )
    return text + "\n\n" + _INIT_FROM if _deferred(uses) else text


_SOURCE_PARAMETER = ", source: Model"
# A param_init_fn (and what a backend without deferred initialization needs per module before
# it shards): a module's own tensors get storage on DEVICE and the source's values.
_INIT_FROM = block(
    '''

    def init_from(source: Model, model: Model):
        """Materialize one module of `model` (built on the meta device) with its twin's values in `source`."""
        twins = dict(zip(model.modules(), source.modules()))

        def init(module: nn.Module) -> None:
            module.to_empty(device=DEVICE, recurse=False)
            with torch.no_grad():
                for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                    tensor.copy_(getattr(twins[module], name))

        return init
    '''
)


def _deferred(uses: Uses) -> bool:
    return uses.program.model.deferred_init


def _fsdp1_strategy(name: str) -> str:
    return f"sharding_strategy=ShardingStrategy.{name}"


def _wrapped_call(opening: str, arguments: list[str], indent: int = 4) -> list[str]:
    """A call on one line where it fits the 120 columns, else one argument a line (the formatter's way)."""
    line = opening + ", ".join(arguments) + ")"
    if indent + len(line) <= 120:
        return [line]
    return [opening, *(f"    {argument}," for argument in arguments), ")"]


def _fsdp2_sharding(uses: Uses) -> str:
    setup = uses.setup
    common = []
    if uses.mixed_precision:
        reduce = "torch.float32" if setup.reduce_fp32 else "None"
        common.append(f'"mp_policy": MixedPrecisionPolicy(param_dtype=PARAM_DTYPE, reduce_dtype={reduce}),')
    if setup.offload_params:
        common.append('"offload_policy": CPUOffloadPolicy(pin_memory=USE_CUDA),  # pinned memory needs a GPU')
    body = ["options = {", *("    " + line for line in common), "}"] if common else []

    def call(target: str, strategy: ShardingStrategy) -> str:
        arguments = [target]
        if (
            uses.tensor_parallel
            or strategy is ShardingStrategy.HYBRID_SHARD
            or (strategy is ShardingStrategy.NO_SHARD and uses.mesh == "replicate")
        ):
            arguments.append("mesh=mesh")
        if strategy is ShardingStrategy.SHARD_GRAD_OP:
            arguments.append("reshard_after_forward=False")
        if common:
            arguments.append("**options")
        return f"fully_shard({', '.join(arguments)})"

    for fqn in _units(uses):
        body.append(call(attribute_of(fqn), _strategy_for(uses, fqn)))
    body.append(call("model", setup.strategy))
    if _deferred(uses):
        storage = '"cpu"' if setup.offload_params else "DEVICE"
        body += [
            "# FSDP2's deferred initialization: fully_shard on the meta model, then to_empty allocates each",
            "# rank's shards; each parameter keeps its shard of the source's value, buffers take theirs.",
            f"model.to_empty(device={storage})",
            "with torch.no_grad():",
            "    for module, twin in zip(model.modules(), source.modules()):",
            "        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]",
            "        for name, tensor in own:",
            "            value = getattr(twin, name).to(DEVICE)",
            "            if isinstance(tensor, DTensor):",
            "                value = distribute_tensor(value, tensor.device_mesh, tensor.placements).to_local()",
            "                tensor = tensor.to_local()",
            "            tensor.copy_(value)",
        ]
    body.append("return model")
    parameter, _ = mesh_parameter(uses)
    mesh_words = {
        "hybrid": "\n    HYBRID_SHARD is a 2-D (replicate, shard) mesh.",
        "replicate": "\n    NO_SHARD units are on a (WORLD_SIZE, 1) mesh: every rank a replica of its own.",
        "2-D": TWO_D_MESH_WORDS,
        None: "",
    }[uses.mesh]
    return block(
        '''
        def shard(model: Model<<parameter>><<source>>) -> Model:
            """fully_shard as the suite's torch-fsdp2 adapter applies it:
            <<plan>>.<<mesh_words>>"""
        <<body>>


        def make_sharded_optimizer(sharded: nn.Module) -> torch.optim.Optimizer:
            return make_optimizer(<<params>>, SHARDED_LR)
        ''',
        params=optimizer_params(uses, "sharded"),
        parameter=parameter,
        source=_SOURCE_PARAMETER if _deferred(uses) else "",
        plan=_plan_words(uses).replace("the whole model one unit", "the root alone"),
        mesh_words=mesh_words,
        body=indented(body, 1),
    )


def _zero_sharding(uses: Uses) -> str:
    if _deferred(uses):
        # DDP takes a materialized model: what a script does before it wraps one built on meta.
        shard = block(
            '''
            def shard(model: Model, source: Model) -> nn.Module:
                """The model built on the meta device materialized module by module (DDP has no deferred
                initialization), then <<how>>, as the suite's torch-zero adapter applies it."""
                init = init_from(source, model)
                for module in model.modules():
                    init(module)
                return <<call>>
            ''',
            how="DistributedDataParallel" if uses.setup.form is ApiForm.WRAPPER else "replicate()",
            call='DistributedDataParallel(model, device_ids=None if DEVICE.type == "cpu" else [DEVICE])'
            if uses.setup.form is ApiForm.WRAPPER
            else "replicate(model, device_id=DEVICE)",
        )
        shard = shard + "\n\n" + _INIT_FROM
    elif uses.setup.form is ApiForm.WRAPPER:
        shard = block(
            '''
            def shard(model: Model) -> DistributedDataParallel:
                """DistributedDataParallel, as the suite's torch-zero adapter wraps the model."""
                return DistributedDataParallel(model, device_ids=None if DEVICE.type == "cpu" else [DEVICE])
            '''
        )
    else:
        shard = block(
            '''
            def shard(model: Model) -> Model:
                """replicate(), the composable DistributedDataParallel, as the suite's torch-zero adapter applies it."""
                return replicate(model, device_id=DEVICE)
            '''
        )
    if uses.zero_optimizer:
        optimizer = block(
            '''
            def make_sharded_optimizer(sharded: nn.Module) -> torch.optim.Optimizer:
                """ZeRO-1: each rank keeps and steps the optimizer state of the parameters assigned to it."""
                return ZeroRedundancyOptimizer(<<params>>, optimizer_class=<<optimizer>>, lr=SHARDED_LR)
            ''',
            optimizer=uses.optimizer_class,
            params=optimizer_params(uses, "sharded"),
        )
    else:
        optimizer = block(
            """
            def make_sharded_optimizer(sharded: nn.Module) -> torch.optim.Optimizer:
                return make_optimizer(<<params>>, SHARDED_LR)
            """,
            params=optimizer_params(uses, "sharded"),
        )
    return shard.strip("\n") + "\n\n\n" + optimizer.strip("\n")
