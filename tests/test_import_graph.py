"""The import graph keeps its shape: no circle between modules, no upward import between packages.

Every Python file of the repository is parsed with `ast`; nothing is imported or executed, so the
whole check takes about a second.  Every import statement counts, wherever it is: at module
level, inside a function (a late import is still a dependency) and under `TYPE_CHECKING` (a type
is a dependency too; the engine's unit <-> state circle was one).  Imports by name in strings
(`importlib.import_module`, entry points, ini options such as `collective_label_providers`) are
the designed late binding and are not edges.  Relative imports are refused by ruff
(`tests/test_lint.py`, flake8-tidy-imports), so every edge here is an absolute name.

The rules (`LAYER_RULES`; `PACKAGE_RULES` over `HARNESS_SIDES` and `CONFORMANCE_SIDES`; private
names) are documented in docs/architecture.md, "Import rules".
"""

from __future__ import annotations

import ast
import fnmatch
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Top-level first-party packages and directories that are not part of the installed product.
PRODUCT = ("engine", "harness", "conformance", "fixtures")
REPO_ONLY = ("tests", "bench", "scripts")
# Third-party libraries that are backends under test (a scenario reaches them only through an
# adapter).  `torch.distributed._composable.fsdp` is FSDP2's home before torch 2.6 moved it.
BACKEND_LIBRARIES = ("deepspeed", "torch.distributed.fsdp", "torch.distributed._composable.fsdp")


@dataclass(frozen=True)
class Edge:
    """One import statement's dependency of `importer` on `target` (a module name)."""

    importer: str
    target: str  # a first-party module, or the full dotted name imported from a third party
    first_party: bool
    name: str  # what `from target import name` binds ("" for `import target`)
    path: Path
    line: int
    statement: str
    where: str  # "", "inside a function" or "under TYPE_CHECKING"

    def describe(self, root: Path) -> str:
        where = f" ({self.where})" if self.where else ""
        return f"{self.path.relative_to(root)}:{self.line}: {self.statement}{where}"


@dataclass(frozen=True)
class LayerRule:
    """Modules matching `importers` (and none of `exempt`) never import one matching `forbidden`.

    A pattern is a module name, covering that module and everything under it, or an fnmatch
    pattern (`conformance.test_*`)."""

    name: str
    importers: tuple[str, ...]
    forbidden: tuple[str, ...]
    why: str
    exempt: tuple[str, ...] = ()  # importers the rule does not apply to (each with its reason)
    allowed: tuple[str, ...] = ()  # targets that are not forbidden after all (each with its reason)

    def broken_by(self, edge: Edge) -> bool:
        return (
            _matches(edge.importer, self.importers)
            and not _matches(edge.importer, self.exempt)
            and _matches(edge.target, self.forbidden)
            and not _matches(edge.target, self.allowed)
        )


LAYER_RULES = (
    LayerRule(
        "engine-stands-alone",
        importers=("engine",),
        forbidden=("harness", "conformance", "fixtures", *REPO_ONLY),
        why="the engine is a library of its own, one backend among others; its collective labels "
        "reach the harness through the collective_label_providers ini option",
    ),
    LayerRule(
        "harness-knows-no-suite",
        importers=("harness",),
        forbidden=("engine", "conformance", "fixtures", *REPO_ONLY),
        why="the harness runs any distributed pytest test; the conformance suite is a plugin on "
        "its hooks and public API, never the other way round",
    ),
    LayerRule(
        "fixtures-are-neutral",
        importers=("fixtures",),
        forbidden=("engine", "harness", "conformance", *REPO_ONLY),
        why="models, data and the single-process oracle are shared by the scenarios and the "
        "engine's own tests; a backend reaches them as an argument (train_sharded(backend=...))",
    ),
    LayerRule(
        "adapters-never-import-the-harness",
        importers=("conformance.adapters",),
        forbidden=("harness", "conformance.test_*", *REPO_ONLY),
        why="labels reach the harness through the rank fixture only (no import-time "
        "registration), so an adapter runs wherever its backend does",
    ),
    LayerRule(
        "scenarios-use-only-the-protocol",
        importers=("conformance",),
        exempt=("conformance.adapters",),
        forbidden=("engine", "conformance.adapters", *BACKEND_LIBRARIES, *REPO_ONLY),
        why="scenarios (conformance/test_*.py) and the suite's plugin talk to a backend only "
        "through the adapter protocol (conformance.protocol); the registry loads adapters by name",
    ),
)

