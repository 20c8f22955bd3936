"""Where a backend runs: the device kinds and torch versions an adapter declares, checked once.

An adapter class declares ``SUPPORTED_PLATFORMS`` (device kind -> the torch versions it runs on
there, written as an expectation's ``when.torch``: ``">=2.7"``, ``""`` for every torch; a device
kind left out is not supported) and ``PLATFORM_REASONS`` (device kind -> why, for the refusal).
The conformance plugin asks :func:`refusal` at session start, for every device kind the session
may put ranks on, so a backend that cannot run here is refused once with the reason, instead of
failing every scenario with the same error.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from conformance.protocol import BackendAdapter
from conformance.suite.expectations import torch_matches


def unsupported(adapter_cls: type[BackendAdapter], device_kind: str, torch_version: str) -> str | None:
    """Why ``adapter_cls`` does not run on ``device_kind`` with torch ``torch_version``, or None."""
    declared = adapter_cls.SUPPORTED_PLATFORMS
    reason = adapter_cls.PLATFORM_REASONS.get(device_kind)
    if device_kind not in declared:
        return f"it does not run on {device_kind}" + (f": {reason}" if reason else "")
    versions = declared[device_kind]
    if versions and not torch_matches(versions, torch_version):
        because = f": {reason}" if reason else ""
        return f"on {device_kind} it needs torch {versions}, this is torch {torch_version}{because}"
    return None


def refusal(
    name: str, adapter_cls: type[BackendAdapter], device_kinds: Iterable[str], torch_version: str
) -> str | None:
    """The session-start refusal of backend ``name`` on ``device_kinds``, or None if it runs on all."""
    reasons = [why for kind in device_kinds if (why := unsupported(adapter_cls, kind, torch_version))]
    if not reasons:
        return None
    return (
        f"backend {name!r} cannot run here: {'; '.join(reasons)}. Run it on a device and torch "
        f"it declares ({describe(adapter_cls)}; --device picks the device) or leave it out of --backend"
    )


def describe(adapter_cls: type[BackendAdapter]) -> str:
    """``SUPPORTED_PLATFORMS`` in words: "cpu with torch >=2.7, cuda with any torch"."""
    platforms = adapter_cls.SUPPORTED_PLATFORMS
    return ", ".join(f"{kind} with {f'torch {v}' if v else 'any torch'}" for kind, v in platforms.items()) or "none"


class PlatformRefusal(ValueError):
    """A backend the user named cannot run on this session's devices or torch; the message says why."""


def refused_backends(
    adapters: Mapping[str, type[BackendAdapter]],
    named: Iterable[str],
    device_kinds: Iterable[str],
    torch_version: str,
) -> dict[str, str]:
    """selection -> refusal for the selections in ``adapters`` that cannot run here.

    A selection the user ``named`` itself (not one ``all`` brought in) that cannot run raises
    :class:`PlatformRefusal`: the run could not do what was asked. The others are left out, and
    the caller says so once (the report header).
    """
    kinds = tuple(device_kinds)
    named = set(named)
    refused: dict[str, str] = {}
    for selection, adapter_cls in adapters.items():
        try:
            why = refusal(adapter_cls.name, adapter_cls, kinds, torch_version)
        except ValueError as error:  # a malformed version condition
            raise PlatformRefusal(
                f"backend {selection!r}: SUPPORTED_PLATFORMS {dict(adapter_cls.SUPPORTED_PLATFORMS)} is not "
                f"valid: {error}"
            ) from None
        if why is None:
            continue
        if selection in named:
            raise PlatformRefusal(why)
        refused[selection] = why
    return refused
