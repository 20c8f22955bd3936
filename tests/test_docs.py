"""The claims in README.md and docs/*.md that can drift from the code are checked against it.

What drifts silently: option names and their defaults, the environment variables and constants
the docs name, the repository paths they point to, and where the GPU locks live. Each is read
from the docs and compared with the code (the real `pytest --help`, the sources, the tree), so a
renamed option or a changed default fails here instead of misleading a reader.
"""

from __future__ import annotations

import contextlib
import io
import re
import tempfile
from functools import cache
from pathlib import Path

import pytest

from harness.process import gpu_locks

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*/README.md"))]
OUR_GROUPS = ("distributed test harness", "FSDP conformance suite")

# Options of other tools that the docs show in their commands (not ours to check).
OTHER_TOOLS = {
    "--lf": "pytest",
    "--no-deps": "pip",
    "--rootdir": "pytest",
    "--timeout": "pytest-timeout",
    "--dist": "pytest-xdist (refused by harness.config.preflight)",
    "--tx": "pytest-xdist (refused by harness.config.preflight)",
    "--standalone": "torchrun",
    "--nproc-per-node": "torchrun",
    "--nnodes": "torchrun",
    "--max-restarts": "torchrun",
    "--rdzv-backend": "torchrun",
    "--rdzv-endpoint": "torchrun",
    "--rdzv-id": "torchrun",
    "--index-url": "pip",
    "--nodes": "sbatch",
    "--gpus-per-node": "sbatch",
    "--ntasks-per-node": "srun",
    "--list-gpus": "nvidia-smi",
    "--check": "ruff format",
    "--epochs": "the example training script of docs/harness.md",
    "--name": "a placeholder for any option (docs/architecture.md)",
}

# Upper-case names the docs use that belong to the OS, torch, NCCL/gloo, CI systems or a shell
# example, not to this repository's code.
FOREIGN_NAMES = {
    "TMPDIR": "the OS",
    "PYTHONPATH": "Python",
    "PR_SET_PDEATHSIG": "Linux prctl",
    "GLOO_SOCKET_IFNAME": "gloo",
    "NCCL_SOCKET_IFNAME": "NCCL",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "torch",
    "GITHUB_STEP_SUMMARY": "GitHub Actions",
    "SLURM_JOB_ID": "SLURM",
    "HEAD_NODE": "a shell variable of the multi-node example",
    "JOB_ID": "a shell variable of the multi-node example",
    "DIR": "a placeholder",
}

_OPTION_LINE = re.compile(r"^  (-[^\s].*?)(?:\s{2,}(\S.*))?$")
_DOC_OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]")
_NAME = re.compile(r"`\$?\{?([A-Z][A-Z0-9_]{2,})\}?[`:]|\$\{?([A-Z][A-Z0-9_]{2,})")
_REPO_PATH = re.compile(r"`((?:harness|conformance|engine|tests|docs|scripts|bench|fixtures|\.ci)/[\w./-]*)`")
_LINK = re.compile(r"\]\(((?!https?:|#)[^)#\s]+)")


@cache
def help_options() -> dict[str, tuple[str, str]]:
    """Every option of the real `pytest --help` with the repository's plugins: name -> (its group,
    its help text). In this process: the plugins are imported already, so it costs well under a second."""
    out = io.StringIO()
    # --help configures the plugins (restoring everything at unconfigure); its reports directory
    # is a scratch one, so it never touches the reports of the session running this test.
    with tempfile.TemporaryDirectory() as scratch, contextlib.redirect_stdout(out):
        plugins = ["-p", "harness.plugin", "-p", "conformance.suite.backend_plugin", "-p", "no:cacheprovider"]
        status = pytest.main(["--help", *plugins, "--reports-dir", scratch])
    assert status == pytest.ExitCode.OK, out.getvalue()
    options: dict[str, tuple[str, str]] = {}
    group, current = "", []
    for line in out.getvalue().splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            group, current = line[:-1], []
            continue
        found = _OPTION_LINE.match(line)
        if found is not None:
            current = re.findall(r"--[a-z][a-z0-9-]*", found.group(1))
            for name in current:
                options[name] = (group, found.group(1) + "  " + (found.group(2) or ""))
        elif line.startswith(" " * 10) and current:
            for name in current:
                options[name] = (options[name][0], options[name][1] + " " + line.strip())
        else:
            current = []
    return options