# The harness's sub-packages, by the process their code runs in (docs/architecture.md, "The tree").
# Every module of the harness belongs to exactly one entry (`test_every_module_has_a_side`): a new
# module lands in a package whose side is known, or the test names it.
PARENT, RANK, SHARED, TOOL, API = "parent", "rank", "shared", "tool", "api"
HARNESS_SIDES = {
    "harness": API,  # the package's __init__: public names, imported lazily from either side
    "harness.plugin": PARENT,  # the pytest entry point
    "harness.hookspecs": PARENT,
    "harness.config": PARENT,
    "harness.session": PARENT,
    "harness.session.spmd": PARENT,  # parent-side SPMD calls: the pool, as a session's tests use it
    "harness.report": PARENT,
    "harness.process": PARENT,
    "harness.rank": RANK,
    "harness.rank.call_runner": RANK,  # runs an SpmdCall in a rank, beside the test runner
    "harness.trace": SHARED,
    "harness.messages": SHARED,
    "harness.message_text": SHARED,
    "harness.tools": TOOL,
}
# The conformance suite's packages and layers, each with the process its code runs in. "both":
# imported in pytest and in the ranks (the gate builds every adapter in pytest to read its
# declarations; the plugin and the generated programs' draw use the protocol there).
CONFORMANCE_SIDES = {
    "conformance": API,  # its __init__
    "conformance.protocol": SHARED,
    "conformance.suite": SHARED,  # the pytest plugin, and the rank-side backend fixture
    "conformance.report": PARENT,
    "conformance.adapters": SHARED,
    "conformance.__main__": TOOL,
    "conformance.programs": SHARED,  # generated programs: drawn in the parent, run in the ranks
    "conformance.test_*": RANK,  # the scenarios (expectation ids embed their paths: they stay at the top)
    "conformance.scenario_*": RANK,  # what several scenario modules share (specs, the unshard models and helpers)
}
CONFORMANCE_PACKAGES = tuple(CONFORMANCE_SIDES)
SIDE_WORDS = {PARENT: "parent", RANK: "rank", SHARED: "both", TOOL: "a plain script", API: "-"}
"""How docs/architecture.md's "runs in" column says each side (tests/test_docs.py holds it to these tables)."""


def _side_packages(side: str, table: dict[str, str] = HARNESS_SIDES) -> tuple[str, ...]:
    return tuple(
        package for package, its_side in table.items() if its_side == side and package not in ("harness", "conformance")
    )


