"""The conformance suite reaches the harness only through its public API (`harness.__all__`),
as any third-party plugin must: what it needs of the harness is then what the harness promises."""

from __future__ import annotations

import ast
from pathlib import Path

import harness

CONFORMANCE = Path(__file__).resolve().parents[2] / "conformance"


def harness_uses(source: str) -> set[str]:
    """Every harness name a module's source reaches: `from harness(.x) import y` gives `harness.x`
    or `y`, `import harness.x` gives `harness.x`, `harness.y` attribute reads give `y`."""
    used = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "harness":
            if node.module == "harness":
                used |= {alias.name for alias in node.names}
            else:
                used.add(node.module)
        elif isinstance(node, ast.Import):
            used |= {alias.name for alias in node.names if alias.name.startswith("harness.")}
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "harness":
            used.add(node.attr)
    return used


def test_the_checker_sees_every_way_of_reaching_an_internal() -> None:
    source = (
        "import harness.plugin\nfrom harness.config.devices import plan_devices\nfrom harness import x\nharness.y()\n"
    )
    assert harness_uses(source) == {"harness.plugin", "harness.config.devices", "x", "y"}


def test_conformance_uses_only_the_harness_public_api() -> None:
    public = set(harness.__all__)
    outside = {
        f"{path.relative_to(CONFORMANCE.parent)}: {name}"
        for path in sorted(CONFORMANCE.rglob("*.py"))
        for name in harness_uses(path.read_text(encoding="utf-8"))
        if name not in public
    }
    assert not outside, (
        "the conformance suite reaches harness internals; use (or add, documented) a name of "
        "harness.__all__ instead:\n  " + "\n  ".join(sorted(outside))
    )
