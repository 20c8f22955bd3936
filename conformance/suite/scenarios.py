"""Every conformance scenario, for a backend repository's own test file.

A backend team runs the suite from its repository in one line, as SQLAlchemy's third-party
dialects run its compliance suite::

    # tests/test_conformance.py
    from conformance.suite.scenarios import *  # noqa: F403 - every scenario, against --backend

with ``--backend mypkg.adapter:MyAdapter`` on the command line or in the ini file's ``addopts``.
``python -m pytest --pyargs conformance --backend ...`` runs the same scenarios from the installed
package instead; either way a scenario keeps its identity (``conformance/test_<x>.py::<test>``: its
expectations entries, its matrix row, its generated-program seeds), wherever it was collected from
(``conformance.suite.backend_plugin`` names a test by where its function is defined).

Each scenario module's test functions are re-exported as copies carrying the module's own marks
(``pytestmark``, e.g. the smoke tests' ``smoke`` and ``world_size(2)``), which a star import would
otherwise drop or, with several modules, overwrite; the originals are left untouched, so a session
that also collects the scenario modules themselves sees them unchanged. Two modules defining one
test name is an error here, not a silent shadowing.
"""

from __future__ import annotations

import importlib
import pkgutil
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import conformance

SCENARIO_MODULE_PREFIX = "test_"


def scenario_modules() -> list[str]:
    """The scenario modules of the installed package (``conformance/test_*.py``), by name."""
    package_dir = Path(conformance.__file__).parent
    return sorted(
        f"conformance.{info.name}"
        for info in pkgutil.iter_modules([str(package_dir)])
        if info.name.startswith(SCENARIO_MODULE_PREFIX) and not info.ispkg
    )


def _with_module_marks(function: Callable[..., Any], module_marks: list[Any]) -> Callable[..., Any]:
    """A copy of ``function`` whose marks are its own, then its module's (closest first, as pytest
    reads a module's marks after the function's)."""
    copy = types.FunctionType(
        function.__code__, function.__globals__, function.__name__, function.__defaults__, function.__closure__
    )
    copy.__dict__.update(function.__dict__)  # parametrize and other marks, hypothesis's attributes
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__ = function.__qualname__
    copy.__module__ = function.__module__
    copy.__doc__ = function.__doc__
    copy.__annotations__ = function.__annotations__
    copy.pytestmark = [*getattr(function, "pytestmark", []), *module_marks]  # type: ignore[attr-defined]
    return copy


def _exported() -> dict[str, Callable[..., Any]]:
    exported: dict[str, Callable[..., Any]] = {}
    defined_in: dict[str, str] = {}
    for module_name in scenario_modules():
        module = importlib.import_module(module_name)
        marks = getattr(module, "pytestmark", [])
        module_marks = list(marks) if isinstance(marks, list | tuple) else [marks]
        for name, value in vars(module).items():
            if not name.startswith("test_") or not callable(value) or getattr(value, "__module__", None) != module_name:
                continue
            if name in exported:
                raise ImportError(
                    f"conformance.suite.scenarios: {module_name} and {defined_in[name]} both define {name}; "
                    "rename one (a star import would collect only one of them)"
                )
            exported[name] = _with_module_marks(value, module_marks)
            defined_in[name] = module_name
    return exported


globals().update(_exported())
__all__ = sorted(name for name in globals() if name.startswith("test_"))
