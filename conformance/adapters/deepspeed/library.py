"""DeepSpeed itself: imported with the rank's accelerator, kept on torch.distributed for its
collectives, and its ZeRO-3 gathers labelled with the parameters they fetch.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from conformance.adapters._labels import label_calls

# parameter -> original FQN, for collective labels: filled by shard(), emptied by close(). Weak and
# by identity: tensors compare elementwise, and a plain id key could name a later parameter that
# reuses a dead one's address with the dead one's FQN.
PARAM_FQNS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def label_collectives() -> None:
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
        return sorted(PARAM_FQNS.get(p, "?") for p in params)

    label_calls(PartitionedParameterCoordinator, gather, fqns)


def choose_accelerator(device: torch.device) -> None:
    """Name ``device``'s accelerator to DeepSpeed (``DS_ACCELERATOR``) unless one is named: it
    picks one at its first import, else by probing (``torch.cuda.device_count()``)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if device.type == "cpu" else device.type)


def import_deepspeed(device: torch.device) -> Any:
    """Import DeepSpeed with the accelerator of ``device``: it picks one at import, from
    ``DS_ACCELERATOR`` or by probing, and a CPU rank on a GPU machine must not get CUDA."""
    choose_accelerator(device)
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