PACKAGE_RULES = (
    LayerRule(
        "parent-side-never-imports-the-rank-side",
        importers=_side_packages(PARENT),
        # A torchrun process is itself a rank (torchrun mode runs the rank's runner in pytest).
        exempt=("harness.session.torchrun_session",),
        forbidden=("harness.rank",),
        # The rank-fixture registry: the parent registers placeholders by name; it patches nothing.
        allowed=("harness.rank.rank_fixtures",),
        why="harness.rank runs in rank processes (harness.rank.tracing patches torch.distributed when "
        "imported); the parent reads what ranks did through harness.messages and harness.trace.records",
    ),
    LayerRule(
        "rank-side-never-imports-the-parent-side",
        importers=_side_packages(RANK),
        forbidden=(
            "harness.plugin",
            "harness.hookspecs",
            "harness.config",
            "harness.session",
            "harness.report",
            "harness.process",
        ),
        # What both sides of a rank's process boundary agree on: /proc helpers, a rank's side files.
        allowed=("harness.process.procfs", "harness.process.rank_files", "harness.process.fork_probe"),
        why="a rank gets its configuration in harness.messages.WorkerConfig / TestTask and answers with "
        "RankOutcome; parent-side modules carry pytest state a rank does not have",
    ),
    LayerRule(
        "shared-modules-import-no-side",
        importers=_side_packages(SHARED),
        forbidden=tuple(p for p in HARNESS_SIDES if HARNESS_SIDES[p] in (PARENT, RANK, TOOL)),
        why="trace records, the trace diff, messages and text helpers are read on both sides and by "
        "the tools; a side's import would drag pytest state into a rank or the tracer into the parent",
    ),
    LayerRule(
        "config-is-decided-before-anything-runs",
        importers=("harness.config",),
        forbidden=("harness.plugin", "harness.session", "harness.report", "harness.process", "harness.tools"),
        why="options and decisions (devices, world sizes, repro) are made before a session runs; "
        "sessions, processes and reports read them, never the other way round",
    ),
    LayerRule(
        "reports-only-serialize",
        importers=("harness.report",),
        forbidden=("harness.plugin", "harness.session", "harness.process", "harness.tools"),
        why="report plugins receive a finished DistributedTestResult; they never drive a session",
    ),
    LayerRule(
        "processes-know-no-session",
        importers=("harness.process",),
        forbidden=("harness.plugin", "harness.session", "harness.report", "harness.tools"),
        why="the pool, launcher and reaper manage processes for whichever session owns them",
    ),
    LayerRule(
        "verdict-and-torchrun-session-never-import-the-pool",
        importers=("harness.session.verdict", "harness.session.torchrun_session"),
        forbidden=("harness.process.pool",),
        why="a verdict is pure (it judges outcomes however they were run), and torchrun mode has no pool",
    ),
    LayerRule(
        "tools-stand-alone",
        importers=("harness.tools",),
        forbidden=("harness.plugin", "harness.session", "harness.report", "harness.process", "harness.config"),
        why="the command-line tools run without pytest (a plain torchrun script, Flight Recorder dumps)",
    ),
    LayerRule(
        "conformance-parent-side-never-imports-the-rank-side",
        importers=_side_packages(PARENT, CONFORMANCE_SIDES),
        forbidden=_side_packages(RANK, CONFORMANCE_SIDES),
        why="the reports render in pytest what the ranks' scenarios did; a scenario module imported "
        "there would run its module-level code in the wrong process",
    ),
    LayerRule(
        "conformance-rank-side-never-imports-the-parent-side",
        importers=_side_packages(RANK, CONFORMANCE_SIDES),
        forbidden=_side_packages(PARENT, CONFORMANCE_SIDES),
        why="a scenario runs in a rank, where the session's reports do not exist",
    ),
    LayerRule(
        "the-protocol-is-the-bottom-of-the-suite",
        importers=("conformance.protocol",),
        forbidden=(
            "conformance.suite",
            "conformance.report",
            "conformance.adapters",
            "conformance.programs",
            "conformance.test_*",
            "conformance.scenario_*",
        ),
        why="adapters written out of tree import only the protocol; it must not drag in the suite's machinery",
    ),
    LayerRule(
        "programs-open-a-backend-as-the-fixture-does",
        importers=("conformance.programs",),
        forbidden=("conformance.report", "conformance.test_*", "conformance.scenario_*"),
        why="a generated program runs a backend exactly as a scenario's backend fixture opens it "
        "(conformance.suite.backend_fixture) and judges through the protocol; it renders nothing and "
        "borrows no scenario's code",
    ),
    LayerRule(
        "conformance-reports-only-render",
        importers=("conformance.report",),
        forbidden=("conformance.suite", "conformance.protocol", "conformance.adapters", "conformance.test_*"),
        why="the matrix and the HTML page render results the suite hands them; they judge nothing again",
    ),
    LayerRule(
        "scenarios-never-reach-the-suite-machinery",
        importers=("conformance.test_*", "conformance.scenario_*"),
        forbidden=("conformance.suite", "conformance.report"),
        why="a scenario is backend-neutral test code: it receives its adapter from the backend fixture",
    ),
)


