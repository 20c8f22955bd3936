"""Adapter for DeepSpeed ZeRO (``deepspeed.initialize``), stages 0 to 3, wrapper form.

Install: ``DS_BUILD_OPS=0 pip install 'fsdp-conformance[deepspeed]'`` (no compiled ops are
needed; on CPU DeepSpeed JIT-builds one small shared-memory op the first time a process uses
it, which takes about a minute once per machine).

Strategy mapping, by what each stage keeps on a rank (``conformance.protocol.storage``):

* ``NO_SHARD`` -> stage 0: parameters, gradients and optimizer state replicated, gradients
  all-reduced (DDP semantics).
* ``SHARD_OPTIM_STATE`` -> stage 1: parameters replicated, optimizer state (and its fp32 master
  copy) partitioned. DeepSpeed 0.19.8 keeps only this rank's partition of the reduced gradients
  after a boundary backward (``param.grad`` is freed), where the strategy claims whole ones.
* ``SHARD_GRAD_AND_OPTIM_STATE`` -> stage 2: parameters replicated, gradients reduced into the
  owning rank's partition, optimizer state partitioned.
* ``FULL_SHARD`` -> stage 3: parameters partitioned too (``param`` is an empty placeholder,
  this rank's flat part is ``param.ds_tensor``), gathered module by module during forward and
  backward and released after each module. ``stage3_max_reuse_distance`` and
  ``stage3_prefetch_bucket_size`` are 0 here: with DeepSpeed's defaults, from the second step on
  (once its module trace is recorded) every parameter of a small model stays gathered from
  forward to backward, which is not what FULL_SHARD stores.
* ``SHARD_GRAD_OP`` (parameters sharded at rest, gathered from forward to backward): no stage.
  ZeRO-3 keeps a forward-gathered parameter for backward only by its recorded trace and reuse
  budget, never in the first step (see ``UNSUPPORTED_REASONS``).

Units: only ZeRO-3 fetches per module, so only FULL_SHARD takes units (they name what
``unshard(recurse=False)`` and the introspection read); stages 0-2 partition the flat optimizer
groups of the whole model and have none (``UNSUPPORTED_COMBINATIONS``).

DeepSpeed owns the training loop: the optimizer is built into the engine
(:meth:`make_optimizer`), and gradients are reduced by ``engine.backward`` (stage 0 refuses a
plain ``loss.backward()``). The engine is built when first needed: by :meth:`make_optimizer`
(with the scenario's optimizer) or by the first forward. Stage 3 partitions the parameters at
:meth:`shard` already (``deepspeed.zero.Init(module=...)``), so what a rank stores never
depends on when the engine was built.

Config choices, each because DeepSpeed's default would change what scenarios compare:
``gradient_clipping`` 0 (DeepSpeed's default clips the global gradient norm to 1.0, which a
plain torch loop does not do), ``stage3_param_persistence_threshold`` 0 (DeepSpeed leaves
parameters below it unpartitioned), ``stage3_max_reuse_distance`` and
``stage3_prefetch_bucket_size`` 0 (see FULL_SHARD above), ``zero_allow_untested_optimizer``
(scenarios bring plain torch optimizers). Mixed precision: DeepSpeed's bf16/fp16 mode reduces
gradients in that dtype by default (``ShardingSpec.reduce_dtype`` None); ``reduce_dtype`` float32
sets ``communication_data_type`` "fp32", which every stage casts its gradient reductions to.

Gradient accumulation: ``gradient_accumulation_steps`` is 1, so every ``engine.backward`` is an
accumulation boundary. Stages 0 and 3 add a second backward's gradients to the first's; stages 1
and 2 replace this rank's reduced partition with the newer one (observed on 0.19.8).
``no_gradient_sync`` is ``engine.no_sync()``, which DeepSpeed refuses under gradient
partitioning (stages 2 and 3).

Rank environment: DeepSpeed reads ``LOCAL_RANK`` (and ``RANK``, ``WORLD_SIZE``) from the
environment and caches process groups in ``deepspeed.utils.groups``; the adapter sets the
former from its ``BackendEnv`` for each test and drops the latter in :meth:`close`, since the
harness destroys every group a test created.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from conformance.adapters._labels import current_label, label_calls
from conformance.protocol import (
    ApiForm,
    BackendAdapter,
    BackendEnv,
    Capability,
    MixedPrecisionUnshard,
    OptimizerFactory,
    ShardingSpec,
    ShardingStrategy,
    ShardLayout,
    StateDictKind,
    innermost_first,
    submodule,
)

if importlib.util.find_spec("deepspeed") is None:
    raise ImportError(
        "the deepspeed backend needs DeepSpeed: DS_BUILD_OPS=0 pip install "
        "'fsdp-conformance[deepspeed]' (or deepspeed itself)"
    )

_STAGES = {
    ShardingStrategy.NO_SHARD: 0,
    ShardingStrategy.SHARD_OPTIM_STATE: 1,
    ShardingStrategy.SHARD_GRAD_AND_OPTIM_STATE: 2,
    ShardingStrategy.FULL_SHARD: 3,
}
_MIXED_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
# ShardingSpec.reduce_dtype -> DeepSpeed's communication_data_type (gradient reductions are cast to it).
_COMMUNICATION_DTYPES = {torch.float32: "fp32", **_MIXED_DTYPES}
# The child name under which our wrapper holds the model: the adapter's one wrapper component.
_WRAPPED = "_deepspeed_wrapped_module"

_NO_GATHER_OPTION = "deepspeed.zero.GatheredParameters has no such option"
# parameter -> original FQN, for collective labels: filled by shard(), emptied by close(). Weak and
# by identity: tensors compare elementwise, and a plain id key could name a later parameter that
# reuses a dead one's address with the dead one's FQN.
_PARAM_FQNS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _label_collectives() -> None:
    """Name the parameter FQNs behind ZeRO-3's all-gathers. They run in module hooks, and in
    backward no module forward is running, so without this the trace could not tell two
    same-sized gathers apart. The coordinator's gather takes exactly the set of parameters it
    fetches (prefetched ones included). Gradient reductions keep the harness's default label."""
    try:
        from deepspeed.runtime.zero.partitioned_param_coordinator import (
            PartitionedParameterCoordinator,
        )
    except ImportError:
        return
    gather = "_PartitionedParameterCoordinator__all_gather_params"
    if not hasattr(PartitionedParameterCoordinator, gather):
        return  # a DeepSpeed whose internals moved: gathers keep the module labels

    def fqns(coordinator: Any, params: Any, *args: Any, **kwargs: Any) -> list[str]:
        return sorted(_PARAM_FQNS.get(p, "?") for p in params)

    label_calls(PartitionedParameterCoordinator, gather, fqns)


