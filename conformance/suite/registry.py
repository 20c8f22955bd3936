"""Backend names -> adapter classes: built-ins, entry points, and ``package.module:attr``.

A *selection* is the string a user passes to ``--backend``. The conformance plugin resolves each
once (:func:`load`) and parametrizes tests with a :class:`BackendParam`: the selection, with the
adapter's name and the ``module:attr`` it resolved to, which the rank side imports directly
(:func:`adapter_class`). Test ids, reports and
expectations use the adapter's ``name`` instead (:func:`name_of`): the same as the selection
for a registered name, the class's ``name`` for ``module:attr``. Built-in names win over entry
points of the same name.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from importlib.metadata import EntryPoint, PackageNotFoundError, entry_points, version

from conformance.protocol import BackendAdapter

ENTRY_POINT_GROUP = "fsdp_conformance.backends"
ALL = "all"
DEFAULT = "reference"

BUILTIN: dict[str, str] = {
    "reference": "conformance.adapters.reference:ReferenceAdapter",
    "torch-fsdp1": "conformance.adapters.torch_fsdp1:TorchFSDP1Adapter",
    "torch-fsdp2": "conformance.adapters.torch_fsdp2:TorchFSDP2Adapter",
    "torch-zero": "conformance.adapters.torch_zero:TorchZeroAdapter",
}

# Built-in adapters for libraries this project does not depend on: listed (and part of ``all``)
# only where the library is importable. name -> (library module, adapter target, how to install).
OPTIONAL_BUILTIN: dict[str, tuple[str, str, str]] = {
    "deepspeed": (
        "deepspeed",
        "conformance.adapters.deepspeed:DeepSpeedAdapter",
        "DS_BUILD_OPS=0 pip install 'fsdp-conformance[deepspeed]'",
    ),
}


class BackendSelectionError(ValueError):
    """A --backend value that names nothing loadable; the message says what would work."""


def _builtin_targets() -> dict[str, str]:
    """Built-in names -> targets: the always-present ones, then the optional ones installed here."""
    targets = dict(BUILTIN)
    for name, (library, target, _install) in OPTIONAL_BUILTIN.items():
        if importlib.util.find_spec(library) is not None:
            targets[name] = target
    return targets


def _entry_points() -> dict[str, EntryPoint]:
    return {
        ep.name: ep
        for ep in entry_points(group=ENTRY_POINT_GROUP)
        if ep.name not in BUILTIN and ep.name not in OPTIONAL_BUILTIN
    }


def _entry_point_targets() -> dict[str, str]:
    return {name: ep.value for name, ep in _entry_points().items()}


def origin(selection: str, target: str | None = None) -> str:
    """Where an accepted selection comes from, for the run's header: ``built-in``,
    ``optional built-in (deepspeed 0.19.8)``, ``entry point of vendor-pkg 1.2``, or
    ``import path``; each followed by the ``module:attr`` it loads (``target``, when the caller
    resolved it already)."""
    if _is_target(selection):
        return f"import path {selection}"
    target = target or target_of(selection)
    if selection in BUILTIN:
        return f"built-in {target}"
    if selection in OPTIONAL_BUILTIN:
        library = OPTIONAL_BUILTIN[selection][0]
        return f"optional built-in {target} ({library} {_version(library)})"
    point = _entry_points()[selection]
    dist = getattr(point, "dist", None)
    package = f"{dist.name} {dist.version}" if dist is not None else "an installed package"
    return f"entry point of {package}: {target}"


def missing_optional() -> dict[str, str]:
    """Optional built-in backends whose library is not installed here: name -> install command."""
    return {
        name: install
        for name, (library, _target, install) in OPTIONAL_BUILTIN.items()
        if importlib.util.find_spec(library) is None
    }


def _version(distribution: str) -> str:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return "version unknown"


def known_names() -> list[str]:
    """Every name ``--backend`` accepts besides ``all`` and ``module:attr``."""
    return [*_builtin_targets(), *sorted(_entry_point_targets())]


def _is_target(selection: str) -> bool:
    return ":" in selection


def select(requested: list[str]) -> list[str]:
    """Expand ``all``, drop duplicates (keeping order) and check every name exists.

    ``module:attr`` selections are imported right away: the user named code explicitly, so a
    typo should stop the run before any test starts.
    """
    selected = _expanded(requested)
    for selection in selected:
        if _is_target(selection):
            load(selection)
    return selected


def resolve(requested: list[str]) -> list[tuple[str, str, type[BackendAdapter]]]:
    """What :func:`select` selects, each resolved once: (selection, its ``module:attr`` target,
    the adapter class). The conformance plugin's one resolution of ``--backend``."""
    resolved = []
    for selection in _expanded(requested):
        target = target_of(selection)
        resolved.append((selection, target, load_target(target, selection)))
    return resolved


