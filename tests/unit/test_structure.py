"""Keeps the structure honest: no import cycles, no reaches into other modules' privates.

STYLE.md: no import cycles hidden by function-local imports, and tools built on a module use its
public API, never its private attributes. Both are ratchets like the size budget in
test_project.py: ``import_cycles.json`` and ``private_reaches.json`` next to this file list what
is known today; an entry may shrink or go, nothing new may join. After removing some, regenerate
them::

    STALWART_UPDATE_STRUCTURE_RATCHET=1 pytest tests/unit/test_structure.py

A reach that is the right call stays when its line says why: ``# private-ok: <reason>``.
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[2] / "src" / "stalwart"

CYCLES = Path(__file__).with_name("import_cycles.json")
REACHES = Path(__file__).with_name("private_reaches.json")
_UPDATE_STRUCTURE = "STALWART_UPDATE_STRUCTURE_RATCHET"
_PRIVATE_OK = re.compile(r"#\s*private-ok:\s*\S")


@dataclass(frozen=True)
class _Module:
    name: str  # dotted: stalwart.checkpoint (a package's __init__) or stalwart.cli.ckpt
    rel: str  # path under src/stalwart, for messages and ratchet keys
    tree: ast.Module
    lines: list[str]

    @property
    def is_package(self) -> bool:
        return self.rel.endswith("__init__.py")


def _parse_all(root: Path = SRC) -> dict[str, _Module]:
    mods = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        text = path.read_text()
        mods[name] = _Module(name, str(path.relative_to(root)), ast.parse(text), text.splitlines())
    return mods


def _absolute(mod: _Module, node: ast.ImportFrom) -> str:
    """The module ``from ... import`` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    base = mod.name.split(".")
    if not mod.is_package:
        base = base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _import_graph(mods: dict[str, _Module]) -> dict[str, dict[str, int]]:
    """module -> {stalwart module it imports: line}, every import counted: top-level,
    function-local and ``if TYPE_CHECKING:`` alike (each one still ties the modules together)."""
    graph: dict[str, dict[str, int]] = {name: {} for name in mods}
    for name, mod in mods.items():
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(mod, node)
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                if target in mods and target != name:
                    graph[name].setdefault(target, node.lineno)
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return sorted(groups)


def _is_private(name: str) -> bool:
    """``_x``, but not ``__x__`` / ``__x`` (Python's) nor ``_x_`` (protocols: ``_repr_html_``)."""
    return name.startswith("_") and not name.startswith("__") and not name.endswith("_")


def _private_names(tree: ast.Module) -> set[str]:
    """Private names a module defines: functions, classes, assignments, ``self._x`` stores."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            names.add(node.attr)
    return {n for n in names if _is_private(n)}


def _foreign_names(tree: ast.Module) -> set[str]:
    """Names a module binds by importing something other than stalwart (torch, np, ...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {
                (a.asname or a.name).split(".")[0]
                for a in node.names
                if not a.name.startswith("stalwart")
            }
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names |= (
                set()
                if (node.module or "").startswith("stalwart")
                else {a.asname or a.name for a in node.names}
            )
    return names


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _private_reaches(mods: dict[str, _Module]) -> dict[str, int]:
    """``"path: what"`` -> count of each reach into another module's private names.

    A reach is ``obj._name`` where another stalwart module defines ``_name`` (a module's own
    classes may share privates it alone defines), or ``from stalwart.x import _name``. Attributes of
    ``self``, ``cls``, ``super()`` and of foreign imports (``torch._C``) are not reaches, nor
    any line that says why it may reach: ``# private-ok: <reason>``.
    """
    defined = {name: _private_names(mod.tree) for name, mod in mods.items()}
    modules_defining = Counter(n for names in defined.values() for n in names)
    found: dict[str, int] = {}
    for name, mod in mods.items():
        others = {n for n, c in modules_defining.items() if c > (n in defined[name])}
        skip = _foreign_names(mod.tree) | {"super"}
        for what, linenos in _reaches_in(mod, others, skip):
            if not any(n and _PRIVATE_OK.search(mod.lines[n - 1]) for n in linenos):
                key = f"{mod.rel}: {what}"
                found[key] = found.get(key, 0) + 1
    return dict(sorted(found.items()))


def _reaches_in(
    mod: _Module, others: set[str], skip: set[str]
) -> list[tuple[str, tuple[int | None, ...]]]:
    """Candidate reaches in one module, with the lines a ``# private-ok`` comment may sit on."""
    out: list[tuple[str, tuple[int | None, ...]]] = []
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Attribute) and node.attr in others:
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            root = _root(node.value)  # super(), or a foreign module: torch._C, cloud_io._load
            if not own and not (isinstance(root, ast.Name) and root.id in skip):
                out.append(
                    (f"{ast.unparse(node.value)}.{node.attr}", (node.lineno, node.end_lineno))
                )
        elif isinstance(node, ast.ImportFrom) and _absolute(mod, node).startswith("stalwart"):
            out += [
                (f"from {_absolute(mod, node)} import {a.name}", (node.lineno, a.lineno))
                for a in node.names
                if _is_private(a.name)
            ]
    return out