@cache
def _code_text() -> str:
    """The sources the docs describe: Python packages, scripts, CI scripts, the project file, the
    self-tests' conftest (docs/ci.md names what it declares for the CI legs) and the import test
    (docs/architecture.md names its side tables)."""
    patterns = (
        "harness/**/*.py",
        "conformance/**/*.py",
        "engine/*.py",
        "fixtures/*.py",
        "bench/*.py",
        "scripts/*",
        ".ci/*",
    )
    files = [path for pattern in patterns for path in ROOT.glob(pattern) if path.is_file()] + [
        ROOT / "pyproject.toml",
        ROOT / "tests" / "conftest.py",
        ROOT / "tests" / "test_import_graph.py",
    ]
    return "\n".join(path.read_text(encoding="utf-8", errors="replace") for path in files)


def _cli_options(code: str) -> set[str]:
    """Options of the repository's own command-line tools (argparse)."""
    return set(re.findall(r"add_argument\(\s*\"(--[a-z][a-z0-9-]*)\"", code))


def _doc_lines() -> list[tuple[str, int, str]]:
    return [
        (path.relative_to(ROOT).as_posix(), number, line)
        for path in DOCS
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
    ]


def test_every_option_the_docs_name_exists() -> None:
    known = set(help_options()) | _cli_options(_code_text()) | set(OTHER_TOOLS)
    unknown = [
        f"{where}:{number}: {option}"
        for where, number, line in _doc_lines()
        for option in _DOC_OPTION.findall(line)
        if option not in known
    ]
    assert unknown == [], "options the docs name that no parser has (rename them in the docs):\n" + "\n".join(unknown)


def test_help_gives_every_default_and_unit() -> None:
    ours = {name: text for name, (group, text) in help_options().items() if group.startswith(OUR_GROUPS)}
    assert {"--backend", "--device", "--seed", "--collective-timeout", "--reports-dir"} <= set(ours), sorted(ours)
    takes_value = {name: text for name, text in ours.items() if "=" in text.split("  ")[0]}
    missing = [name for name, text in takes_value.items() if "default" not in text]
    assert missing == [], f"--help shows no default for {missing}"
    for name in ("--collective-timeout", "--test-timeout", "--straggler-grace"):
        assert re.search(r"\(default: [0-9.]+ s\)", ours[name]), ours[name]


def test_documented_defaults_are_the_parser_defaults() -> None:
    """Every options table in the docs (`| `--option ARG` | default | ...`) against --help's defaults."""
    rows = [
        (f"{where}:{number}", name, default.strip().strip("`"))
        for where, number, line in _doc_lines()
        for name, default in re.findall(r"^\| `(--[a-z-]+)[^`]*` \| ([^|]*) \|", line)
    ]
    names = {name for _, name, _ in rows}
    assert {"--collective-timeout", "--test-timeout", "--straggler-grace", "--seed", "--device"} <= names, rows
    wrong = []
    for where, name, documented in rows:
        shown = help_options()[name][1].partition("default: ")[2]
        if re.fullmatch(r"[0-9.]+", documented):
            number = re.match(r"[0-9.]+", shown)
            if number is None or float(number.group()) != float(documented):
                wrong.append(f"{where}: {name} documented {documented}, --help says {shown or 'no default'}")
        elif documented not in ("", "off") and documented not in shown:
            wrong.append(f"{where}: {name} documented {documented!r}, --help says {shown or 'no default'}")
    assert wrong == [], "\n".join(wrong)


def test_every_harness_option_is_in_the_options_table() -> None:
    table = (ROOT / "docs" / "harness.md").read_text().partition("## Options")[2].partition("\n## ")[0]
    harness = [name for name, (group, _) in help_options().items() if group.startswith(OUR_GROUPS[0])]
    assert harness and [name for name in harness if f"`{name}" not in table] == []


def test_every_upper_case_name_the_docs_use_is_in_the_code() -> None:
    code_names = set(re.findall(r"\b[A-Z][A-Z0-9_]{2,}\b", _code_text()))
    used = {
        (where, number, found.group(1) or found.group(2))
        for where, number, line in _doc_lines()
        for found in _NAME.finditer(line)
    }
    assert {"FSDP_HARNESS_LOCK_DIR", "WORLD_SIZE", "REPORTS_DIR"} <= {name for _, _, name in used}  # all were read
    missing = sorted(
        f"{where}:{number}: {name}"
        for where, number, name in used
        if name not in FOREIGN_NAMES and name not in code_names
    )
    assert missing == [], "names (environment variables, constants) the docs use but the code does not:\n" + "\n".join(
        missing
    )


