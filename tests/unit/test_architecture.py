"""The architecture as tests: the import contracts (import-linter, [tool.importlinter] in
pyproject.toml), the package graph without a cycle, and the shape rules of
docs/architecture.md.

Each contract is also shown to fail: a scratch copy of the package gets one forbidden
import, and lint-imports, run against that copy, must name the broken contract.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "volutectl"
BIN = Path(sys.executable).parent


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """lint-imports with the repository's contracts, against the `volutectl` under root."""
    tool = BIN / "lint-imports"
    if not tool.exists():
        pytest.fail(f"{tool} is missing: install the test extras (pip install -e '.[test]')")
    env = dict(os.environ, PYTHONPATH=str(root))  # the copy, ahead of the installed one
    return subprocess.run(
        [str(tool), "--no-cache", "--config", str(root / "pyproject.toml")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_import_contracts_hold() -> None:
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " broken" in result.stdout and ", 0 broken" in result.stdout, result.stdout


# (module that gets the import, the import, the contract that must break)
FORBIDDEN = [
    ("wire/messages.py", "import volutectl.gate.loop", "the wire and the store never import"),
    ("store/queue.py", "import volutectl.cli.client", "the layers"),
    ("systemd/port.py", "import pystemd", "only the systemd adapter imports pystemd"),
    ("core/admission.py", "import volutectl.config.settings", "the pure cores do no I/O"),
    ("core/slotmath.py", "import sqlite3", "the pure cores do no I/O"),
    ("cli/deliver.py", "import click", "deliver's hot path stays light"),
    ("gate/status.py", "import volutectl.host.doctor", "the layers"),
    ("launcher/hands.py", "import volutectl.slots.testrun", "the layers"),
    ("errors.py", "import volutectl.wire.messages", "the layers"),
]


@pytest.fixture(scope="module")
def clean_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scratch copy of the package and its contracts, checked clean once."""
    root = tmp_path_factory.mktemp("clean")
    shutil.copytree(PACKAGE, root / "volutectl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    clean = lint_imports(root)
    assert clean.returncode == 0, clean.stdout + clean.stderr  # the copy itself is clean
    return root


@pytest.mark.parametrize(("module", "statement", "contract"), FORBIDDEN)
def test_a_forbidden_import_in_a_scratch_copy_breaks_its_contract(
    clean_copy: Path, tmp_path: Path, module: str, statement: str, contract: str
) -> None:
    shutil.copytree(clean_copy, tmp_path, dirs_exist_ok=True)
    with open(tmp_path / "volutectl" / module, "a") as file:
        file.write(f"\n{statement}  # a forbidden import, for this test\n")
    broken = lint_imports(tmp_path)
    assert broken.returncode != 0, broken.stdout
    lines = [line for line in broken.stdout.splitlines() if line.endswith(" BROKEN")]
    assert any(line.startswith(contract) for line in lines), broken.stdout


def package_of(module: str) -> str:
    """volutectl.gate.loop -> gate; volutectl.errors -> errors (a leaf module)."""
    return module.split(".")[1]


def package_imports() -> dict[str, set[str]]:
    """Which top-level package of volutectl imports which, from every import statement
    (inside functions and under TYPE_CHECKING too)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        importer = parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                if target.startswith("volutectl.") and package_of(target) != importer:
                    graph.setdefault(importer, set()).add(package_of(target))
    return graph


def test_the_packages_import_each_other_without_a_cycle() -> None:
    graph = package_imports()
    assert "gate" in graph and "store" in graph["gate"]  # the graph is read at all
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            pytest.fail("an import cycle between packages: " + " -> ".join([*path, node]))
        if node in done:
            return
        for imported in sorted(graph.get(node, ())):
            visit(imported, [*path, node])
        done.add(node)

    for package in sorted(graph):
        visit(package, [])


def test_no_package_imports_the_cli() -> None:
    importers = sorted(name for name, imported in package_imports().items() if "cli" in imported)
    assert importers == ["__main__"], importers


# -- the shape rules of docs/architecture.md -------------------------------------------------

TESTBED = REPO / "testbed" / "volute_testbed"


def test_at_most_three_fmt_skip_markers_remain_in_the_package() -> None:
    marked = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "# fmt: skip" in line
    ]
    assert len(marked) <= 3, marked


def long_functions(root: Path, limit: int = 60) -> list[tuple[str, str, int]]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append((str(path.relative_to(root)), node.name, length))
    return found


def test_no_function_is_over_60_lines() -> None:
    assert long_functions(PACKAGE) == [] and long_functions(TESTBED) == []
    assert long_functions(PACKAGE, limit=40)  # the package was scanned at all


def test_docs_architecture_lists_every_file() -> None:
    """docs/architecture.md has a row `| `pkg/file.py` | its job |` per file of the
    package, and none for a file that is gone: a new module says where it belongs."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    listed = re.findall(r"^\| `([\w/.-]+\.(?:py|sh))` \|", doc, re.M)
    files = [
        str(path.relative_to(PACKAGE)) for path in [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.sh")]
    ]
    assert len(files) > 80  # the package was read at all
    assert sorted(listed) == sorted(files)
