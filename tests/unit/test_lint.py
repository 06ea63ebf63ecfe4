"""Linters as tests: ruff (check and format) and mypy --strict, configured by pyproject.toml.

The tools come from this interpreter's virtualenv, the one that runs the tests. A
missing tool fails: a lint step that silently skips is a lint step that never runs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RUFF_PATHS = [
    path for path in ("volutectl", "tests", "testbed", "bench", "demo") if (REPO / path).is_dir()
]


def tool(name: str) -> Path:
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{path} is missing: install the test extras (pip install -e '.[test]')")
    return path


def run(argv: list[str | Path]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(arg) for arg in argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_ruff_check() -> None:
    result = run([tool("ruff"), "check", "--no-cache", *RUFF_PATHS])
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format() -> None:
    result = run([tool("ruff"), "format", "--check", "--no-cache", *RUFF_PATHS])
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict() -> None:
    # The packages to check and the strictness come from [tool.mypy] in pyproject.toml;
    # --strict is repeated so that nobody can loosen it there without this test noticing.
    result = run([tool("mypy"), "--strict", "--config-file", REPO / "pyproject.toml"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout
