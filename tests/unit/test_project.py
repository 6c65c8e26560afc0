"""Keeps the project honest: public surface, layering, module size, lint."""

from __future__ import annotations

import ast
import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import stalwart

SRC = Path(__file__).resolve().parents[2] / "src" / "stalwart"

_CORE = {
    "errors",
    "notebook",
    "moved",
    "environment",
    "frames",
    "tree",
    "values",
    "storage",
    "checkpoint",
    "elastic",
    "models",
    "inject",
    "vulnerability",
    "protect",
    "diagnose",
    "plan",
}

# package -> the stalwart packages it may import (dependencies flow one way, see STYLE.md).
# Every package must be listed: a new room states its place in the house when it is made.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "notebook": set(),
    "moved": set(),
    "processes": set(),
    "frames": {"errors"},
    "environment": {"errors"},
    "values": {"errors"},
    "tree": {"errors", "values"},
    "storage": {"errors", "tree"},
    "checkpoint": {"errors", "environment", "frames", "moved", "notebook", "tree", "storage"},
    "elastic": {"errors", "environment", "frames", "moved", "tree", "storage", "checkpoint"},
    "fingerprint": set(),
    "models": {"errors", "fingerprint"},
    "inject": {"errors", "moved", "tree"},
    "vulnerability": {
        "errors",
        "environment",
        "processes",
        "frames",
        "moved",
        "notebook",
        "tree",
        "inject",
        "fingerprint",
    },
    "protect": {
        "errors",
        "frames",
        "notebook",
        "tree",
        "storage",
        "checkpoint",
        "inject",
        "vulnerability",
        "models",
    },
    "diagnose": {"errors", "frames", "notebook"},
    "plan": {"errors", "frames"},
    "testing": {"errors", "processes", "tree", "storage", "checkpoint"},
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


def test_front_door_holds_only_what_a_user_calls() -> None:
    """STYLE.md: front doors are small; results, events and errors live in named modules."""
    assert len(stalwart.__all__) <= 15, stalwart.__all__


@pytest.mark.parametrize("name", sorted(stalwart.MOVED))
def test_names_that_left_the_front_door_still_work_with_a_warning(name: str) -> None:
    where = stalwart.MOVED[name]
    assert name not in stalwart.__all__
    with pytest.warns(DeprecationWarning, match=rf"stalwart\.{name} moved to {where}"):
        old = getattr(stalwart, name)
    assert old is getattr(importlib.import_module(where), name)
    with pytest.warns(DeprecationWarning):
        exec(f"from stalwart import {name}", {})  # the import statement finds it too
    with pytest.raises(AttributeError):
        stalwart.NoSuchName  # noqa: B018


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


def test_the_front_door_keeps_one_list_of_names_and_imports_torch_only_when_asked() -> None:
    import stalwart.checkpoint as ckpt_pkg

    assert stalwart.__all__ == [*ckpt_pkg.__all__, "__version__"]
    code = (
        "import sys, stalwart; hasattr(stalwart, 'nosuch'); hasattr(stalwart, '__wrapped__'); "
        "print('torch' in sys.modules); print(len(stalwart.__all__), 'torch' in sys.modules); "
        "exec('from stalwart import *'); print(Checkpointer.__name__, sorted(dir(stalwart))[0])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:3] == ["False", "14 True", "Checkpointer AnyOf"]


def test_import_of_the_elastic_job_leaves_dtensor_unloaded() -> None:
    # a launcher and every worker pay this import at start (0.5 s on a 2-core box)
    code = "import sys, stalwart.elastic.job; print('torch.distributed.tensor' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_modules_stay_small_and_documented() -> None:
    for path in _modules():
        lines = path.read_text().count("\n")
        assert lines <= 600, (
            f"{path.relative_to(SRC)} has {lines} lines; split it by responsibility"
        )
        assert ast.get_docstring(ast.parse(path.read_text())), (
            f"{path.relative_to(SRC)} needs a docstring"
        )


MODULE_LINES = 400
FUNCTION_LINES = 60
BUDGET = Path(__file__).with_name("size_budget.json")


def _sizes() -> tuple[dict[str, int], dict[str, int]]:
    """Lines of every module over MODULE_LINES and every function over FUNCTION_LINES."""
    modules: dict[str, int] = {}
    functions: dict[str, int] = {}
    for path in _modules():
        rel = str(path.relative_to(SRC))
        text = path.read_text()
        if text.count("\n") > MODULE_LINES:
            modules[rel] = text.count("\n")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > FUNCTION_LINES:
                    key = f"{rel}:{node.name}"
                    functions[key] = max(functions.get(key, 0), n)
    return modules, functions


def test_modules_and_functions_only_shrink_past_the_style_limits() -> None:
    """STYLE.md: modules under ~400 lines, functions under ~60. Older ones past that are
    listed in size_budget.json with their size then; they may shrink, never grow, and no
    new one may join. After splitting one, regenerate the budget:
    STALWART_UPDATE_SIZE_BUDGET=1 pytest tests/unit/test_project.py."""
    import json
    import os

    modules, functions = _sizes()
    if os.environ.get("STALWART_UPDATE_SIZE_BUDGET") == "1":
        BUDGET.write_text(json.dumps({"modules": modules, "functions": functions}, indent=1))
    budget = json.loads(BUDGET.read_text())
    grown = [
        f"{name}: {n} lines (budget {budget[kind].get(name, 'none: new')})"
        for kind, found, limit in (
            ("modules", modules, MODULE_LINES),
            ("functions", functions, FUNCTION_LINES),
        )
        for name, n in sorted(found.items())
        if n > budget[kind].get(name, limit)
    ]
    assert not grown, "past the size limits of STYLE.md; split them:\n  " + "\n  ".join(grown)


def test_ruff_is_clean() -> None:
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    root = SRC.parents[1]
    proc = subprocess.run(
        [ruff, "check", "src", "tests", "bench"], cwd=root, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