def test_every_repository_path_the_docs_name_exists() -> None:
    missing, checked = [], 0
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        # An example repository's README names its own files, from its root.
        root = path.parent if path.parent.parent.name == "examples" else ROOT
        for target in _REPO_PATH.findall(text):
            checked += 1
            if not (root / target).exists():
                missing.append(f"{path.relative_to(ROOT)}: `{target}`")
        for target in _LINK.findall(text):
            checked += 1
            if not (path.parent / target).exists():
                missing.append(f"{path.name}: link {target}")
    assert checked > 20, f"only {checked} paths found in the docs: is the pattern still right?"
    assert missing == [], "paths the docs name that the tree lacks:\n" + "\n".join(missing)


def test_the_documented_gpu_lock_directory_is_the_code_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gpu_locks.LOCK_DIR_ENV, raising=False)
    default = gpu_locks.default_lock_dir()
    named = {
        (f"{where}:{number}", found)
        for where, number, line in _doc_lines()
        for found in re.findall(r"[\w$/{}-]*fsdp-harness-locks", line)
    }
    assert named, "the docs no longer say where the GPU locks live"
    wrong = sorted(f"{where}: {found}" for where, found in named if found != default)
    assert wrong == [], f"the GPU locks live in {default} ({gpu_locks.LOCK_DIR_ENV} overrides it):\n" + "\n".join(wrong)


# -- the architecture's tree table against the import test's side tables -------------------------
_TREE_ROW = re.compile(r"^\| `(?P<path>[^`]+)`(?P<top> top level)? \| (?P<side>[^|]+) \| (?P<concern>.*) \|$")
_MODULE_WORD = re.compile(r"`([a-z_][a-z0-9_]*)/?`")


def _tree_rows() -> dict[str, tuple[str, str]]:
    """docs/architecture.md's "The tree" table: module name (``harness.config``,
    ``conformance.test_*``) -> (its "runs in" cell, its concern cell)."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## The tree", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        found = _TREE_ROW.match(line.strip())
        if found is None or found["path"] == "package":
            continue
        module = found["path"].removesuffix("/").removesuffix(".py").replace("/", ".")
        rows[module] = (found["side"].strip(), found["concern"])
    return rows


def _package_sources(module: str) -> list[Path]:
    """The source files of a side table's entry: a package's tree, or the modules a pattern names."""
    if "*" in module:
        parent, _, pattern = module.rpartition(".")
        return sorted((ROOT / parent.replace(".", "/")).glob(pattern + ".py"))
    directory = ROOT / module.replace(".", "/")
    # The top level: its own modules (the sub-packages have rows of their own).
    return sorted(directory.glob("*.py")) if module in ("harness", "conformance") else sorted(directory.rglob("*.py"))


def _names_in(module: str) -> set[str]:
    """What a concern cell may name of ``module``: its modules and sub-packages, and every name its
    sources define at the start of a line (functions, classes, assignments)."""
    names = set()
    for source in _package_sources(module):
        names.add(source.stem)
        names.update(part for part in source.relative_to(ROOT).parts[:-1])
        for found in re.finditer(
            r"^\s*(?:async\s+)?(?:def|class)\s+(\w+)|^(\w+)\s*[:=]", source.read_text(encoding="utf-8"), re.M
        ):
            names.add(found.group(1) or found.group(2))
    return names


def test_the_architecture_table_says_each_packages_side_as_the_import_test_enforces_it() -> None:
    from tests.test_import_graph import CONFORMANCE_SIDES, HARNESS_SIDES, SIDE_WORDS

    rows = _tree_rows()
    tables = {**HARNESS_SIDES, **CONFORMANCE_SIDES}
    # A row per package and per pattern of modules (a top-level module is in its package's row).
    packages = [
        name
        for name in tables
        if name != "conformance" and ("*" in name or (ROOT / name.replace(".", "/")).is_dir()) and name.count(".") <= 1
    ]
    missing = [name for name in packages if name not in rows]
    assert missing == [], (
        f"docs/architecture.md's tree table lacks a row for {missing} (tests/test_import_graph.py's tables)"
    )
    wrong = []
    for name in packages:
        said, word = rows[name][0], SIDE_WORDS[tables[name]]
        if not (said == word or said.startswith((word + " (", word + ","))):
            wrong.append(f"{name}: the table says {said!r}, the import test enforces {tables[name]!r} ({word!r})")
    assert wrong == [], "docs/architecture.md's 'runs in' column disagrees with the import test:\n" + "\n".join(wrong)


def test_the_architecture_table_names_only_modules_and_names_that_exist() -> None:
    stale = []
    for module, (_side, concern) in _tree_rows().items():
        if not module.startswith(("harness", "conformance")):
            continue
        known = _names_in(module)
        stale += [f"{module}: `{word}`" for word in _MODULE_WORD.findall(concern) if word not in known]
    assert stale == [], "docs/architecture.md's tree table names what its package does not have:\n" + "\n".join(stale)