def _expanded(requested: list[str]) -> list[str]:
    names = known_names()
    selected: list[str] = []
    for item in requested:
        expanded = names if item == ALL else [item]
        for selection in expanded:
            # An import path is imported by the caller (select, resolve); a name must be known.
            if not _is_target(selection) and selection in OPTIONAL_BUILTIN and selection not in names:
                library, _target, install = OPTIONAL_BUILTIN[selection]
                raise BackendSelectionError(
                    f"backend {selection!r} needs the {library!r} package, which is not installed "
                    f"here; install it with: {install}"
                )
            if not _is_target(selection) and selection not in names:
                raise BackendSelectionError(
                    f"unknown backend {selection!r}; known backends: {', '.join(names)} "
                    f"(or '{ALL}', or an adapter class as 'package.module:attr', or register one "
                    f"under the entry-point group '{ENTRY_POINT_GROUP}')"
                )
            if selection not in selected:
                selected.append(selection)
    return selected


def target_of(selection: str) -> str:
    """The ``module:attr`` an accepted selection points to."""
    if _is_target(selection):
        return selection
    target = _builtin_targets().get(selection) or _entry_point_targets().get(selection)
    if target is None:
        raise BackendSelectionError(f"unknown backend {selection!r}; known backends: {', '.join(known_names())}")
    return target


def _import_failure(selection: str, module_name: str, error: ImportError) -> str:
    """Why an adapter module did not import, and the fix: the module itself not on the search path
    (name the directory to pass with --backend-path), or something it imports missing."""
    missing = getattr(error, "name", None)
    search_path = ", ".join(entry or "'' (the working directory)" for entry in sys.path)
    top = module_name.partition(".")[0]
    if missing is not None and (module_name == missing or module_name.startswith(f"{missing}.")):
        return (
            f"backend {selection!r} is not available: module {module_name!r} is not on the module search "
            f"path ({error}); pass --backend-path DIR with the directory that holds {top!r} ({top}.py or "
            f"{top}/), or pip install the package that provides it. Searched (sys.path): {search_path}"
        )
    return (
        f"backend {selection!r} is not available: importing {module_name!r} failed ({error}); "
        + (
            f"{missing!r}, which it imports, is missing: install it, or pass --backend-path DIR with the "
            f"directory that holds it. "
            if missing is not None
            else "install what it imports, or choose another --backend. "
        )
        + f"Searched (sys.path): {search_path}"
    )


def load(selection: str) -> type[BackendAdapter]:
    """Import the adapter class behind ``selection``, with an error that names the fix."""
    return load_target(target_of(selection), selection)


def load_target(target: str, selection: str | None = None) -> type[BackendAdapter]:
    """Import the adapter class at ``target`` (``module:attr``, already resolved from a selection:
    no name is looked up again); errors name ``selection``, the value the user gave."""
    selection = target if selection is None else selection
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise BackendSelectionError(f"backend {selection!r}: expected 'package.module:attr', got {target!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise BackendSelectionError(_import_failure(selection, module_name, error)) from error
    except Exception as error:
        raise BackendSelectionError(
            f"backend {selection!r}: importing {module_name!r} raised {type(error).__name__}: {error}; "
            f"fix the adapter module (run `python -c 'import {module_name}'` to see the traceback)"
        ) from error
    try:
        adapter = getattr(module, attr)
    except AttributeError:
        raise BackendSelectionError(
            f"backend {selection!r}: module {module_name!r} has no attribute {attr!r}"
        ) from None
    if not (isinstance(adapter, type) and issubclass(adapter, BackendAdapter)):
        raise BackendSelectionError(
            f"backend {selection!r}: {target} is {adapter!r}, not a subclass of conformance.protocol.BackendAdapter"
        )
    if inspect.isabstract(adapter):
        missing = ", ".join(sorted(adapter.__abstractmethods__))
        raise BackendSelectionError(
            f"backend {selection!r}: {target} does not implement the protocol's abstract methods {missing}; "
            "implement them (docs/writing-an-adapter.md; conformance/adapters/template.py lists every method)"
        )
    return adapter


class BackendParam(str):
    """The value a backend parametrizes a test with: the selection as given (what it equals and
    prints as: a parent-side test may compare it with ``"torch-fsdp2"``, and REPRO lines carry
    it), with what pytest resolved it to once: the adapter's ``name`` and the ``module:attr``
    ``target``. A rank opens the backend from ``target`` (:func:`adapter_class`), resolving no
    name again (no entry-point scan per test)."""

    name: str
    target: str

    def __new__(cls, selection: str, name: str, target: str) -> BackendParam:
        value = super().__new__(cls, selection)
        value.name = name
        value.target = target
        return value

    @property
    def selection(self) -> str:
        return str.__str__(self)

    def __reduce__(self) -> tuple[type[BackendParam], tuple[str, str, str]]:
        return (BackendParam, (self.selection, self.name, self.target))


def adapter_class(backend: str) -> type[BackendAdapter]:
    """The adapter class of a test's ``backend`` value: a :class:`BackendParam` is imported from
    its resolved target; a plain selection string (a caller of the suite's own helpers) is
    resolved by name first."""
    if isinstance(backend, BackendParam):
        return load_target(backend.target, backend.selection)
    return load(backend)


def name_of(selection: str) -> str:
    """The adapter's ``name``: what test ids, reports and expectations use for ``selection``
    (a ``module:attr`` selection shows as its class's ``name``)."""
    return load(selection).name if _is_target(selection) else selection