def _ratchet(path: Path, current: Any) -> Any:
    """The known entries in ``path``; written from ``current`` first when regenerating."""
    if os.environ.get(_UPDATE_STRUCTURE) == "1":
        path.write_text(json.dumps(current, indent=1) + "\n")
    return json.loads(path.read_text())


def _one_cycle(graph: dict[str, dict[str, int]], group: list[str]) -> str:
    """The shortest cycle through ``group[0]`` inside the group, with the line of each import."""
    start, members = group[0], set(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier and start not in came_from:
        nxt = []
        for a in frontier:
            for b in sorted(graph[a]):
                if b in members and b not in came_from:
                    came_from[b] = a
                    nxt.append(b)
        frontier = nxt
    path = [start]
    while len(path) == 1 or path[-1] != start:
        path.append(came_from[path[-1]])
    path.reverse()
    steps = [f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(path)]
    return " -> ".join([*steps, start]) + f"   [{len(group)} modules in the group]"


def test_no_new_import_cycles() -> None:
    """Modules that import each other (function-local and TYPE_CHECKING imports counted) make
    one class spread over files; break the cycle by moving the shared part down into a leaf."""
    graph = _import_graph(_parse_all())
    known = [set(group) for group in _ratchet(CYCLES, _cycles(graph))]
    new = [group for group in _cycles(graph) if not any(set(group) <= k for k in known)]
    where = [_one_cycle(graph, group) for group in new]
    assert not new, (
        f"new import cycles (known ones are in {CYCLES.name}; regenerate with "
        f"{_UPDATE_STRUCTURE}=1 only after removing some):\n  " + "\n  ".join(where)
    )


def test_no_new_private_reaches() -> None:
    """Use another module's public API; when a reach is the right call, say why on its line
    with ``# private-ok: <reason>``."""
    found = _private_reaches(_parse_all())
    known = _ratchet(REACHES, found)
    new = [f"{k} (x{n}, known x{known.get(k, 0)})" for k, n in found.items() if n > known.get(k, 0)]
    assert not new, (
        f"new private reaches across modules (known ones are in {REACHES.name}; regenerate "
        f"with {_UPDATE_STRUCTURE}=1 only after removing some):\n  " + "\n  ".join(new)
    )


def test_the_checks_see_hidden_cycles_and_accept_reasoned_reaches(tmp_path: Path) -> None:
    pkg = tmp_path / "stalwart"
    (pkg / "p").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "p/__init__.py": "",
        "p/a.py": "from stalwart.p import b\n_x = 1\nclass A:\n    _y = 2\n",
        "p/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n",
        "p/c.py": "def f():\n    from stalwart.p.a import _x\n",
        "p/d.py": "from stalwart.p.a import A\nA._y\nA._y  # private-ok: shown in a test\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    mods = _parse_all(pkg)
    assert _cycles(_import_graph(mods)) == [["stalwart.p.a", "stalwart.p.b"]]
    assert _private_reaches(mods) == {
        "p/c.py: from stalwart.p.a import _x": 1,
        "p/d.py: A._y": 1,
    }