def _import_deepspeed(device: torch.device) -> Any:
    """Import DeepSpeed with the accelerator of ``device``: it picks one at import, from
    ``DS_ACCELERATOR`` or by probing, and a CPU rank on a GPU machine must not get CUDA."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if device.type == "cpu" else device.type)
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    chosen = get_accelerator().device_name()
    if chosen != device.type:
        raise RuntimeError(
            f"DeepSpeed was imported with the {chosen!r} accelerator, but this rank runs on "
            f"{device}: set DS_ACCELERATOR={device.type} before anything imports deepspeed"
        )
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its INFO lines drown the output
    _keep_collectives_on_torch_distributed(deepspeed)
    return deepspeed


def _keep_collectives_on_torch_distributed(deepspeed: Any) -> None:
    """Tell DeepSpeed its CPU shared-memory all-reduce op is unavailable, before its comm
    backend exists.

    ``deepspeed.comm.torch.TorchBackend.__init__`` (created by the first ``deepspeed.initialize``)
    JIT-compiles that op whenever ``deepspeed.ops.__compatible_ops__`` lists it as compatible:
    minutes of C++ compilation on a machine without a build cache (214 s measured here), which
    would land inside the first test. The op serves ``inference_all_reduce`` only (DeepSpeed
    inference / AutoTP); training never calls it, and where it runs it reduces through shared
    memory, outside torch.distributed, where the harness's collective trace cannot see it.
    DeepSpeed treats an incompatible op as absent and falls back to torch.distributed, and it
    keeps that table in one module-level dict so that such edits persist. Nothing to do once
    its comm backend exists (the op was then built or found absent already) or on
    accelerators without the op (CUDA).
    """
    import deepspeed.ops
    from deepspeed import comm
    from deepspeed.accelerator import get_accelerator

    if getattr(comm.comm, "cdb", None) is not None:
        return
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


class DeepSpeedModel(nn.Module):
    """What :meth:`DeepSpeedAdapter.shard` returns: the user's model as its one child
    (names read ``_deepspeed_wrapped_module.<original FQN>``) and, once built, the
    DeepSpeedEngine that runs it.

    The engine is kept outside the module tree: it holds the same model, and registering it
    would list every parameter twice.
    """

    def __init__(self, module: nn.Module, spec: ShardingSpec, config: dict[str, Any], units: list[str]) -> None:
        super().__init__()
        self._deepspeed_wrapped_module = module
        self.spec = spec
        self.config = config
        self.units = units  # unit FQNs, innermost first, root ("") last
        self.engine: Any = None
        self.param_group_fqns: list[list[str]] = []  # the optimizer's groups, by parameter FQN
        self.build_engine: Callable[[DeepSpeedModel, OptimizerFactory | None], Any] | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "engine":  # not a submodule (see the class docstring)
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    @property
    def module(self) -> nn.Module:
        """The user's model (the engine holds the same object as ``engine.module``)."""
        return self._deepspeed_wrapped_module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.engine is None:
            assert self.build_engine is not None
            self.build_engine(self, None)
        dtype = self.spec.param_dtype
        if dtype is not None:
            # DeepSpeed's fp16/bf16 modes cast the model, not its inputs: a DeepSpeed training
            # loop feeds inputs in the compute dtype itself (torch FSDP casts them for you).
            args, kwargs = _cast_floating((args, kwargs), dtype)
        return self.engine(*args, **kwargs)

    def stage(self) -> int:
        return self.config["zero_optimization"]["stage"]

    def own_params(self, unit: str) -> list[nn.Parameter]:
        """Parameters of the unit at ``unit`` that no unit nested in it manages."""
        nested = [u for u in self.units if u != unit and (unit == "" or u.startswith(f"{unit}."))]
        inside_nested = {id(p) for fqn in nested for p in submodule(self.module, fqn).parameters()}
        return [p for p in submodule(self.module, unit).parameters() if id(p) not in inside_nested]


