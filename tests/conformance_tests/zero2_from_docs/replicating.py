"""A broken twin of the zero2_lib adapter, for its self-test: it declares ZeRO-2 but runs zero2_lib's
stage 0 (gradients all-reduced and kept whole, every rank stepping the whole optimizer state).

It trains exactly like the oracle, so only the suite's storage checks (the storage scenario and
the vacuity check after every passed test) can tell it from the real adapter: the self-test
runs both and shows that the same scenarios the real adapter passes fail here as "does not
store what its strategy claims", i.e. that those passes were not vacuous.
"""

from __future__ import annotations

import torch.nn as nn
from zero2_backend import lib as zero2_lib
from zero2_backend.adapter import Zero2Adapter

from conformance.protocol import ApiForm, ShardingSpec


class Zero2ReplicatingAdapter(Zero2Adapter):
    name = "zero2-from-docs-replicating"

    def _shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
        return zero2_lib.wrap(model, stage=0)  # whatever the strategy: nothing is partitioned
