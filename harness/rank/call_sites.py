"""Call sites for the collective trace: the user's source line that issued a collective (rank side).

Why: two ranks issuing the same-shaped collective from different lines (rank 0 reduces the loss
then the accuracy, rank 1 the other order) is a mispairing that op, shape and dtype cannot show.
The site is the innermost frame outside torch, the harness, the standard library and any package
registered with `skip_call_sites_in` (a backend's package: its internal lines are the same on every
rank and say nothing about which user call led there).

Cost: one walk up the Python stack per collective, with the verdict per code object cached, so
a frame costs a dict lookup (measured in bench/trace_overhead.py).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import sysconfig
import threading
from collections.abc import Callable, Iterator
from types import CodeType, FrameType

import torch

__all__ = ["asymmetric", "call_site", "in_asymmetric_region", "skip_call_sites_in"]

_skipped_dirs: list[str] = [  # directories (ending in a separator) and single files
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # the whole harness package
]
_stdlib_dir = os.path.join(sysconfig.get_paths()["stdlib"], "")
# code object -> the text of its sites' file part, or None when its frames are skipped
_code_files: dict[CodeType, str | None] = {}


class _Regions(threading.local):
    def __init__(self) -> None:
        self.depth = 0


_regions = _Regions()


@contextlib.contextmanager
def asymmetric() -> Iterator[None]:
    """Mark code where ranks issue the same collectives from different lines or on different
    tensors on purpose (rank-conditional code, e.g. `if rank == 0: ... else: ...`).

    Collectives issued inside are still compared on op, group, shapes, dtypes, labels and the
    arguments that must agree (a mismatch there breaks any backend); only their call sites and
    tensor names are not. Nestable; per thread.
    """
    _regions.depth += 1
    try:
        yield
    finally:
        _regions.depth -= 1


def in_asymmetric_region() -> bool:
    return _regions.depth > 0


def skip_call_sites_in(*packages: str) -> Callable[[], None]:
    """Leave the frames of these importable packages or modules (e.g. a backend's) out of call sites.

    The site then names the line that called into them, which differs between ranks when they
    issued a collective from different places in their own code. A package skips its whole
    directory, a module only its own file. Returns a function that takes back what this call
    added (not what was skipped before it), for a skip that lasts one test: a rank runs many
    tests, and one backend's packages must not hide another test's lines.
    """
    added: list[str] = []
    for package in packages:
        spec = importlib.util.find_spec(package)
        if spec is None or not (spec.origin or spec.submodule_search_locations):
            raise ValueError(f"skip_call_sites_in({package!r}): nothing importable by that name; pass an import name")
        if spec.submodule_search_locations:
            prefixes = [os.path.join(os.path.abspath(location), "") for location in spec.submodule_search_locations]
        else:
            prefixes = [os.path.abspath(spec.origin or "")]
        for prefix in prefixes:
            if prefix not in _skipped_dirs:
                _skipped_dirs.append(prefix)
                added.append(prefix)
                _code_files.clear()  # verdicts cached before may have changed

    def take_back() -> None:
        for prefix in added:
            if prefix in _skipped_dirs:
                _skipped_dirs.remove(prefix)
                _code_files.clear()
        added.clear()

    return take_back


def call_site(depth: int = 2) -> str:
    """`file:line` of the innermost frame above `depth` that is not skipped; "" if every one is."""
    try:
        frame: FrameType | None = sys._getframe(depth)
    except ValueError:  # fewer frames than that: called from the top level
        return ""
    while frame is not None:
        code = frame.f_code
        try:
            shown = _code_files[code]
        except KeyError:
            shown = _code_files[code] = _shown_file(code.co_filename)
        if shown is not None:
            return f"{shown}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


def _shown_file(filename: str) -> str | None:
    """The file as shown in a site (relative to the working directory when inside it), or None."""
    if filename.startswith("<"):  # <frozen runpy>, <string>: not the user's source
        return None
    path = os.path.abspath(filename)
    if any(path.startswith(directory) for directory in _skipped_dirs):
        return None
    in_packages = f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path
    if path.startswith(_stdlib_dir) and not in_packages:  # some distributions keep packages there
        return None
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative
