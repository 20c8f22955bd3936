"""Adapters over tests/conformance_tests/owner_broadcast_lib, with and without its declared packages
(``BACKEND_MODULES``), for the call-site self-test in test_backend_divergence.py."""

from __future__ import annotations

from typing import ClassVar

import torch.nn as nn

from conformance.adapters.template import TemplateAdapter
from conformance.protocol import PROTOCOL_VERSION, ApiForm, ShardingSpec
from tests.conformance_tests import owner_broadcast_lib


class OwnerBroadcastAdapter(TemplateAdapter):
    """The template's DDP backend, started from the owner's parameters by owner_broadcast_lib,
    whose code it declares as the backend library's."""

    name = "owner-broadcast"
    PROTOCOL_VERSION = PROTOCOL_VERSION
    BACKEND_MODULES: ClassVar[tuple[str, ...]] = ("tests.conformance_tests.owner_broadcast_lib",)

    def _shard(self, model: nn.Module, spec: ShardingSpec, form: ApiForm) -> nn.Module:
        owner_broadcast_lib.replicate_from_owner(model, owner=0)
        return super()._shard(model, spec, form)


class OwnerBroadcastUndeclared(OwnerBroadcastAdapter):
    """The same backend, its library left undeclared: the library's two lines are the call sites."""

    name = "owner-broadcast-undeclared"
    BACKEND_MODULES: ClassVar[tuple[str, ...]] = ()
