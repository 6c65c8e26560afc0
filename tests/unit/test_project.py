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

_CORE = {
    "errors",
    "tree",
    "storage",
    "checkpoint",
    "elastic",
    "models",
    "inject",
    "vulnerability",
    "protect",
    "diagnose",
}

# package -> the stalwart packages it may import (dependencies flow one way, see STYLE.md).
# Every package must be listed: a new room states its place in the house when it is made.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "tree": {"errors"},
    "storage": {"errors", "tree"},
    "checkpoint": {"errors", "tree", "storage"},
    "elastic": {"errors", "tree", "storage", "checkpoint"},
    "models": {"errors"},
    "inject": {"errors", "tree"},
    "vulnerability": {"errors", "tree", "inject", "models"},
    "protect": {"errors", "tree", "storage", "checkpoint", "inject", "vulnerability", "models"},
    "diagnose": {"errors"},
    "testing": {"errors", "tree", "storage", "checkpoint"},
    "integrations": _CORE,
    "demos": _CORE | {"testing", "__init__"},
    "cli": _CORE | {"demos", "integrations", "__init__"},
    "__init__": _CORE,
    "__main__": {"cli"},
}


def _modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _stalwart_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("stalwart."):
            names.add(node.module.split(".")[1])
        elif isinstance(node, ast.ImportFrom) and node.module == "stalwart":
            names.add("__init__")  # the public surface: only what sits above it may use it
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
        assert owner in ALLOWED, f"{rel}: package {owner!r} has no place in ALLOWED; add it"
        bad = _stalwart_imports(path) - ALLOWED[owner] - {owner}
        assert not bad, f"{rel} imports {sorted(bad)}, against the layering in STYLE.md"


def test_import_stalwart_loads_no_tools_demos_or_heavy_engines() -> None:
    code = (
        "import sys, stalwart; "
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'duckdb', 'matplotlib', 'sklearn', 'pyspark', 'polars', 'pandas'} "
        "or m.startswith(('stalwart.testing', 'stalwart.demos', 'stalwart.cli')))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import stalwart pulled in: {out.stdout.strip()}"


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
