"""The zero2_lib adapter as the docs of protocol 4 had its author write it (issue 41): they mapped
ZeRO stage 2 to ``SHARD_GRAD_OP`` (``SHARD_GRAD_AND_OPTIM_STATE`` came with protocol 5), so it
declares the strategy FSDP means by that name, which also shards parameters at rest, for a backend
that keeps them whole on every rank. It is the real adapter
(examples/zero2-backend/zero2_backend/adapter.py) with what that version changes: the version, the
strategy declared, none of protocol 5's capabilities, and ``_unshard`` in its keyword form.

Its training is right (zero2_lib's stage 2, run exactly as the real adapter runs it), so only the
suite's storage checks can tell: its passes fail as ``StorageClaimNotMet``, naming the strategy
whose claims match what the ranks store (``SHARD_GRAD_AND_OPTIM_STATE``), for the self-test
(tests/conformance_tests/test_zero2_from_docs.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch.nn as nn
from zero2_backend import lib as zero2_lib
from zero2_backend.adapter import Zero2Adapter

from conformance.protocol import Capability

_ADDED_SINCE = {Capability.SHARD_GRAD_AND_OPTIM_STATE, Capability.REDUCE_DTYPE, Capability.NO_SYNC}  # protocol 5


class Zero2OldDocsAdapter(Zero2Adapter):
    PROTOCOL_VERSION = 4
    name = "zero2-from-old-docs"
    CAPABILITIES = (Zero2Adapter.CAPABILITIES - _ADDED_SINCE) | {Capability.SHARD_GRAD_OP}
    UNSUPPORTED_REASONS: ClassVar[Mapping[Capability, str]] = {
        capability: reason
        for capability, reason in Zero2Adapter.UNSUPPORTED_REASONS.items()
        if capability is not Capability.SHARD_GRAD_OP and capability not in _ADDED_SINCE
    }

    # Protocol 4's form: the unshard options as keywords (protocol 6 passes one UnshardRequest).
    @contextlib.contextmanager
    def _unshard(self, model: nn.Module, fqn: str = "", *, writeback: bool = True, **options: Any) -> Iterator[None]:
        with zero2_lib.engine_of(model).full_params(writeback=writeback):
            yield