class DeepSpeedAdapter(BackendAdapter):
    PROTOCOL_VERSION = 5  # the protocol version this adapter was written for
    name = "deepspeed"
    WRAPPER_COMPONENTS = frozenset({_WRAPPED})
    # DeepSpeed's own code (its owner-rank broadcasts, its partition-dependent reductions) is never
    # the user's: collectives it issues are attributed to the scenario line that called into it.
    BACKEND_MODULES = ("deepspeed",)
    CAPABILITIES = frozenset(
        {
            Capability.WRAPPER,
            Capability.UNITS,
            Capability.AUTO_WRAP,
            Capability.FULL_SHARD,
            Capability.SHARD_GRAD_AND_OPTIM_STATE,
            Capability.NO_SHARD,
            Capability.SHARD_OPTIM_STATE,
            Capability.MIXED_PRECISION,
            Capability.REDUCE_DTYPE,
            Capability.NO_SYNC,
            Capability.CPU_OFFLOAD,
            Capability.UNSHARD,
            Capability.UNSHARD_WRITEBACK,
            Capability.UNSHARD_NON_RECURSIVE,
            Capability.FULL_STATE_DICT,
            Capability.OPTIM_STATE_DICT,
            Capability.INTROSPECT_UNSHARDED,
            Capability.INTROSPECT_STORAGE,
            Capability.NATIVE_CHECKPOINT,
        }
    )
    # Backend facts (proven in tests/conformance/test_declared_facts.py where DeepSpeed is
    # installed): its bf16/fp16 mode casts the model's parameters to the low dtype (float32 lives
    # only in the ZeRO optimizer's master partitions), so GatheredParameters shows that dtype.
    MIXED_PRECISION_UNSHARD = MixedPrecisionUnshard(shows_compute_dtype=True)
    # ZeRO-3 partitions each parameter on its own: flattened, padded to a multiple of the world
    # size, ceil(numel / world size) elements in every rank's ds_tensor (what local_shard returns).
    SHARD_LAYOUT = ShardLayout.PER_PARAMETER
    # The module shard() returns holds the user's model as its child _deepspeed_wrapped_module,
    # so the names it lists (inside GatheredParameters too) start with that.
    UNSHARDED_NAME_PREFIX = _WRAPPED
    UNSUPPORTED_REASONS = {
        Capability.SHARD_GRAD_OP: (
            "no ZeRO stage keeps parameters sharded at rest and gathered from forward to backward: "
            "stage 2 never shards parameters, and stage 3 keeps a forward-gathered parameter for "
            "backward only through stage3_max_reuse_distance, which reads the module trace "
            "recorded during the first step, so the first step (and any after the trace is "
            "invalidated or past the reuse budget) releases each module's parameters after its forward"
        ),
        Capability.COMPOSABLE: ("deepspeed.initialize wraps the model in a DeepSpeedEngine; it has no in-place form"),
        Capability.HYBRID_SHARD: (
            "ZeRO shards over the whole data-parallel group: DeepSpeed's hybrid sharding (MiCS, "
            "mics_shard_size) is gone ('MiCS ZeRO-3 sharding has been removed'), and ZeRO++'s "
            "zero_hpz_partition_size only adds a secondary parameter copy per group"
        ),
        Capability.MIXED_PRECISION: ("DeepSpeed's accelerator on this device supports neither fp16 nor bf16"),
        Capability.REDUCE_DTYPE: (
            "a float32 gradient reduction under mixed precision needs mixed precision, which "
            "DeepSpeed's accelerator on this device lacks (neither fp16 nor bf16)"
        ),
        Capability.IGNORED_MODULES: (
            "ZeRO partitions every parameter of the model it is given; it cannot leave submodules out"
        ),
        Capability.FLAT_PARAMETERS: ("DeepSpeed always exposes the original parameters; its flat buffers are internal"),
        Capability.UNSHARD_RANK0_ONLY: _NO_GATHER_OPTION,
        Capability.UNSHARD_OFFLOAD_TO_CPU: _NO_GATHER_OPTION,
        Capability.UNSHARD_WITH_GRADS: (
            "deepspeed.zero.GatheredParameters gathers parameters only; full gradients come from "
            "safe_get_full_grad, outside any context"
        ),
        Capability.SHARDED_STATE_DICT: (
            "DeepSpeed's sharded format is its checkpoint directory (engine.save_checkpoint); it "
            "has no in-memory state dict of sharded tensors (DTensor or ShardedTensor)"
        ),
        Capability.EXEC_ORDER_CHECK: "DeepSpeed performs no cross-rank execution-order check",
        Capability.TENSOR_PARALLEL: (
            "ZeRO does not compose with DTensor tensor parallelism (its tensor parallelism is "
            "AutoTP, which replaces modules)"
        ),
        Capability.INTROSPECT_UNIT_FQNS: ("DeepSpeed has no units to report: it partitions each parameter on its own"),
        Capability.INTROSPECT_EVENTS: ("DeepSpeed exposes no unshard/reshard events (its fetch hooks are internal)"),
        Capability.UNMANAGED_ROOT: (
            "deepspeed.initialize manages every parameter of the model; a plain root over "
            "sharded units cannot be expressed"
        ),
        Capability.MIXED_STRATEGIES: "one ZeRO stage applies to the whole model",
    }
    UNSUPPORTED_COMBINATIONS = {
        frozenset({Capability.CPU_OFFLOAD, Capability.NO_SHARD}): (
            "NO_SHARD is ZeRO stage 0, which has no offload: DeepSpeed ignores offload_optimizer "
            "and offload_param below stage 1 and trains with everything on the device"
        ),
        # Only ZeRO-3 fetches parameters per module; stages 0-2 have nothing a unit could name.
        frozenset({Capability.UNITS, Capability.NO_SHARD}): (
            "NO_SHARD is ZeRO stage 0: DeepSpeed replicates the whole model and all-reduces its "
            "gradients in buckets; it has no units"
        ),
        frozenset({Capability.UNITS, Capability.SHARD_OPTIM_STATE}): (
            "ZeRO stage 1 partitions the optimizer state of the whole model (one flat buffer per "
            "optimizer param group, split over all ranks); it has no units"
        ),
        frozenset({Capability.UNITS, Capability.SHARD_GRAD_AND_OPTIM_STATE}): (
            "ZeRO stage 2 partitions the gradients and optimizer state of the whole model (one "
            "flat buffer per optimizer param group, split over all ranks); it has no units"
        ),
        # DeepSpeedEngine.no_sync asserts "no_sync context manager is incompatible with gradient
        # partitioning logic of ZeRO stage 2/3": those stages reduce in every backward.
        frozenset({Capability.NO_SYNC, Capability.SHARD_GRAD_AND_OPTIM_STATE}): (
            "DeepSpeedEngine.no_sync refuses ZeRO stage 2 ('no_sync context manager is "
            "incompatible with gradient partitioning logic of ZeRO stage 2'): it reduces "
            "gradients into their owners' partitions in every backward"
        ),
        frozenset({Capability.NO_SYNC, Capability.FULL_SHARD}): (
            "DeepSpeedEngine.no_sync refuses ZeRO stage 3 ('no_sync context manager is "
            "incompatible with gradient partitioning logic of ZeRO stage 3'): it reduce-scatters "
            "gradients in every backward"
        ),
    }

    def __init__(self, env: BackendEnv) -> None:
        super().__init__(env)
        # DeepSpeed asserts LOCAL_RANK and reads RANK / WORLD_SIZE; the harness's TestIsolation
        # restores the environment after the test.
        local_rank = (
            env.local_rank
            if env.local_rank is not None
            else (env.device.index if env.device.index is not None else env.rank)
        )
        os.environ["LOCAL_RANK"] = str(local_rank)
        os.environ["RANK"] = str(env.rank)
        os.environ["WORLD_SIZE"] = str(env.world_size)
        self._ds = _import_deepspeed(env.device)
        self._engines: list[weakref.ref[Any]] = []  # destroyed in close()
        self._release_cached_groups()  # a crashed earlier test may have skipped close()
        _label_collectives()

    def collective_label(self) -> str | None:
        return current_label()

    def capabilities(self) -> frozenset[Capability]:
        if not self.mixed_precision_dtypes():
            return self.CAPABILITIES - {Capability.MIXED_PRECISION, Capability.REDUCE_DTYPE}
        return self.CAPABILITIES

    def mixed_precision_dtypes(self) -> tuple[torch.dtype, ...]:
        """What DeepSpeed's accelerator trains in here: its CPU accelerator has bfloat16 and
        no float16 (``is_fp16_supported()`` is false), CUDA both."""
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        supported = {
            torch.float16: accelerator.is_fp16_supported(),
            torch.bfloat16: accelerator.is_bf16_supported(),
        }
        return tuple(dtype for dtype, present in supported.items() if present)

    def close(self) -> None:
        self._destroy_engines()
        _PARAM_FQNS.clear()
        self._release_cached_groups()

    def _destroy_engines(self) -> None:
        """``DeepSpeedEngine.destroy()`` on every engine this adapter built, as DeepSpeed asks of
        a program that is done with one: ZeRO-3 keeps its optimizer in reference cycles through
        the parameters' hooks, which Python's collector cannot break, so without it every engine
        (its model, buffers and process groups) would outlive the test for good."""
        engines, self._engines = self._engines, []
        for ref in engines:
            engine = ref()
            if engine is not None and hasattr(engine, "destroy"):
                engine.destroy()

    def _release_cached_groups(self) -> None:
        """Forget the process groups DeepSpeed caches in ``deepspeed.utils.groups`` (its data
        parallel clone of the world group, among others): the harness destroys every group a
        test created, and a cached dead group fails the next engine ("Group ... is not
        registered"). DeepSpeed's own destroy_process_group does this through the same
        function; older versions without it get their known globals reset."""
        from deepspeed.utils import groups

        release = getattr(groups, "_release_process_group_references", None)
        if release is not None:
            release(None)
            return
        for name in (
            "_WORLD_GROUP",
            "_ZERO_PARAM_INTRA_PARALLEL_GROUP",
            "_DATA_PARALLEL_GROUP",
            "_MODEL_PARALLEL_GROUP",
            "_TENSOR_MODEL_PARALLEL_GROUP",
            "mpu",
            "mesh_device",
        ):
            if hasattr(groups, name):
                setattr(groups, name, None)
        for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP", "_ALL_TO_ALL_GROUP"):
            getattr(groups, name, {}).clear()

    # -- applying sharding ----------------------------------------------------------------
    def _shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
        if spec.mesh is not None:
            raise ValueError(
                "deepspeed adapter: ZeRO shards over the whole world; it takes no DeviceMesh "
                "(leave ShardingSpec.mesh unset)"
            )
        config = self._config(spec)
        for fqn, param in model.named_parameters():
            _PARAM_FQNS[param] = fqn
        root = DeepSpeedModel(model, spec, config, self._unit_fqns(model, spec))
        root.build_engine = self._build_engine
        if spec.param_dtype is not None:
            # What DeepSpeed's fp16/bf16 mode does to the model's storage, done now rather than
            # when the engine is built: deepspeed.initialize casts the parameters (buffers
            # stay as they are) and keeps float32 only as the ZeRO optimizer's master copy;
            # a model built under zero.Init with that config is born in the low dtype, and the
            # engine leaves such a model's parameters alone. Storage must not depend on whether
            # a scenario's first forward (which builds the engine) has run yet.
            with torch.no_grad():
                for param in model.parameters():
                    if param.is_floating_point():
                        param.data = param.data.to(spec.param_dtype)
        if config["zero_optimization"]["stage"] == 3:
            # Partition now, as if the model had been built under zero.Init, so storage is
            # sharded from here on whether or not (or when) the engine gets built.
            self._ds.zero.Init(module=model, config_dict_or_path=config)
        return root

    def _config(self, spec: ShardingSpec) -> dict[str, Any]:
        config: dict[str, Any] = {
            # DeepSpeed wants batch sizes for its bookkeeping; scenarios feed their own batches.
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "zero_optimization": {
                "stage": _STAGES[spec.strategy],
                "stage3_param_persistence_threshold": 0,
                # Release every module's parameters after its forward, in every step (see the
                # module docstring: DeepSpeed's defaults keep them gathered until backward once
                # its trace is recorded, and prefetch the next ones).
                "stage3_max_reuse_distance": 0,
                "stage3_prefetch_bucket_size": 0,
            },
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**62,
            "wall_clock_breakdown": False,
        }
        if spec.param_dtype is not None:
            key = _MIXED_DTYPES.get(spec.param_dtype)
            if key is None:
                raise ValueError(
                    f"deepspeed adapter: param_dtype {spec.param_dtype} is not one DeepSpeed "
                    f"trains in; use one of {sorted(map(str, _MIXED_DTYPES))}"
                )
            config[key] = {"enabled": True}
            # DeepSpeed reduces in the compute dtype unless told otherwise, as reduce_dtype None asks.
            if spec.reduce_dtype is not None and spec.reduce_dtype != spec.param_dtype:
                name = _COMMUNICATION_DTYPES.get(spec.reduce_dtype)
                if name is None:
                    raise ValueError(
                        f"deepspeed adapter: reduce_dtype {spec.reduce_dtype} is not one DeepSpeed "
                        f"reduces in (communication_data_type); use one of {sorted(map(str, _COMMUNICATION_DTYPES))}"
                    )
                config["communication_data_type"] = name
        if spec.offload_params:
            config["zero_optimization"].update(
                self._offload(config["zero_optimization"]["stage"], pin=self.env.device.type == "cuda")
            )
            # ZeRO-Offload steps the optimizer on the host; DeepSpeed refuses a client torch
            # optimizer there unless told that is intended (scenarios bring plain torch ones).
            config["zero_force_ds_cpu_optimizer"] = False
        return config

    @staticmethod
    def _offload(stage: int, *, pin: bool) -> dict[str, Any]:
        """ZeRO-Offload for ``offload_params`` ("sharded parameters live on CPU, the optimizer
        steps them there"): every stage moves the fp32 master partition and the optimizer state
        to the host and steps there (``offload_optimizer``); stage 3, the one with sharded
        parameters, keeps those on the host too (``offload_param``). Stage 0 has no offload:
        DeepSpeed's own refusal is what a scenario sees. Host buffers are pinned only for a CUDA
        device (DeepSpeed's default there; a CPU accelerator has nothing to pin for)."""
        offload: dict[str, Any] = {"offload_optimizer": {"device": "cpu", "pin_memory": pin}}
        if stage == 3:
            offload["offload_param"] = {"device": "cpu", "pin_memory": pin}
        return offload

    @staticmethod
    def _unit_fqns(model: nn.Module, spec: ShardingSpec) -> list[str]:
        if spec.auto_wrap_classes:
            units = [fqn for fqn, module in model.named_modules() if fqn and isinstance(module, spec.auto_wrap_classes)]
        else:
            units = list(spec.manual_units)
        return [*innermost_first(tuple(units)), ""]

    def _build_engine(self, root: DeepSpeedModel, factory: OptimizerFactory | None) -> Any:
        """deepspeed.initialize with the scenario's optimizer, or, when the scenario asked for
        none before its first forward, a torch SGD with lr 0 that nobody steps: DeepSpeed
        reduces gradients in its ZeRO optimizer and refuses backward without one."""
        inner = root.module
        names = {id(p): fqn for fqn, p in inner.named_parameters()}
        if factory is None:
            optimizer = torch.optim.SGD(inner.parameters(), lr=0.0)
        else:
            optimizer = factory(inner.parameters())
        root.param_group_fqns = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        engine, _, _, _ = self._ds.initialize(model=inner, optimizer=optimizer, config=root.config)
        root.engine = engine
        self._engines.append(weakref.ref(engine))
        return engine

    # -- training loop ----------------------------------------------------------------------
    def make_optimizer(self, model: nn.Module, factory: OptimizerFactory) -> Any:
        root = _root(model)
        if root.engine is not None:
            raise RuntimeError(
                "deepspeed adapter: the engine already exists (a forward ran, or make_optimizer "
                "was called before); DeepSpeed takes the optimizer when the engine is built, so "
                "call make_optimizer once, right after shard()"
            )
        return self._build_engine(root, factory).optimizer

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        _engine(model).backward(loss)

    def step(self, model: nn.Module, optimizer: Any) -> None:
        _engine(model).step()

    def zero_grad(self, model: nn.Module, optimizer: Any) -> None:
        optimizer.zero_grad()

    # -- unshard ------------------------------------------------------------------------
    @contextlib.contextmanager
    def _unshard(
        self,
        model: nn.Module,
        fqn: str = "",
        *,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        recurse: bool = True,
        with_grads: bool = False,
    ) -> Iterator[None]:
        root = _root(model)
        if recurse:
            params = list(submodule(root.module, fqn).parameters())
        elif fqn in root.units:
            params = root.own_params(fqn)
        else:
            raise ValueError(f"deepspeed adapter: recurse=False needs a unit FQN; {fqn!r} is not one of {root.units}")
        # modifier_rank: on exit rank 0's values are broadcast and partitioned again; without
        # it the gathered values are dropped. Outside stage 3 this is a no-op: parameters are
        # replicated and inside the context every rank sees (and changes) its own copy.
        # Deliberately DeepSpeed's behaviour and nothing more: the ZeRO optimizer's fp32 master
        # copy is not refreshed, so the next step writes the old values back over a change
        # made here (set_local_shard, a test instrument, does refresh it).
        with self._ds.zero.GatheredParameters(params, modifier_rank=0 if writeback else None):
            yield

    # -- native checkpoint: DeepSpeed's own (per-rank ZeRO partitions of model and optimizer) ---
    def _save_checkpoint(self, model: nn.Module, optim: Any, directory: str) -> None:
        _engine_of(model).save_checkpoint(directory, tag=_CHECKPOINT_TAG)

    def _load_checkpoint(self, model: nn.Module, optim: Any, directory: str) -> None:
        path, _client_state = _engine_of(model).load_checkpoint(directory, tag=_CHECKPOINT_TAG)
        if path is None:
            raise RuntimeError(f"deepspeed adapter: DeepSpeed found no checkpoint {_CHECKPOINT_TAG!r} in {directory}")

    # -- state dicts ----------------------------------------------------------------------
    def _state_dict(self, model: nn.Module, kind: StateDictKind) -> dict[str, Any]:
        root = _root(model)
        with self._ds.zero.GatheredParameters(list(root.module.parameters())):
            return {name: value.detach().clone() for name, value in root.module.state_dict().items()}

    def _load_state_dict(self, model: nn.Module, state_dict: Mapping[str, Any], kind: StateDictKind) -> None:
        root = _root(model)
        # What engine.load_checkpoint(load_module_only=True) does without the files: load
        # under a gather that rank 0 modifies, then refresh the optimizer's fp32 master copy.
        with self._ds.zero.GatheredParameters(list(root.module.parameters()), modifier_rank=0):
            root.module.load_state_dict(dict(state_dict))
        optimizer = getattr(root.engine, "optimizer", None)
        if hasattr(optimizer, "refresh_fp32_params"):
            optimizer.refresh_fp32_params()

    def _optim_state_dict(self, model: nn.Module, optim: Any, kind: StateDictKind) -> dict[str, Any]:
        """torch's full optimizer-state layout keyed by parameter FQN (see
        docs/writing-an-adapter.md), assembled with DeepSpeed's safe_get_full_optimizer_state:
        one collective per parameter and elementwise state, on every rank."""
        from deepspeed.utils import safe_get_full_optimizer_state

        root = _root(model)
        base = _base_optimizer(root)
        state: dict[str, dict[str, Any]] = {}
        for fqn, param in root.module.named_parameters():
            if not param.requires_grad:
                # Frozen: no optimizer state (DeepSpeed leaves it out of its groups, and
                # safe_get_full_optimizer_state answers None; found by a generated program).
                continue
            if root.stage() == 0:  # the plain torch optimizer, keyed by the parameter itself
                entry = {k: _copy(v) for k, v in base.state.get(param, {}).items()}
            else:
                elementwise, scalars = _zero_state_layout(base)
                entry = {k: safe_get_full_optimizer_state(param, k).clone() for k in elementwise}
                entry.update({k: _copy(v) for k, v in scalars.items()})
            if entry:
                state[fqn] = entry
        groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": list(fqns)}
            for group, fqns in zip(base.param_groups, root.param_group_fqns)
        ]
        return {"state": state, "param_groups": groups}

    def _load_optim_state_dict(
        self, model: nn.Module, optim: Any, state_dict: Mapping[str, Any], kind: StateDictKind
    ) -> None:
        """Load what :meth:`optim_state_dict` produced: hyperparameters into the optimizer's
        groups, elementwise state through safe_set_full_optimizer_state (which writes this
        rank's partition), scalars (Adam's step) into every flat group's state."""
        from deepspeed.utils import safe_set_full_optimizer_state

        root = _root(model)
        base = _base_optimizer(root)
        saved_groups = state_dict.get("param_groups", [])
        if [list(g["params"]) for g in saved_groups] != root.param_group_fqns:
            raise ValueError(
                f"optimizer state dict groups {[g['params'] for g in saved_groups]} do not match "
                f"this optimizer's {root.param_group_fqns}"
            )
        for group, saved in zip(base.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        params = dict(root.module.named_parameters())

        def load() -> None:
            for fqn, entry in state_dict.get("state", {}).items():
                param = params[fqn]
                if root.stage() == 0:
                    base.state[param] = {k: _copy(v) for k, v in entry.items()}
                    continue
                # Elementwise states first: DeepSpeed writes them into state it created at
                # the first step, and raises (KeyError) before that; scalars have no such check.
                elementwise = [k for k, v in entry.items() if torch.is_tensor(v) and v.dim() > 0]
                for key in elementwise:
                    safe_set_full_optimizer_state(param, entry[key].to(self.env.device), key)
                for key, value in entry.items():
                    if key not in elementwise:
                        for flat_state in base.state.values():
                            flat_state[key] = _copy(value)

        _all_ranks_or_none(load, self.env.device)

    # -- storage ----------------------------------------------------------------------------
    # What a rank holds, by stage: stage 3 a padded flat part of each parameter (ds_tensor) and
    # of its gradient and optimizer state, the whole parameter while it is gathered; stages 1-2
    # whole parameters and, of the flat optimizer groups split over the ranks, the fragment of
    # each parameter that falls in this rank's partition (DeepSpeed's _hp_mapping, what its own
    # safe_get_full_* functions read); stage 0 everything whole.
    def local_shard(self, model: nn.Module, fqn: str) -> torch.Tensor:
        param = self.named_parameter(model, fqn)
        if hasattr(param, "ds_tensor"):
            if param.ds_status == self._ds.zero.ZeroParamStatus.AVAILABLE and param.data.numel() == param.ds_numel:
                return param.detach().clone()  # gathered (in forward, backward or a gather context)
            return param.ds_tensor.detach().clone()  # this rank's flat part, padding included
        return param.detach().clone()  # stages 0-2 keep every parameter whole on every rank

    def set_local_shard(self, model: nn.Module, fqn: str, value: torch.Tensor) -> None:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_local_fp32_param

        param = self.named_parameter(model, fqn)
        target = param.ds_tensor if hasattr(param, "ds_tensor") else param.data
        if value.shape != target.shape:
            raise ValueError(f"{fqn}: this rank stores shape {tuple(target.shape)}, got {tuple(value.shape)}")
        with torch.no_grad():
            target.copy_(value)
            # The ZeRO optimizer steps an fp32 master copy and writes it back over the
            # parameter: update it too, or the next step undoes the write.
            if hasattr(param, "ds_tensor") and getattr(param, "_z3_optimizer", None) is not None:
                safe_set_local_fp32_param(param, value)
            elif getattr(param, "_hp_mapping", None) is not None:
                safe_set_full_fp32_param(param, value)  # stages 1-2: writes this rank's fragment

    def local_grad_shard(self, model: nn.Module, fqn: str) -> torch.Tensor | None:
        from deepspeed.utils import safe_get_local_grad

        root = _root(model)
        param = self.named_parameter(model, fqn)
        if param.grad is not None:  # stage 0; stage 1 inside no_sync (local, not yet reduced)
            return param.grad.detach().clone()
        if root.stage() == 3:
            if getattr(param, "_z3_optimizer", None) is None:
                return None  # no engine yet: nothing was reduced
            grad = safe_get_local_grad(param)
            return None if grad is None else grad.detach().clone()
        if root.stage() in (1, 2):
            fragment = _reduced_grad_fragment(root, param)
            return None if fragment is None else fragment.detach().clone()
        return None

    def set_local_grad_shard(self, model: nn.Module, fqn: str, value: torch.Tensor) -> None:
        from deepspeed.utils import safe_set_local_grad

        root = _root(model)
        param = self.named_parameter(model, fqn)
        if param.grad is not None:
            target = param.grad
        elif root.stage() == 3 and getattr(param, "_z3_optimizer", None) is not None:
            safe_set_local_grad(param, value)
            return
        else:
            target = _reduced_grad_fragment(root, param) if root.stage() in (1, 2) else None
            if target is None:
                raise ValueError(f"{fqn}: this rank stores no gradient to overwrite (run a backward first)")
        if value.shape != target.shape:
            raise ValueError(f"{fqn} gradient: this rank stores shape {tuple(target.shape)}, got {tuple(value.shape)}")
        with torch.no_grad():
            target.copy_(value)

    def local_optim_state(self, model: nn.Module, optimizer: Any, fqn: str) -> dict[str, torch.Tensor]:
        """Stage 3: this rank's flat part of each elementwise state (safe_get_local_optimizer_state);
        stages 1-2: the views DeepSpeed links each parameter's fragment to at the first step
        (``_hp_mapping.optim_fragment``); stage 0: the torch optimizer's state of the parameter
        (under bf16/fp16, of its fp32 master copy). Empty before the first step."""
        from deepspeed.utils import safe_get_local_optimizer_state

        root = _root(model)
        param = self.named_parameter(model, fqn)
        if root.stage() == 3:
            keys, _ = _zero_state_layout(_base_optimizer(root))
            return {key: safe_get_local_optimizer_state(param, key).detach().clone() for key in keys}
        if root.stage() in (1, 2):
            mapping = getattr(param, "_hp_mapping", None)
            fragments = {} if mapping is None else (mapping.optim_fragment or {})
            return {key: value.detach().clone() for key, value in fragments.items() if value.dim() > 0}
        wrapper = _engine(model).optimizer  # the torch optimizer, or DeepSpeed's bf16/fp16 wrapper of it
        state = getattr(wrapper, "optimizer", wrapper).state.get(_stage0_master(root, param), {})
        return {key: v.detach().clone() for key, v in state.items() if torch.is_tensor(v) and v.dim() > 0}

    # -- gradient accumulation ---------------------------------------------------------------
    def no_gradient_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """``engine.no_sync()``: backward leaves local gradients in ``param.grad`` and skips the
        reduction; the next backward outside reduces what accumulated (stages 0 and 1; DeepSpeed
        refuses it under gradient partitioning, see UNSUPPORTED_COMBINATIONS)."""
        return _engine(model).no_sync()

    # -- introspection ----------------------------------------------------------------------
    def is_unsharded(self, model: nn.Module, unit: str) -> bool:
        root = _root(model)
        if unit not in root.units:
            raise ValueError(f"{unit!r} is not a unit; units are {root.units}")
        params = root.own_params(unit)
        if not params:
            raise ValueError(f"unit {unit!r} manages no parameters")
        status = self._ds.zero.ZeroParamStatus
        # Outside stage 3 parameters are never partitioned: always unsharded.
        return all(getattr(p, "ds_status", status.AVAILABLE) == status.AVAILABLE for p in params)

    def unsharded_storage_numel(self, model: nn.Module, unit: str) -> int:
        root = _root(model)
        if root.stage() < 3:
            stage = root.stage()
            raise ValueError(f"ZeRO stage {stage} keeps every parameter whole: it has no unsharded storage to free")
        if unit not in root.units:
            raise ValueError(f"{unit!r} is not a unit; units are {root.units}")
        # A released ZeRO-3 parameter's data is an empty tensor; a gathered one is a view of the
        # gather buffer (parameters gathered together may share one): each storage counted once.
        storages = {p.data.untyped_storage().data_ptr(): p.data for p in root.own_params(unit)}
        return sum(t.untyped_storage().nbytes() // t.element_size() for ptr, t in storages.items() if ptr)


_CHECKPOINT_TAG = "conformance"


def _engine_of(model: nn.Module) -> Any:
    """The DeepSpeed engine behind ``model`` (built by make_optimizer)."""
    engine = _root(model).engine
    if engine is None:
        raise RuntimeError("deepspeed adapter: a checkpoint needs the engine; call make_optimizer first")
    return engine


def _root(model: nn.Module) -> DeepSpeedModel:
    if not isinstance(model, DeepSpeedModel):
        raise TypeError(f"deepspeed adapter: expected the module shard() returned, got {type(model).__name__}")
    return model


def _engine(model: nn.Module) -> Any:
    root = _root(model)
    if root.engine is None:
        raise RuntimeError("deepspeed adapter: no engine yet: call make_optimizer (or run a forward) first")
    return root.engine


def _base_optimizer(root: DeepSpeedModel) -> torch.optim.Optimizer:
    """The torch optimizer the scenario's factory built (ZeRO wraps it as ``.optimizer``)."""
    optimizer = getattr(root.engine, "optimizer", None)
    if optimizer is None:
        raise RuntimeError("deepspeed adapter: no optimizer: call make_optimizer first")
    return getattr(optimizer, "optimizer", optimizer) if root.stage() > 0 else optimizer


def _reduced_grad_fragment(root: DeepSpeedModel, param: nn.Parameter) -> torch.Tensor | None:
    """ZeRO-1/2: this rank's part of ``param``'s reduced gradient, an empty tensor where its
    partition holds none of ``param``, None where the optimizer holds no reduced gradients of
    ``param``'s group (before the first backward, after step).

    DeepSpeed keeps the reduced gradients of a boundary backward per flat group and partition
    (``averaged_gradients``) until step; a parameter's ``_hp_mapping`` names its fragment there
    (``safe_get_full_grad`` reads the same). ``safe_get_local_grad`` is defined for ZeRO-3 only."""
    optimizer = getattr(root.engine, "optimizer", None)
    groups = getattr(optimizer, "bit16_groups", None)
    if groups is None:
        return None  # no engine yet
    group_index = next((i for i, group in enumerate(groups) if any(p is param for p in group)), None)
    if group_index is not None and getattr(optimizer, "cpu_offload", False):
        # ZeRO-Offload: a boundary backward copies the reduced gradients of this rank's partition
        # into the grad of its fp32 partition on the host, not into averaged_gradients (found by a
        # generated program: offload_params under ZeRO-2 reported no gradient anywhere).
        flat = optimizer.single_partition_of_fp32_groups[group_index]
        mapping = getattr(param, "_hp_mapping", None)
        if flat.grad is None:
            return None
        if mapping is None:
            return torch.empty(0, dtype=flat.grad.dtype, device=flat.grad.device)
        address = mapping.hp_fragment_address
        return flat.grad.narrow(0, address.start, address.numel)
    reduced = getattr(optimizer, "averaged_gradients", {})
    if group_index is None or reduced.get(group_index) is None:
        return None
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return torch.empty(0, dtype=reduced[group_index][0].dtype, device=param.device)
    return mapping.get_lp_grad_fragment(param._index_in_param_group)


def _stage0_master(root: DeepSpeedModel, param: nn.Parameter) -> torch.Tensor:
    """What the stage-0 torch optimizer keys ``param``'s state by: the parameter itself, or under
    bf16/fp16 the fp32 master copy DeepSpeed's FP16 optimizer wrapper steps in its place."""
    optimizer = root.engine.optimizer
    for low, master in zip(getattr(optimizer, "fp16_groups", ()), getattr(optimizer, "fp32_groups", ())):
        for low_param, master_param in zip(low, master):
            if low_param is param:
                return master_param
    return param


def _zero_state_layout(base: torch.optim.Optimizer) -> tuple[list[str], dict[str, Any]]:
    """Under ZeRO the base optimizer steps flat fp32 partitions: its elementwise states
    (Adam's exp_avg, ...) belong to the parameters laid out in them, its scalar states (step)
    to the whole group; every flat group is stepped together, so they agree."""
    elementwise: list[str] = []
    scalars: dict[str, Any] = {}
    for flat_state in base.state.values():
        for key, value in flat_state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                if key not in elementwise:
                    elementwise.append(key)
            else:
                scalars.setdefault(key, value)
    return elementwise, scalars


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor in it (tuples, lists, dicts) cast to ``dtype``."""
    if torch.is_tensor(value):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floating(item, dtype) for item in value)
    if isinstance(value, dict):
        return {key: _cast_floating(item, dtype) for key, item in value.items()}
    return value


def _copy(value: Any) -> Any:
    return value.detach().clone() if torch.is_tensor(value) else value


def _all_ranks_or_none(action: Callable[[], None], device: torch.device) -> None:
    """Run ``action`` on every rank; if it raised anywhere, raise on every rank.

    DeepSpeed's loaders can fail on some ranks only (a size check on the last rank); the
    others would otherwise walk into the next collective and wait for the timeout.
    """
    error: BaseException | None = None
    try:
        action()
    except Exception as caught:  # noqa: BLE001 - re-raised below, on this rank and the others
        error = caught
    failed = torch.tensor([error is not None], dtype=torch.int32, device=device)
    dist.all_reduce(failed)
    if error is not None:
        raise error
    if failed.item():
        raise RuntimeError(f"{int(failed.item())} other rank(s) failed here; see their report")
