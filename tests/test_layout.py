"""The tree stays a product, not a notebook: a user's README, the latest results only, small modules
and functions in the packages, and no package that reaches into tools/ or tests/."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = [ROOT / "lightspec_core", ROOT / "backend"]


def package_sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in pkg.rglob("*.py"))


def test_readme_is_a_guide_of_at_most_12000_characters():
    assert len((ROOT / "README.md").read_text()) <= 12_000


def test_docs_results_keep_only_the_latest_runs():
    assert len(list((ROOT / "docs" / "results").iterdir())) <= 8


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_the_tree_is_ruff_clean_and_formatted(command):
    """ruff at the version the test extra pins (another version formats differently), with the
    settings of pyproject.toml, over every Python file and README's and docs' Python blocks."""
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "."], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_package_modules_stay_under_400_lines_and_functions_under_60():
    long_functions = []
    for path in package_sources():
        text = path.read_text()
        assert text.count("\n") <= 400, path
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert long_functions == []


def test_packages_import_neither_tools_nor_tests_and_only_backend_names_pb_utils():
    for path in package_sources():
        text = path.read_text()
        assert not re.search(r"^\s*(from|import) (tools|tests)\b", text, re.MULTILINE), path
        if ROOT / "lightspec_core" in path.parents:
            assert "pb_utils" not in text and "triton_python_backend_utils" not in text, path


def test_no_file_outside_tests_narrates_the_projects_history():
    words = re.compile(
        r"\bsession\b|\b(fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth) round\b"
        r"|bench_history",
        re.IGNORECASE,
    )
    for path in [
        *package_sources(),
        *(ROOT / "tools").rglob("*.py"),
        *(ROOT / "docs").rglob("*.md"),
        ROOT / "README.md",
        ROOT / "CHANGELOG.md",
        *(ROOT / "model_repository").rglob("*.pbtxt"),
    ]:
        assert not words.search(path.read_text()), path
