"""Compare two committed steps tensor by tensor, reading only what the hashes cannot settle.

A tensor whose shards have the same boxes and the same chunk hashes in both manifests is
unchanged, and none of its bytes are read: chunks are named by the BLAKE3 of their bytes. Only
the other tensors are read (whole, verified, one at a time) and compared element by element
in float64 (complex128 for complex dtypes), in blocks so that a large tensor never needs
more than a few MiB of float64 scratch. Non-tensor values (step counters, learning rates,
strings) are compared from the two skeletons without reading any tensor data, path by path
(the keys with their types: ``{"a.b": 1}`` and ``{"a": {"b": 1}}`` are two values); a value
is named like a tensor FQN, or by its tuple of keys where two paths share that name.

``DiffReport.to_json()`` is the machine-readable form, ``to_arrow()`` / ``to_pandas()`` /
``to_polars()`` the tabular one; ``write_diff_html`` renders a self-contained HTML page of it
and ``_repr_html_`` a compact fragment for notebooks (the records: :mod:`.diff_report`).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from stalwart.checkpoint.durable.checkpointer import Checkpointer
from stalwart.checkpoint.durable.manifest import Manifest, TensorEntry
from stalwart.checkpoint.durable.verification import reader_lease
from stalwart.checkpoint.tools.diff_report import DiffReport, TensorDiff, ValueDiff

__all__ = ["DiffReport", "TensorDiff", "ValueDiff", "diff_steps"]

_BLOCK_ELEMS = 1 << 20
"""Elements compared per block: bounds the float64 scratch to ~8 MiB per operand."""

ValuePath = tuple[tuple[str, Any], ...]
"""A value's path in a skeleton: its keys, each with the skeleton's type tag (``s``, ``i``,
``b``, ``n``; ``i`` for a list position too), so keys ``1`` and ``"1"`` are different paths."""


def diff_steps(ckpt: Checkpointer, a: int, b: int) -> DiffReport:
    """Compare step ``b`` with step ``a``, tensor by tensor and value by value.

    Args:
        ckpt: the checkpointer of the root holding both steps.
        a: the reference step.
        b: the step compared against it.

    Raises:
        CheckpointNotFoundError: either step does not exist.
        CorruptCheckpointError: a manifest or a chunk that had to be read is damaged.
    """
    t0 = time.perf_counter()
    ma, mb = ckpt.manifest(a), ckpt.manifest(b)
    store = ckpt.storage
    report = DiffReport(a=a, b=b)
    to_read: list[TensorDiff] = []
    for name, ea in ma.tensors.items():
        eb = mb.tensors.get(name)
        if eb is None:
            report.tensors.append(TensorDiff(name, "removed", ea.dtype, ea.shape, _numel(ea.shape)))
            continue
        row = TensorDiff(name, "unchanged", eb.dtype, eb.shape, _numel(eb.shape))
        if ea.dtype != eb.dtype:
            row.old_dtype = ea.dtype
        if ea.shape != eb.shape:
            row.status, row.old_shape = "reshaped", ea.shape
        elif ea.dtype != eb.dtype or _signature(ea) != _signature(eb):
            to_read.append(row)
        else:
            row.changed_elements, row.l2, row.max_abs, row.relative = 0, 0.0, 0.0, 0.0
            row.compared_by = "hash"
        report.tensors.append(row)
    for name, eb in mb.tensors.items():
        if name not in ma.tensors:
            report.tensors.append(TensorDiff(name, "added", eb.dtype, eb.shape, _numel(eb.shape)))
    if to_read:
        with reader_lease(
            store, steps=[a, b], packs=ma.packs() | mb.packs(), lease_s=ckpt.options.lease_s
        ):
            for row in to_read:
                ta, na = ckpt.read_tensor(a, row.name, leased=True)  # under the lease above
                tb, nb = ckpt.read_tensor(b, row.name, leased=True)
                report.bytes_read += na + nb
                report.tensors_read += 1
                _compare(row, ta, tb)
                del ta, tb  # one pair of full tensors alive at a time
    report.values = _diff_values(ma, mb)
    report.seconds = time.perf_counter() - t0
    return report


def _signature(e: TensorEntry) -> tuple[Any, ...]:
    return tuple((s.offsets, s.sizes, tuple(c.hash for c in s.chunks)) for s in e.shards)


def _compare(row: TensorDiff, a: torch.Tensor, b: torch.Tensor) -> None:
    """Fill ``row``'s change statistics from the full tensors ``a`` and ``b``."""
    row.compared_by = "data"
    wide = torch.complex128 if (a.is_complex() or b.is_complex()) else torch.float64
    # int64 values past 2**53 are not exact in float64: decide "changed" on the originals.
    exact_ints = a.dtype == b.dtype == torch.int64
    fa, fb = a.reshape(-1), b.reshape(-1)
    changed = nonfinite = 0
    sq = sq_a = mx = 0.0
    with torch.no_grad():
        for i in range(0, fa.numel(), _BLOCK_ELEMS):
            x, y = fa[i : i + _BLOCK_ELEMS].to(wide), fb[i : i + _BLOCK_ELEMS].to(wide)
            if exact_ints:
                mask = fa[i : i + _BLOCK_ELEMS] != fb[i : i + _BLOCK_ELEMS]
            else:
                mask = (x != y) & ~(torch.isnan(x) & torch.isnan(y))
            xa = x[torch.isfinite(x)].abs()
            sq_a += float((xa * xa).sum())
            d = (y - x)[mask]
            changed += int(mask.sum())
            finite = torch.isfinite(d)
            nonfinite += int((~finite).sum())
            d = d[finite].abs()
            if d.numel():
                sq += float((d * d).sum())
                mx = max(mx, float(d.max()))
    row.changed_elements, row.nonfinite = changed, nonfinite
    row.l2, row.max_abs = math.sqrt(sq), mx
    norm_a = math.sqrt(sq_a)
    if norm_a > 0:
        row.relative = row.l2 / norm_a
    else:
        row.relative = math.inf if row.l2 > 0 else 0.0
    if changed == 0 and row.old_dtype is None:
        row.status = "unchanged"  # same values, other bytes (e.g. -0.0 vs 0.0)
    else:
        row.status = "changed"