def _matches(module: str, patterns: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") or fnmatch.fnmatchcase(module, p) for p in patterns)


# ------------------------------------------------------------------ building the graph
def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _python_files(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*.py")):
        if not any(part.startswith(".") or part == "__pycache__" for part in path.relative_to(root).parts):
            yield path


def _imports(body: list[ast.stmt], where: str = "") -> Iterator[tuple[list[tuple[str, str]], ast.stmt, str]]:
    """([(dotted name it may import, the name it binds)], the statement, where it sits) in `body`, nested
    statements included.  Only statement lists are walked (imports are statements), which keeps
    the whole tree's scan fast."""
    for node in body:
        if isinstance(node, ast.Import):
            yield [(alias.name, "") for alias in node.names], node, where
        elif isinstance(node, ast.ImportFrom):
            # `from pkg import name`: `pkg.name` when that is a submodule, else `pkg` (`_resolve`).
            yield [(f"{node.module or ''}.{alias.name}", alias.name) for alias in node.names], node, where
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _imports(node.body, where or "under TYPE_CHECKING")
            yield from _imports(node.orelse, where)
        else:
            inner = "inside a function" if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else where
            for field in ("body", "orelse", "finalbody"):
                yield from _imports(getattr(node, field, []), inner or where)
            for part in (*getattr(node, "handlers", ()), *getattr(node, "cases", ())):
                yield from _imports(part.body, inner or where)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(name: str, path: Path, root: Path, modules: dict[str, Path]) -> str | None:
    """The first-party module `name` denotes for the file at `path`, or None for third party.

    pytest puts a test file's directory on sys.path when it is not a package, so tests import
    their neighbours by bare name (`from adapter_testing import ...`): such a directory is
    searched first, then the repository root."""
    directory = path.parent
    prefixes = [] if (directory / "__init__.py").exists() else [".".join(directory.relative_to(root).parts)]
    for prefix in [*prefixes, ""]:
        candidate = f"{prefix}.{name}" if prefix else name
        # `from pkg import name` where name is no module: the package itself (its __init__).
        while candidate and candidate != prefix:
            if candidate in modules:
                return candidate
            candidate = candidate.rpartition(".")[0]
    return None


@functools.cache
def import_graph(root: Path) -> tuple[Edge, ...]:
    """Every import edge of the tree at `root`; third-party targets keep their dotted name."""
    files = list(_python_files(root))
    modules = {_module_name(path, root): path for path in files}
    edges: list[Edge] = []
    for path in files:
        importer = _module_name(path, root)
        source = path.read_text()
        lines = source.splitlines()
        for names, node, where in _imports(ast.parse(source, filename=str(path)).body):
            statement = " ".join(" ".join(lines[node.lineno - 1 : node.end_lineno]).split())
            statement = statement.replace("( ", "(").replace(", )", ")")  # a parenthesised list, on one line
            for dotted, bound in names:
                target = _resolve(dotted, path, root, modules)
                first_party = target is not None
                target = target or dotted.removesuffix(".*")
                if target != importer:
                    edges.append(Edge(importer, target, first_party, bound, path, node.lineno, statement, where))
    return tuple(edges)


# ------------------------------------------------------------------ the checks
def import_circles(root: Path) -> list[list[Edge]]:
    """Circles of first-party modules: the shortest through each module that is on one, except
    modules a circle already reported passes through (fixing one shows the next)."""
    edges = [edge for edge in import_graph(root) if edge.first_party]
    outgoing: dict[str, dict[str, Edge]] = {}
    for edge in edges:
        outgoing.setdefault(edge.importer, {}).setdefault(edge.target, edge)
    circles: list[list[Edge]] = []
    seen: set[str] = set()
    for start in sorted(outgoing):
        if start in seen:
            continue
        circle = _shortest_circle(start, outgoing)
        if circle:
            circles.append(circle)
            seen.update(edge.importer for edge in circle)
    return circles


def _shortest_circle(start: str, outgoing: dict[str, dict[str, Edge]]) -> list[Edge]:
    """Breadth-first from `start` back to itself: the edges of the shortest circle, or []."""
    parents: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target, edge in sorted(outgoing.get(module, {}).items()):
                if target == start:
                    path = [edge]
                    while path[0].importer != start:
                        path.insert(0, parents[path[0].importer])
                    return path
                if target not in parents:
                    parents[target] = edge
                    following.append(target)
        frontier = following
    return []


def rule_violations(root: Path, rule: LayerRule) -> list[Edge]:
    return [edge for edge in import_graph(root) if rule.broken_by(edge)]


def circle_message(circle: list[Edge], root: Path) -> str:
    names = " -> ".join([circle[0].importer, *(edge.target for edge in circle)])
    lines = "\n".join(f"  {edge.describe(root)}" for edge in circle)
    return (
        f"import circle {names}:\n{lines}\n"
        "rule: no circle between modules (a circle makes import order matter and ties the lower "
        "module to the one above it). Pass what the lower module needs down to it instead (as "
        "engine/unit.py's UnitContext does), or move the shared piece into a module both import."
    )


def violation_message(rule: LayerRule, edges: list[Edge], root: Path) -> str:
    shown = dict.fromkeys(f"  {edge.importer} imports {edge.target}: {edge.describe(root)}" for edge in edges)
    lines = "\n".join(shown)  # one line per statement and target, however many names it binds
    return (
        f"upward import(s) breaking the rule {rule.name!r}:\n{lines}\n"
        f"why: {rule.why}. See docs/architecture.md, 'Import rules'."
    )


# ------------------------------------------------------------------ tests
def test_no_import_circle_between_modules() -> None:
    circles = import_circles(ROOT)
    if circles:
        pytest.fail("\n\n".join(circle_message(circle, ROOT) for circle in circles), pytrace=False)


@pytest.mark.parametrize("rule", LAYER_RULES + PACKAGE_RULES, ids=[rule.name for rule in LAYER_RULES + PACKAGE_RULES])
def test_no_upward_import(rule: LayerRule) -> None:
    violations = rule_violations(ROOT, rule)
    if violations:
        pytest.fail(violation_message(rule, violations, ROOT), pytrace=False)
    assert any(_matches(edge.importer, rule.importers) for edge in import_graph(ROOT)), (
        f"rule {rule.name!r} matched no importing module: its package was renamed or moved; update LAYER_RULES"
    )


def modules_without_a_package(root: Path) -> list[str]:
    """Modules of the harness and the conformance suite that no entry of the side tables covers."""
    modules = {edge.importer for edge in import_graph(root)} | {
        _module_name(path, root) for path in _python_files(root)
    }
    return sorted(
        module
        for module in modules
        if ((module == "harness" or module.startswith("harness.")) and not _in_table(module, HARNESS_SIDES))
        or (
            (module == "conformance" or module.startswith("conformance."))
            and not _in_table(module, CONFORMANCE_PACKAGES)
        )
    )


def _in_table(module: str, packages: Iterable[str]) -> bool:
    # "harness" covers only the package's __init__; every other entry covers its sub-tree.
    return any(
        module == package or (package not in ("harness", "conformance") and _matches(module, [package]))
        for package in packages
    )


def test_every_module_has_a_side() -> None:
    unplaced = modules_without_a_package(ROOT)
    if unplaced:
        pytest.fail(
            "modules outside every package of the layer tables:\n  "
            + "\n  ".join(unplaced)
            + "\nwhy: the sub-package says which process a module runs in (harness: HARNESS_SIDES) or which "
            "side and layer of the suite it is (conformance: CONFORMANCE_SIDES), and the package rules check its "
            "imports. Move the module into the package of its concern (docs/architecture.md, 'The tree').",
            pytrace=False,
        )


def private_name_imports(root: Path) -> list[Edge]:
    """Product modules binding another module's private (`_name`, not a submodule) name."""
    return [
        edge
        for edge in import_graph(root)
        if edge.first_party
        and _matches(edge.importer, PRODUCT)
        and edge.name.startswith("_")
        and not edge.name.startswith("__")
        and not edge.target.endswith("." + edge.name)  # a package's private submodule: its own
    ]


def test_no_product_module_imports_another_modules_private_name() -> None:
    edges = private_name_imports(ROOT)
    if edges:
        listed = "\n".join(
            f"  {edge.importer} imports {edge.target}.{edge.name}: {edge.describe(ROOT)}" for edge in edges
        )
        pytest.fail(
            f"private names imported from another module:\n{listed}\nwhy: a leading underscore says the name "
            "may change without notice; make it public (and document it) or keep the code that needs it in its "
            "module. See docs/architecture.md, 'Import rules'.",
            pytrace=False,
        )


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_checker_sees_a_circle_closed_under_type_checking_but_not_one_through_a_package(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            # engine/__init__ imports api, api imports a submodule through the package: no circle.
            "engine/__init__.py": "from engine.api import shard\n",
            "engine/api.py": "from engine import unit\ndef shard(): ...\n",
            # unit <-> state closed by a typing-only import: a circle.
            "engine/unit.py": "import typing\nif typing.TYPE_CHECKING:\n    from engine.state import Root\n",
            "engine/state.py": "def make():\n    from engine.unit import Unit\n",
        },
    )
    circles = import_circles(root)
    assert [[edge.importer for edge in circle] for circle in circles] == [["engine.state", "engine.unit"]]
    message = circle_message(circles[0], root)
    assert "engine.state -> engine.unit -> engine.state" in message
    assert "engine/unit.py:3: from engine.state import Root (under TYPE_CHECKING)" in message
    assert "engine/state.py:2: from engine.unit import Unit (inside a function)" in message


def test_checker_names_upward_and_private_imports(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "conformance/__init__.py": "",
            "conformance/protocol.py": "_SECRET = 1\n",
            "conformance/test_training.py": "from conformance import protocol\nimport engine.api\n",
            # A private name of another module is refused, a package's private submodule is not.
            "conformance/suite/backend_plugin.py": "from conformance.protocol import (\n    PUBLIC,\n    _SECRET,\n)\n",
            "conformance/adapters/__init__.py": "",
            "conformance/adapters/_common.py": "",
            "conformance/adapters/ref.py": "from conformance.adapters import _common\n",
            "tests/conformance_tests/helper.py": "",
            "tests/conformance_tests/test_x.py": "from helper import x\n",  # a neighbour by bare name
            "engine/__init__.py": "",
            "engine/api.py": "",
        },
    )
    rule = next(rule for rule in LAYER_RULES if rule.name == "scenarios-use-only-the-protocol")
    violations = rule_violations(root, rule)
    assert [(edge.importer, edge.target) for edge in violations] == [("conformance.test_training", "engine.api")]
    assert "conformance.test_training imports engine.api: conformance/test_training.py:2: import engine.api" in (
        violation_message(rule, violations, root)
    )
    assert ("tests.conformance_tests.test_x", "tests.conformance_tests.helper") in {
        (edge.importer, edge.target) for edge in import_graph(root)
    }
    private = private_name_imports(root)
    assert [(edge.importer, edge.name, edge.describe(root)) for edge in private] == [
        (
            "conformance.suite.backend_plugin",
            "_SECRET",
            "conformance/suite/backend_plugin.py:1: from conformance.protocol import (PUBLIC, _SECRET)",
        )
    ]


def test_checker_refuses_a_parent_module_that_imports_the_tracer_and_a_module_with_no_side(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "harness/__init__.py": "",
            "harness/rank/__init__.py": "",
            "harness/rank/tracing.py": "",
            "harness/rank/rank_fixtures.py": "",
            "harness/session/__init__.py": "",
            "harness/session/flow.py": "from harness.rank import rank_fixtures\n",  # allowed: the names registry
            "harness/session/torchrun_session.py": "from harness.rank import tracing\n",  # exempt: a torchrun rank
            "harness/report/__init__.py": "",
            "harness/report/junit.py": "def write():\n    from harness.rank.tracing import record\n",
            "harness/stray.py": "",  # a top-level module no side table names
        },
    )
    rule = next(rule for rule in PACKAGE_RULES if rule.name == "parent-side-never-imports-the-rank-side")
    violations = rule_violations(root, rule)
    assert [(edge.importer, edge.target, edge.where) for edge in violations] == [
        ("harness.report.junit", "harness.rank.tracing", "inside a function")
    ]
    assert "harness.report.junit imports harness.rank.tracing" in violation_message(rule, violations, root)
    assert modules_without_a_package(root) == ["harness.stray"]
