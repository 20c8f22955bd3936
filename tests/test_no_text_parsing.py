"""No product module reads back text the project rendered: a test's outcome travels as data.

A verdict decides why a test failed once (`harness.report.results.FailureReason`), the harness
hands its result, REPRO line, trace records and divergence to the report plugins as data
(`harness.DistributedTestResult`), and every report renders from that. Parsing the rendered text
instead (the verdict's per-rank account, a trace table, a `REPRO:` line) couples each reader to
the writer's wording and breaks silently when it changes.

Two checks over every product module (engine, harness, conformance, fixtures; tests excluded),
with `ast` (nothing is imported or executed):

* every regular expression the code applies (`re.compile`, `search`, `match`, `fullmatch`,
  `findall`, `finditer`, `sub`, `subn`, `split`, however `re` was imported) is listed in
  `ALLOWED`, by file and by the name it is bound to (or the function it is in), with the one-line
  reason it reads no text of ours: third-party messages (gloo, torch, Python's tracebacks),
  user-supplied patterns and conditions, escaping, file names. Anything else fails with its
  file:line; an entry that matches nothing fails as stale;
* no string method (`startswith`, `find`, `split`, `partition`, `removeprefix`, ...) nor `in` is
  given a phrase the project writes into verdicts, trace files and reports (`RENDERED_PHRASES`):
  looking for one is reading our own text back.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("engine", "harness", "conformance", "fixtures")
REGEX_MODULES = ("re", "regex")
APPLYING = ("compile", "search", "match", "fullmatch", "findall", "finditer", "sub", "subn", "split")

# (file, the name the pattern is bound to or the function the call is in) -> why it reads no text of ours.
ALLOWED = {
    ("harness/process/gpu_locks.py", "_lock_name"): "a GPU's name made safe for a lock file's name",
    ("harness/report/junit.py", "_ILLEGAL_XML"): "XML escaping: characters XML 1.0 cannot carry",
    ("harness/report/trace_tables.py", "trace_file_name"): "a node id made safe for a file name",
    ("harness/session/verdict.py", "_BROKEN_COLLECTIVE"): (
        "a rank's exception message from gloo, NCCL or torch: did a peer's failure break its collective"
    ),
    ("harness/session/verdict.py", "_FRAME"): "Python's traceback text: the frames' files and lines",
    ("harness/trace/flight_recorder.py", "_RANK_SUFFIX"): "the rank suffix of Flight Recorder's dump file names",
    (
        "harness/session/verdict.py",
        "_WATCHDOG_TIMEOUT",
    ): "the line NCCL's watchdog writes to a rank's stderr before it aborts it",
    ("conformance/protocol/facts.py", "Refusal.__post_init__"): "an adapter-declared pattern, compiled to check it",
    ("conformance/protocol/facts.py", "Refusal.mismatch"): "an adapter-declared pattern on a backend's exception",
    ("conformance/report/matrix.py", "anchor"): "an HTML id made of a backend and scenario name",
    ("conformance/suite/expectations.py", "_CLAUSE"): "a user's torch version condition in an expectations file",
    ("conformance/test_divergence.py", "_raise_unless_order_error"): "torch FSDP's execution-order error message",
    ("conformance/test_exec_order.py", "test_later_iteration_order_change_warns_once"): (
        "torch FSDP's execution-order warning text"
    ),
}

# Words the project writes into a verdict, a trace file or a report, and would have to find again
# to read them back.
RENDERED_PHRASES = (
    "distributed test failed",
    "failed first",
    "failed after it",
    "failed on another rank",
    "ranks issued divergent collectives",
    "unfinished collectives",
    "REPRO:",
    "first divergence",
    "no divergence between",
    "NOT COMPLETED",
    "(fault:",
    "(asymmetric)",
)
STRING_READERS = (
    "startswith",
    "endswith",
    "find",
    "rfind",
    "index",
    "rindex",
    "count",
    "split",
    "rsplit",
    "partition",
    "rpartition",
    "removeprefix",
    "removesuffix",
    "replace",
)


@dataclass(frozen=True)
class Use:
    path: str
    line: int
    owner: str
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what} (in {self.owner})"


def product_files(root: Path) -> Iterator[tuple[str, ast.Module]]:
    for package in PRODUCT:
        for path in sorted((root / package).rglob("*.py")):
            if "__pycache__" not in path.parts:
                yield path.relative_to(root).as_posix(), ast.parse(path.read_text(encoding="utf-8"), str(path))


class _Scanner(ast.NodeVisitor):
    """Regular expressions applied, and rendered phrases looked for, in one module."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.scopes: list[str] = []
        self.bound_to: dict[int, str] = {}  # id(call) -> the name an assignment binds its value to
        self.regex_modules: set[str] = set()
        self.regex_functions: dict[str, str] = {}  # a name bound by `from re import x` -> x
        self.patterns: set[str] = set()  # names bound to re.compile(...)
        self.regexes: list[Use] = []
        self.phrases: list[Use] = []

    @property
    def owner(self) -> str:
        return ".".join(self.scopes) or "<module>"

    def _scoped(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scopes.append(node.name)
        self.generic_visit(node)
        self.scopes.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _scoped

    def visit_Import(self, node: ast.Import) -> None:
        self.regex_modules |= {alias.asname or alias.name for alias in node.names if alias.name in REGEX_MODULES}

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module in REGEX_MODULES:
            self.regex_functions.update({alias.asname or alias.name: alias.name for alias in node.names})

    def visit_Assign(self, node: ast.Assign | ast.AnnAssign) -> None:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = [target.id for target in targets if isinstance(target, ast.Name)]
        if isinstance(node.value, ast.Call) and names:
            self.bound_to[id(node.value)] = names[0]
        self.generic_visit(node)

    visit_AnnAssign = visit_Assign

    def visit_Call(self, node: ast.Call) -> None:
        function = node.func
        applied = None
        receiver = (
            function.value.id if isinstance(function, ast.Attribute) and isinstance(function.value, ast.Name) else ""
        )
        if receiver in (self.regex_modules | self.patterns) and function.attr in APPLYING:  # type: ignore[union-attr]
            applied = f"{receiver}.{function.attr}"  # type: ignore[union-attr]
        elif isinstance(function, ast.Name) and self.regex_functions.get(function.id) in APPLYING:
            applied = function.id
        if applied is not None:
            bound = self.bound_to.get(id(node))
            if bound is not None and applied.endswith(".compile"):
                self.patterns.add(bound)
            owner = bound if bound is not None and not self.scopes else self.owner
            if receiver in self.patterns:
                owner = receiver
            self.regexes.append(Use(self.path, node.lineno, owner, f"{applied}(...)"))
        if isinstance(function, ast.Attribute) and function.attr in STRING_READERS:
            for argument in node.args:
                self._phrase(argument, f".{function.attr}(...)")
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        if any(isinstance(op, ast.In | ast.NotIn) for op in node.ops):
            self._phrase(node.left, "`in`")
        self.generic_visit(node)

    def _phrase(self, node: ast.expr, how: str) -> None:
        texts = [node] if isinstance(node, ast.Constant) else (node.elts if isinstance(node, ast.Tuple) else [])
        for text in texts:
            if isinstance(text, ast.Constant) and isinstance(text.value, str):
                found = [phrase for phrase in RENDERED_PHRASES if phrase in text.value]
                if found:
                    self.phrases.append(Use(self.path, node.lineno, self.owner, f"{how} looks for {found[0]!r}"))


def scan(root: Path) -> tuple[list[Use], list[Use]]:
    """(every regex applied, every rendered phrase looked for) in the product modules under `root`."""
    regexes, phrases = [], []
    for path, tree in product_files(root):
        scanner = _Scanner(path)
        # Patterns first: a module may apply a pattern above the line that compiles it.
        for node in tree.body:
            if isinstance(node, ast.Assign | ast.AnnAssign):
                scanner.visit(node)
        scanner.regexes, scanner.phrases = [], []
        scanner.visit(tree)
        regexes += scanner.regexes
        phrases += scanner.phrases
    return regexes, phrases


def test_the_scanner_sees_every_way_of_applying_a_regex(tmp_path: Path) -> None:
    (tmp_path / "harness").mkdir()
    (tmp_path / "harness" / "m.py").write_text(
        "import re\nimport re as regex_alias\nfrom re import search as look\n"
        "_P = re.compile('x')\n"
        "def f(text):\n"
        "    if text.startswith('distributed test failed:') or 'REPRO:' in text:\n"
        "        return _P.findall(text), regex_alias.sub('a', 'b', text), look('y', text)\n"
        "    return text.startswith('Traceback'), re.escape(text)\n"
    )
    regexes, phrases = scan(tmp_path)
    assert [(use.line, use.owner, use.what) for use in regexes] == [
        (4, "_P", "re.compile(...)"),
        (7, "_P", "_P.findall(...)"),
        (7, "f", "regex_alias.sub(...)"),
        (7, "f", "look(...)"),
    ]
    assert [(use.line, use.what) for use in phrases] == [
        (6, ".startswith(...) looks for 'distributed test failed'"),
        (6, "`in` looks for 'REPRO:'"),
    ]


def test_no_product_module_applies_a_regex_to_our_own_text() -> None:
    regexes, _ = scan(ROOT)
    unlisted = [str(use) for use in regexes if (use.path, use.owner) not in ALLOWED]
    assert not unlisted, (
        "a regular expression applied outside the allowed uses; if it reads text the project rendered "
        "(a verdict, a trace table, a REPRO line), carry that as data instead (DistributedTestResult, "
        "FailureReason, CollectiveRecord); if it reads third-party or user text, add it to ALLOWED "
        "with its one-line reason:\n  " + "\n  ".join(unlisted)
    )
    used = {(use.path, use.owner) for use in regexes}
    stale = [f"{path}: {owner}" for path, owner in ALLOWED if (path, owner) not in used]
    assert not stale, "ALLOWED entries that match no regex any more; remove them:\n  " + "\n  ".join(stale)


def test_no_product_module_looks_for_the_phrases_it_renders() -> None:
    _, phrases = scan(ROOT)
    assert not phrases, (
        "product code looks for words the project writes into its verdicts and reports; read the "
        "data they were rendered from instead:\n  " + "\n  ".join(map(str, phrases))
    )
