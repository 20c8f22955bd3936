"""Divergences found inside a backend library that the adapter did not declare (parent side).

A collective's call site is the innermost frame outside torch, the harness and the packages an
adapter declares in ``BACKEND_MODULES`` (``conformance.suite.backend_fixture`` registers them with
``harness.skip_call_sites_in``). An adapter that wraps a library and declares nothing gets, at a
divergence, call sites inside the library's own files: the same lines on every rank, which say
nothing about which scenario or adapter call led there. The verdict is still right; the hint says
what to declare so the next run names the line that matters.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from harness import CollectiveRecord, DistributedTestResult

# The suite's own packages: a site in them is a scenario's or the suite's line, never a library's.
_SUITE_PACKAGES = frozenset({"conformance", "harness", "fixtures"})


@dataclass(frozen=True)
class LibrarySite:
    """A divergent collective's call site inside an undeclared library."""

    site: str
    """``file:line`` as the trace shows it."""
    module: str
    """The dotted module of that file (``mylib.comm.gather``)."""
    package: str
    """What to declare: the shortest package of ``module`` that does not hold the adapter's own
    module (``mylib`` for an adapter in ``myadapter``; ``mypkg.comm`` for one in ``mypkg.adapter``)."""


def module_of(file: str, base: Path, search_path: Iterable[str] | None = None) -> str | None:
    """The dotted module name of ``file`` (relative paths from ``base``, the ranks' working
    directory) by the innermost module search path entry holding it; None outside every entry."""
    path = (base / file).resolve()
    best: Path | None = None
    for entry in sys.path if search_path is None else search_path:
        root = (base / entry).resolve() if entry else base.resolve()
        if root in path.parents and (best is None or len(root.parts) > len(best.parts)):
            best = root
    if best is None:
        return None
    parts = list(path.relative_to(best).with_suffix("").parts)
    if parts and parts[-1] == "__init__":
        parts.pop()
    if not parts or not all(part.isidentifier() for part in parts):
        return None
    return ".".join(parts)


def _declared(module: str, declared: Iterable[str]) -> bool:
    return any(module == name or module.startswith(f"{name}.") for name in declared)


def divergent_records(result: DistributedTestResult) -> list[CollectiveRecord]:
    """What each rank of the divergent group issued at the first divergence of ``result``, and,
    for a rank that stopped before it, its last call."""
    records = []
    for rank, index in result.diverged_at.items():
        trace = result.traces.get(rank, [])
        at = [record for record in trace if record.index == index] if index is not None else trace[-1:]
        records += at
    return records


def undeclared_library_sites(
    records: Iterable[CollectiveRecord], backend_modules: Iterable[str], adapter_module: str, base: Path
) -> list[LibrarySite]:
    """The call sites of ``records`` that lie in a library ``backend_modules`` does not declare:
    not the suite's own packages, not the adapter's own package, not a file outside every import
    root (a test file run as a script)."""
    declared = tuple(backend_modules)
    found: dict[str, LibrarySite] = {}
    for record in records:
        if not record.site or record.site in found:
            continue
        file = record.site.rpartition(":")[0]
        module = module_of(file, base)
        if module is None:
            continue
        if module.partition(".")[0] in _SUITE_PACKAGES or module == adapter_module or _declared(module, declared):
            continue
        found[record.site] = LibrarySite(record.site, module, _package_to_declare(module, adapter_module))
    return list(found.values())


def _package_to_declare(module: str, adapter_module: str) -> str:
    parts, own = module.split("."), adapter_module.split(".")
    shared = 0
    while shared < min(len(parts), len(own)) and parts[shared] == own[shared]:
        shared += 1
    return ".".join(parts[: shared + 1])


def describe(test_id: str, adapter_name: str, adapter_class: str, sites: list[LibrarySite]) -> str:
    """One hint: where the divergence was seen and the line to add to the adapter."""
    packages = list(dict.fromkeys(site.package for site in sites))
    shown = ", ".join(f"{site.site} ({site.module})" for site in sites[:3]) + (" ..." if len(sites) > 3 else "")
    return (
        f"{test_id}: the divergent collectives were issued inside {', '.join(packages)} ({shown}), "
        f"which {adapter_class}.BACKEND_MODULES does not declare: those lines are the library's own, alike "
        f"on every rank. Declare BACKEND_MODULES = {tuple(packages)!r} in the {adapter_name} adapter, so "
        "call sites name the adapter's or the scenario's line that called into it "
        "(docs/writing-an-adapter.md, BACKEND_MODULES)"
    )
