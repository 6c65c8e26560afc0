"""Keeps the project honest: public surface, layering, module size, lint."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import stalwart

SRC = Path(__file__).resolve().parents[2] / "src" / "stalwart"

# package -> stalwart packages it must not import (dependencies flow one way, see STYLE.md)
FORBIDDEN = {
    "tree": {"storage", "checkpoint", "cli", "diagnose", "inject", "vulnerability", "protect"},
    "errors": {"tree", "storage", "checkpoint", "cli", "diagnose"},
    "storage": {"checkpoint", "cli", "diagnose", "inject", "vulnerability", "protect"},
    "checkpoint": {"cli", "diagnose", "inject", "vulnerability", "protect"},
}


def _modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _stalwart_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("stalwart."):
            names.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            names |= {a.name.split(".")[1] for a in node.names if a.name.startswith("stalwart.")}
    return names


def test_public_surface_is_sorted_and_importable() -> None:
    assert stalwart.__all__ == sorted(stalwart.__all__)
    for name in stalwart.__all__:
        assert hasattr(stalwart, name), name


def test_dependencies_flow_one_way() -> None:
    for path in _modules():
        rel = path.relative_to(SRC)
        owner = rel.parts[0].removesuffix(".py")
        bad = _stalwart_imports(path) & FORBIDDEN.get(owner, set())
        assert not bad, f"{rel} imports {sorted(bad)}, against the layering in STYLE.md"


def test_modules_stay_small_and_documented() -> None:
    for path in _modules():
        lines = path.read_text().count("\n")
        assert lines <= 600, (
            f"{path.relative_to(SRC)} has {lines} lines; split it by responsibility"
        )
        assert ast.get_docstring(ast.parse(path.read_text())), (
            f"{path.relative_to(SRC)} needs a docstring"
        )


def test_ruff_is_clean() -> None:
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    root = SRC.parents[1]
    proc = subprocess.run(
        [ruff, "check", "src", "tests", "bench"], cwd=root, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
