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
fp16 runs with a static ``loss_scale`` of 1, i.e. without loss scaling, as ``ShardingSpec``'s
mixed precision (torch FSDP's ``MixedPrecision``, which leaves scaling to a separate
``ShardedGradScaler``) and the oracle have it. DeepSpeed's default, dynamic scaling starting at
2**16 (``initial_scale_power`` 16), changes what scenarios compare in two ways (DeepSpeed 0.19.8,
docs/findings.md): under ZeRO-1/2/3 the first backward of a float16 loss overflows (the gradient
of ``65536 x loss`` with respect to the loss is 65536, inf in float16), so the first steps are
skipped while the scale shrinks; under ZeRO-0 (``FP16_UnfusedOptimizer``, not a
``ZeROOptimizer``) ``engine.backward`` never multiplies the loss by the scale, yet ``step``
divides the gradients by it, so every update is 65536 times too small (upstream
deepspeedai/DeepSpeed#8393). DeepSpeed's CPU accelerator offers fp16 only where oneDNN has it
(``torch.ops.mkldnn._is_mkldnn_fp16_supported()``: AVX512-FP16 or AMX-FP16 CPUs; capped by
``ONEDNN_MAX_CPU_ISA``), so without this the same scenario passed on one CPU and failed on another.

Gradient accumulation: ``gradient_accumulation_steps`` is 1, so every ``engine.backward`` is an
accumulation boundary. Stages 0 and 3 add a second backward's gradients to the first's; stages 1
and 2 replace this rank's reduced partition with the newer one (observed on 0.19.8).
``no_gradient_sync`` is ``engine.no_sync()``, which DeepSpeed refuses under gradient
partitioning (stages 2 and 3).

Rank environment: DeepSpeed reads ``LOCAL_RANK`` (and ``RANK``, ``WORLD_SIZE``) from the
environment and caches process groups in ``deepspeed.utils.groups``; the adapter sets the
former from its ``BackendEnv`` for each test and drops the latter in :meth:`close`, since the
harness destroys every group a test created.

The modules: ``adapter`` (the protocol), ``model`` (what ``shard`` returns and where DeepSpeed keeps
each rank's state), ``library`` (importing DeepSpeed and what the adapter sets in it).
"""

import importlib.util

if importlib.util.find_spec("deepspeed") is None:
    raise ImportError(
        "the deepspeed backend needs DeepSpeed: DS_BUILD_OPS=0 pip install "
        "'fsdp-conformance[deepspeed]' (or deepspeed itself)"
    )

from conformance.adapters.deepspeed.adapter import DeepSpeedAdapter
from conformance.adapters.deepspeed.model import DeepSpeedModel

__all__ = ["DeepSpeedAdapter", "DeepSpeedModel"]
