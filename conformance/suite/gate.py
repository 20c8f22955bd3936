"""The session gate: which selected backends this session runs, decided once before any test.

A backend that cannot run on a device its worlds get must not produce a run of errors, skips
or vacuous passes there. The harness says which device kinds this session's worlds may get
(`harness.device_kinds`: `--device cpu` or `cuda`, that one; `auto`, cpu plus cuda where GPUs
are visible, since a world with more ranks than GPUs runs on cpu). A backend is admitted only
when, for every one of those kinds,

* its declared platforms allow that kind with the running torch: ``SUPPORTED_PLATFORMS``
  (device kind -> the torch versions it runs on there, written as an expectation's
  ``when.torch``: ``">=2.7"``, ``""`` for every torch; a kind left out is not supported) and
  ``PLATFORM_REASONS`` (device kind -> why, for the refusal); and
* it has a usable API form there: built as rank 0 of a world of one on that device, in a child
  forked for that kind (``conformance.suite.probe``: pytest imports no backend library), its
  ``capabilities()`` include WRAPPER or COMPOSABLE (a backend that finds out
  only at run time that it needs CUDA drops both on cpu; every scenario looping over its forms
  would pass having sharded nothing).

A backend the user named that is refused is a usage error (exit 4), with every reason: the
device kind, the backend and the fix. One that ``--backend all`` brought in is left out, and
the report header says why.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import pytest

import harness
from conformance.protocol import ApiForm, BackendAdapter, Capability
from conformance.suite import probe
from conformance.suite.expectations import torch_matches

_DECLARE = "docs/writing-an-adapter.md, 'Backends that run only on CUDA'"


@dataclass(frozen=True)
class SessionDevices:
    """What the harness decided about this session's devices before any rank exists."""

    kinds: tuple[str, ...]
    """Every device kind this session's worlds may get (`harness.device_kinds`)."""
    reachable: bool
    """Whether any world gets its device here. False for `--device cuda` without GPUs (the
    harness fails that run itself): the adapter is then not built to ask for its forms."""


def session_devices(config: pytest.Config) -> SessionDevices:
    """The harness's device decision for this session, as the gate needs it."""
    return SessionDevices(tuple(harness.device_kinds(config)), harness.world_device(config) is not None)


class BackendRefused(ValueError):
    """A backend the user named cannot run on this session's devices or torch (or declares its
    platforms wrongly); the message says why and what to do."""


def unsupported(adapter_cls: type[BackendAdapter], device_kind: str, torch_version: str) -> str | None:
    """Why ``adapter_cls`` declares it does not run on ``device_kind`` with torch ``torch_version``, or None."""
    declared = adapter_cls.SUPPORTED_PLATFORMS
    reason = adapter_cls.PLATFORM_REASONS.get(device_kind)
    if device_kind not in declared:
        return f"it does not run on {device_kind}" + (f": {reason}" if reason else "")
    versions = declared[device_kind]
    if versions and not torch_matches(versions, torch_version):
        because = f": {reason}" if reason else ""
        return f"on {device_kind} it needs torch {versions}, this is torch {torch_version}{because}"
    return None


def no_usable_form(adapter_cls: type[BackendAdapter], device_kind: str) -> str | None:
    """Why ``adapter_cls`` has no API form on ``device_kind``, or None when it has one."""
    overrides = any(
        getattr(adapter_cls, method) is not getattr(BackendAdapter, method) for method in ("capabilities", "forms")
    )
    if not overrides:
        return None  # CAPABILITIES itself must name a form (checked when the class is defined)
    try:
        forms = probe.forms_on(adapter_cls, device_kind)
    except probe.ProbeFailed as error:
        return (
            f"building it on {device_kind} to ask for its capabilities() failed: {error}; the adapter must "
            "be constructible in any rank of its devices"
        )
    except Exception as error:  # noqa: BLE001 - built in pytest (more than one thread): the adapter's failure
        return (
            f"building it on {device_kind} to ask for its capabilities() raised {type(error).__name__}: "
            f"{error}; the adapter must be constructible in any rank of its devices"
        )
    if forms:
        return None
    wanted = " or ".join(Capability.for_form(form).name for form in ApiForm)
    return (
        f"its capabilities() on {device_kind} include neither {wanted}, so no scenario could shard anything "
        f"on {device_kind}"
    )


def refusal(name: str, adapter_cls: type[BackendAdapter], devices: SessionDevices, torch_version: str) -> str | None:
    """Why backend ``name`` cannot run in this session (every device kind that refuses it, and
    the fix), or None when it is admitted on every kind its worlds may get."""
    declared: list[str] = []
    formless: list[str] = []
    for kind in devices.kinds:
        why = unsupported(adapter_cls, kind, torch_version)
        if why is not None:
            declared.append(why)
        elif devices.reachable and (why := no_usable_form(adapter_cls, kind)) is not None:
            formless.append(why)
    if not declared and not formless:
        return None
    fixes = []
    if declared:
        fixes.append(f"run it on a device and torch it declares ({describe(adapter_cls)}; --device picks the device)")
    if formless:
        fixes.append(
            "run it on a device where it has an API form (--device picks the device; with --device auto a world "
            "with more ranks than visible GPUs runs on cpu), or declare the devices it runs on in "
            f"SUPPORTED_PLATFORMS ({_DECLARE})"
        )
    reasons = "; ".join(declared + formless)
    return f"backend {name!r} cannot run here: {reasons}. Fix: {'; '.join(fixes)}; or leave it out of --backend"


def describe(adapter_cls: type[BackendAdapter]) -> str:
    """``SUPPORTED_PLATFORMS`` in words: "cpu with torch >=2.7, cuda with any torch"."""
    platforms = adapter_cls.SUPPORTED_PLATFORMS
    return ", ".join(f"{kind} with {f'torch {v}' if v else 'any torch'}" for kind, v in platforms.items()) or "none"


def refused_backends(
    adapters: Mapping[str, type[BackendAdapter]],
    named: Iterable[str],
    devices: SessionDevices,
    torch_version: str,
) -> dict[str, str]:
    """selection -> refusal for the selections in ``adapters`` that cannot run in this session.

    Selections the user ``named`` themselves (not ones ``all`` brought in) that cannot run raise
    :class:`BackendRefused`, with every one's reason: the run could not do what was asked. The
    others are left out, and the caller says so once (the report header).
    """
    named = set(named)
    refused: dict[str, str] = {}
    named_refused: list[str] = []
    for selection, adapter_cls in adapters.items():
        try:
            why = refusal(adapter_cls.name, adapter_cls, devices, torch_version)
        except ValueError as error:  # a malformed version condition
            raise BackendRefused(
                f"backend {selection!r}: SUPPORTED_PLATFORMS {dict(adapter_cls.SUPPORTED_PLATFORMS)} is not "
                f"valid: {error}; write each device kind's torch versions as an expectation's when.torch "
                '(">=2.7", "" for every torch)'
            ) from None
        if why is None:
            continue
        if selection in named:
            named_refused.append(why)
        refused[selection] = why
    if named_refused:
        raise BackendRefused("\n".join(named_refused))
    return refused