def _diff_values(ma: Manifest, mb: Manifest) -> list[ValueDiff]:
    va, vb = _values(ma.skeleton), _values(mb.skeleton)
    name = _names([*va, *vb])
    out: list[ValueDiff] = []
    for path, node in va.items():
        if path not in vb:
            out.append(ValueDiff(name[path], "removed", _show(node), None))
        elif vb[path] != node:
            out.append(ValueDiff(name[path], "changed", _show(node), _show(vb[path])))
    out.extend(ValueDiff(name[p], "added", None, _show(n)) for p, n in vb.items() if p not in va)
    return out


def _values(skeleton: Any) -> dict[ValuePath, Any]:
    """Non-tensor leaves of a skeleton (and empty containers) by their typed key path."""
    out: dict[ValuePath, Any] = {}

    def visit(node: Any, path: ValuePath) -> None:
        kind = node.get("k") if isinstance(node, dict) else None
        if kind == "tensor":
            return
        if kind == "stateful":
            visit(node.get("v"), path)
        elif kind == "dict" and node.get("v"):
            for (tag, key), child in node["v"]:  # keys checked when the manifest was read
                visit(child, (*path, (tag, key)))
        elif kind in ("list", "tuple") and node.get("v"):
            for i, child in enumerate(node["v"]):
                visit(child, (*path, ("i", i)))
        else:
            out[path] = node

    visit(skeleton, ())
    return out


def _names(paths: list[ValuePath]) -> dict[ValuePath, str]:
    """Each path's display name: its keys joined with ``.`` like a tensor FQN, or, where
    several paths join to the same name (``{"a.b": ..}`` and ``{"a": {"b": ..}}``, keys ``1``
    and ``"1"``), the tuple of its keys as Python writes it (``('a.b',)``, ``('a', 'b')``),
    as :func:`stalwart.tree.flatten` names paths whose FQNs collide."""
    dotted = {p: ".".join(str(v) for _, v in p) or "<root>" for p in paths}
    shared: dict[str, set[ValuePath]] = {}
    for p, name in dotted.items():
        shared.setdefault(name, set()).add(p)
    return {
        p: name if len(shared[name]) == 1 else repr(tuple(v for _, v in p))
        for p, name in dotted.items()
    }


def _show(node: Any) -> str:
    """A short human rendering of a skeleton value node."""
    kind = node.get("k") if isinstance(node, dict) else None
    v = node.get("v") if isinstance(node, dict) else node
    if kind == "none":
        return "None"
    if kind in ("int", "bool", "float"):
        return str(v)
    if kind == "str":
        text = repr(v)
        return text if len(text) <= 120 else text[:117] + "…'"
    if kind == "bytes":
        return f"<{len(str(v).rstrip('=')) * 3 // 4} bytes>"  # length of the base64 payload
    if kind == "dtype":
        return f"torch.{v}"
    if kind in ("dict", "list", "tuple"):
        return {"dict": "{}", "list": "[]", "tuple": "()"}[kind]
    return repr(node)[:120]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
