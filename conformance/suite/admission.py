"""Whether a selected backend can run any scenario here at all, decided once at session start.

A backend that can run nothing on this machine must not produce a run of skips and vacuous
passes: it is refused before any test starts, with every reason found. Each check is a function
``(adapter class, run context) -> reason or None`` in :data:`CHECKS`; add a check there.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from conformance.protocol import ApiForm, BackendAdapter, BackendEnv, Capability


@dataclass(frozen=True)
class SessionContext:
    """What the session knows before any rank exists: the device its worlds get (None when it
    gets none, e.g. ``--device cuda`` without GPUs: the harness fails that run itself)."""

    device: torch.device | None


def _probe(adapter_cls: type[BackendAdapter], device: torch.device) -> BackendAdapter:
    """An adapter built as a rank of a world of one on ``device`` would build it, so that
    ``capabilities()`` answers as it will in the ranks. Its constructor may set the
    environment (libraries read torchrun's variables): the parent's is put back."""
    saved = dict(os.environ)
    try:
        return adapter_cls(BackendEnv(rank=0, world_size=1, device=device, local_rank=0))
    finally:
        os.environ.clear()
        os.environ.update(saved)


def no_usable_form(adapter_cls: type[BackendAdapter], context: SessionContext) -> str | None:
    """A backend that drops both API forms on this device (a CUDA-only library on a CPU runner)
    would let every scenario that loops over its forms pass having sharded nothing."""
    if context.device is None:
        return None
    overrides = any(
        getattr(adapter_cls, method) is not getattr(BackendAdapter, method) for method in ("capabilities", "forms")
    )
    if not overrides:
        return None  # CAPABILITIES itself must name a form (checked when the class is defined)
    try:
        forms = _probe(adapter_cls, context.device).forms()
    except Exception as error:  # noqa: BLE001 - any failure is the adapter's, reported with its cause
        return (
            f"building it on {context.device} to ask for its capabilities() raised "
            f"{type(error).__name__}: {error}; the adapter must be constructible in any rank of its devices"
        )
    if forms:
        return None
    wanted = " or ".join(Capability.for_form(form).name for form in ApiForm)
    return (
        f"its capabilities() on {context.device} include neither {wanted}, so no scenario could shard "
        "anything here; run it on a device it supports (--device), or declare the devices it runs on "
        "(docs/writing-an-adapter.md, 'Backends that run only on CUDA')"
    )


CHECKS: list[Callable[[type[BackendAdapter], SessionContext], str | None]] = [no_usable_form]


def refusals(adapter_cls: type[BackendAdapter], context: SessionContext) -> list[str]:
    """Every reason this backend cannot run here (empty: admitted)."""
    return [reason for check in CHECKS if (reason := check(adapter_cls, context)) is not None]
