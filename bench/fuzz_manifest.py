"""Fuzz the checkpoint reader with damaged manifests and packs: no raw error, no silent lie.

Saves two real checkpoints (step 1 intact, step 2 the target; the target's big tensor is
re-cut into two shards, so the tiling checks meet a multi-shard tensor), then, case after
case, damages step 2 and asks three readers about it: ``verify_step``, ``load(step=2)`` and
``load(fallback=True)``. Damage kinds: bit flips, byte overwrites, truncation, deleted byte
ranges, structural edits of the JSON (replace, delete, duplicate, swap), targeted numbers
(huge, negative, NaN, 1e400, 5,000 digits), deep nesting (700 to 5,000 levels), shard edits
(empty chunk lists, overlapping shards whose sizes still sum to the tensor's) and pack
damage (flips, truncation, deletion). Half of the structural edits are *resealed* (the
checksum recomputed, as a buggy writer or a deliberate author would) so that the structural
checks, not only the checksum, are exercised.

The ``mix`` kind is always resealed and mixes tensors up: a skeleton leaf naming another
tensor's entry, two entries' names swapped, a chunk reference pointing at another tensor's
chunk (or another chunk of the same tensor), a dtype, shape or shard offset edited, an
``aliases`` record added. Each such case is loaded twice, without a target and into a
zeroed copy of the saved state (a resume), and judged against what the manifest states:
the tensor each path's entry assembles from its hash-named chunks. A load that returns
anything else is ``silent``; a load that returns exactly what the re-sealed manifest
states, when that differs from what was saved, is ``rewritten`` (a self-consistent
manifest of other data, e.g. a chunk swapped for another of the same length and hash-valid
bytes: no reader can tell it from a genuine checkpoint) and is counted apart.

Every case must end in one of: loaded exactly the saved data, or refused with a stalwart
error. Failures are counted: ``raw`` (a non-stalwart exception), ``silent`` (a load returned
other data than saved), ``disagree`` (verify and load differ), ``hang`` (a case ran past
``--hang-s``).

    .venv/bin/python bench/fuzz_manifest.py --cases 10000 --seed 1

The same engine drives the seeded hypothesis test in ``tests/unit/test_manifest_fuzz.py``.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import math
import random
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import blake3
import numpy as np
import torch

import stalwart
from stalwart.checkpoint.durable.manifest import manifest_key
from stalwart.checkpoint.tools.verify import verify_step
from stalwart.errors import StalwartError

HOLE = "__h2_fuzz_hole__"
"""A placeholder string replaced, after JSON serialisation, by raw (possibly invalid) text."""

NUMBERS = [
    "-1", "0", "1", "3", "4096", "1.5", "-0.0", "1e-300", "1e400", "-1e400", "NaN",
    "Infinity", "-Infinity", str(2**31), str(2**44), str(2**62), str(2**63 - 1),
    str(2**63), str(2**64), str(10**30), "1" * 5000, "-" + "9" * 4400, "true", "null",
    '"7"', "[]", "{}",
]  # fmt: skip


class Chooser(Protocol):
    """Where the fuzzer's choices come from (``random.Random`` or hypothesis draws)."""

    def integer(self, lo: int, hi: int) -> int:
        """An int in ``[lo, hi]``."""
        ...


class RandomChooser:
    """Choices from a seeded ``random.Random``."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def integer(self, lo: int, hi: int) -> int:
        """An int in ``[lo, hi]``."""
        return self.rng.randint(lo, hi)


def pick(ch: Chooser, seq: list[Any]) -> Any:
    """One element of ``seq``."""
    return seq[ch.integer(0, len(seq) - 1)]


# -- the checkpoints under test ------------------------------------------------------------


def state(step: int) -> dict[str, Any]:
    """A tree with every kind of leaf the format holds; values depend on ``step``."""
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w": torch.randn(16, 256, generator=g),  # 16 KiB: 4 chunks of 4 KiB, 2 shards
            "b": torch.arange(6, dtype=torch.bfloat16) + step,
            "q": torch.arange(-8, 8, dtype=torch.int8) * step,
            "scalar": torch.tensor(float(step)),
            "empty": torch.empty(0, 3),
        },
        "opt": [{"m": torch.full((5,), step, dtype=torch.float64)}, (step, "adamw")],
        "np": np.arange(4, dtype=np.int32) + step,
        "epoch": step + 4,
        "lr": 0.001 * step,
        "flags": {1: True, None: None, "inf": math.inf},
        "blob": bytes([step]) * 3,
        "dtype": torch.float16,
    }


@dataclass
class Fixture:
    """A root with steps 1 and 2 saved, and what step 2 must load as."""

    root: Path
    manifest: bytes = field(repr=False)
    packs: dict[str, bytes] = field(repr=False)
    trees: dict[int, Any] = field(default_factory=dict, repr=False)
    chunks: dict[str, bytes] = field(default_factory=dict, repr=False)
    """Raw bytes of every chunk of step 2, by hash (what any manifest can point at)."""


def reseal(doc: dict[str, Any], raw: str = "") -> bytes:
    """Serialise ``doc`` as the writer does, ``HOLE`` replaced by ``raw``, checksum recomputed."""
    doc = {k: v for k, v in doc.items() if k != "checksum"}
    text = json.dumps(doc, separators=(",", ":"), allow_nan=False)
    body = text.replace(json.dumps(HOLE), raw).encode("utf-8")
    return body[:-1] + b',"checksum":"' + blake3.blake3(body).hexdigest().encode() + b'"}'


def unsealed(doc: dict[str, Any], raw: str = "") -> bytes:
    """Serialise ``doc`` keeping its (now stale) checksum as the last member."""
    text = json.dumps(doc, separators=(",", ":"), allow_nan=False)
    return text.replace(json.dumps(HOLE), raw).encode("utf-8")


def build_fixture(root: Path) -> Fixture:
    """Save steps 1 and 2 under ``root``; cut step 2's ``model.w`` into two shards."""
    opts = stalwart.CheckpointOptions(chunk_bytes=4096)
    with stalwart.Checkpointer(root, opts) as ck:
        ck.save(1, state(1))
        ck.save(2, state(2))
    path = root / manifest_key(2)
    doc = json.loads(path.read_bytes())
    w = doc["tensors"]["model.w"]
    (shard,) = w["shards"]
    chunks = shard["chunks"]  # 4 chunks of 4 rows each (a row is 1 KiB)
    w["shards"] = [
        {"offsets": [0, 0], "sizes": [4, 256], "chunks": chunks[:1]},
        {"offsets": [4, 0], "sizes": [12, 256], "chunks": chunks[1:]},
    ]
    data = reseal(doc)
    path.write_bytes(data)
    packs = {c[2] for t in doc["tensors"].values() for s in t["shards"] for c in s["chunks"]}
    fx = Fixture(root, data, {p: (root / p).read_bytes() for p in sorted(packs)})
    for t in doc["tensors"].values():
        for sh in t["shards"]:
            for h, _n, pack, off, length, *_codec_and_check in sh["chunks"]:
                fx.chunks[h] = fx.packs[pack][off : off + length]
    with stalwart.Checkpointer(root) as ck:
        fx.trees = {1: ck.load(None, step=1), 2: ck.load(None, step=2)}
    assert same_tree(fx.trees[2], state(2)) and same_tree(fx.trees[1], state(1))
    return fx


# -- mutations -----------------------------------------------------------------------------


@dataclass
class Case:
    """One damaged version of step 2: its manifest bytes and pack contents (None: deleted)."""

    kind: str
    manifest: bytes
    packs: dict[str, bytes | None] = field(default_factory=dict)
    resealed: bool = False


def _paths(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*path, i))
    return out


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def _deep(ch: Chooser) -> str:
    n = ch.integer(700, 5000)
    if ch.integer(0, 1):
        return "[" * n + "]" * n
    leaf = '{"k":"none"}'
    return '{"k":"list","v":[' * n + leaf + "]}" * n  # a valid, absurdly deep skeleton


def mutate(fx: Fixture, ch: Chooser) -> Case:
    """One random damage of step 2 (manifest bytes, its JSON, or a pack)."""
    base = fx.manifest
    kinds = ["flip", "byte", "truncate", "cut", "edit", "number", "nest", "shard", "pack", "mix"]
    kind = pick(ch, kinds)
    if kind == "flip":
        data = bytearray(base)
        for _ in range(ch.integer(1, 3)):
            data[ch.integer(0, len(data) - 1)] ^= 1 << ch.integer(0, 7)
        return Case(kind, bytes(data))
    if kind == "byte":
        data = bytearray(base)
        i = ch.integer(0, len(data) - 1)
        data[i] = (data[i] + ch.integer(1, 255)) % 256
        return Case(kind, bytes(data))
    if kind == "truncate":
        return Case(kind, base[: ch.integer(0, len(base) - 1)])
    if kind == "cut":
        a = ch.integer(0, len(base) - 1)
        return Case(kind, base[:a] + base[a + ch.integer(1, 64) :])
    if kind == "pack":
        return _pack_case(fx, ch)
    doc = json.loads(base)
    del doc["checksum"]
    if kind == "mix":
        return mix_case(fx, ch)
    seal = ch.integer(0, 1) == 1
    raw = ""
    if kind == "shard":
        _shard_edit(doc, ch)
    elif kind in ("number", "nest"):
        paths = [p for p in _paths(doc) if p]
        if kind == "number":
            paths = [p for p in paths if isinstance(_get(doc, p), (int, float))] or paths
        p = pick(ch, paths)
        _get(doc, p[:-1])[p[-1]] = HOLE
        raw = pick(ch, NUMBERS) if kind == "number" else _deep(ch)
    else:
        _structural_edit(doc, ch, allow_swap=not seal)
    data = reseal(doc, raw) if seal else unsealed({**doc, "checksum": "0" * 64}, raw)
    return Case(kind, data, resealed=seal)


def _structural_edit(doc: dict[str, Any], ch: Chooser, *, allow_swap: bool) -> None:
    """Replace, delete, duplicate or (unsealed only) swap one node of the JSON."""
    p = pick(ch, [p for p in _paths(doc) if p])
    parent, key = _get(doc, p[:-1]), p[-1]
    ops = ["replace", "delete", "duplicate"] + (["swap"] if allow_swap else [])
    op = pick(ch, ops)
    if op == "replace":
        parent[key] = pick(ch, [None, True, -1, 0, 2**64, 1.5, "x", "float32", [], {}, [[0]]])
    elif op == "delete":
        del parent[key]
    elif isinstance(parent, list):
        if op == "duplicate":
            parent.insert(key, parent[key])
        elif len(parent) > 1:
            j = ch.integer(0, len(parent) - 1)
            parent[key], parent[j] = parent[j], parent[key]


def _shard_edit(doc: dict[str, Any], ch: Chooser) -> None:
    """Edits the tiling checks exist for: empty chunk lists, overlaps that sum right."""
    w = doc["tensors"]["model.w"]["shards"]
    op = ch.integer(0, 3)
    if op == 0:
        pick(ch, w)["chunks"] = []
    elif op == 1:  # overlap, sizes still summing to the tensor's: rows 0-11 and 0-3 ... 4-15
        w[1]["offsets"] = [0, 0]
    elif op == 2:  # one shard twice, the other gone
        doc["tensors"]["model.w"]["shards"] = [w[1], w[1]]
    else:
        t = pick(ch, list(doc["tensors"].values()))
        t["shards"] = t["shards"] + t["shards"][:1]


def _leaves(node: Any) -> list[dict[str, Any]]:
    """Every tensor node of a skeleton."""
    if isinstance(node, dict):
        own = [node] if node.get("k") == "tensor" else []
        return own + [n for v in node.values() for n in _leaves(v)]
    if isinstance(node, list):
        return [n for v in node for n in _leaves(v)]
    return []


def mix_case(fx: Fixture, ch: Chooser) -> Case:
    """A resealed manifest of step 2 with tensors mixed up (see ``_mix_edit``)."""
    doc = json.loads(fx.manifest)
    del doc["checksum"]
    return Case(f"mix-{_mix_edit(doc, ch)}", reseal(doc), resealed=True)


def _mix_edit(doc: dict[str, Any], ch: Chooser) -> str:
    """Mix tensors up in a way a checksum cannot see (the caller reseals); return the op."""
    tensors = doc["tensors"]
    names = list(tensors)
    a, b = pick(ch, names), pick(ch, names)
    if not tensors[a]["shards"] or not tensors[b]["shards"]:  # an empty tensor has none
        a, b = "model.w", pick(ch, [n for n in names if tensors[n]["shards"]])
    op = pick(ch, ["leaf", "swap", "chunk", "chunks", "dtype", "shape", "offsets", "alias"])
    if op == "leaf":  # a skeleton leaf names another tensor's entry
        pick(ch, _leaves(doc["skeleton"]))["v"] = b
    elif op == "swap":  # two entries trade names
        tensors[a], tensors[b] = tensors[b], tensors[a]
    elif op == "chunk":  # one chunk reference re-pointed at any chunk of step 2
        shard = pick(ch, tensors[a]["shards"])
        others = [c for t in tensors.values() for s in t["shards"] for c in s["chunks"]]
        if shard["chunks"]:
            i = ch.integer(0, len(shard["chunks"]) - 1)
            shard["chunks"][i] = list(pick(ch, others))
    elif op == "chunks":  # a shard takes another tensor's whole chunk list
        pick(ch, tensors[a]["shards"])["chunks"] = list(pick(ch, tensors[b]["shards"])["chunks"])
    elif op == "dtype":
        tensors[a]["dtype"] = pick(
            ch, ["float32", "int32", "float16", "bfloat16", "int8", "uint8", "float64", "bool"]
        )
    elif op == "shape":
        shape = tensors[a]["shape"]
        if shape:
            i = ch.integer(0, len(shape) - 1)
            shape[i] = pick(ch, [0, 1, 2, shape[i] * 2, max(shape[i] // 2, 1)])
        else:
            tensors[a]["shape"] = [1]
    elif op == "offsets":
        shard = pick(ch, tensors[a]["shards"])
        if shard["offsets"]:
            i = ch.integer(0, len(shard["offsets"]) - 1)
            shard["offsets"][i] = pick(ch, [0, 1, 4, 12, shard["offsets"][i] + 1])
    else:  # an alias record, plausible or not
        strides = [pick(ch, [0, 1, 2, 256]) for _ in tensors[a]["shape"]]
        doc["aliases"] = {a: {"of": b, "offset": ch.integer(0, 8), "strides": strides}}
    return op


def _pack_case(fx: Fixture, ch: Chooser) -> Case:
    key = pick(ch, list(fx.packs))
    data = bytearray(fx.packs[key])
    op = ch.integer(0, 3)
    new: bytes | None
    if op == 0 and data:
        data[ch.integer(0, len(data) - 1)] ^= 1 << ch.integer(0, 7)
        new = bytes(data)
    elif op == 1:
        new = bytes(data[: ch.integer(0, max(len(data) - 1, 0))])
    elif op == 2:
        new = bytes(data) + b"\0" * ch.integer(1, 64)  # longer is fine: must still load
    else:
        new = None
    return Case("pack", fx.manifest, {key: new})


# -- the oracle ----------------------------------------------------------------------------


def same_tree(a: Any, b: Any) -> bool:
    """Exact equality: types, dtypes, shapes, bytes; NaN equals NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and a.reshape(-1)
            .contiguous()
            .view(torch.uint8)
            .equal(b.reshape(-1).contiguous().view(torch.uint8))
        )
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return bool(a == b)


def same_tensors(loaded: Any, saved: Any) -> bool:
    """Every tensor ``loaded`` holds has the dtype and bytes of one of the saved tensors.

    The oracle for resealed edits: the skeleton or a shape may legitimately have been
    rewritten (a key renamed, an item dropped, an empty tensor's shape changed: no byte
    differs), but no tensor may hold bytes that were never saved (memory left
    uninitialised, a target's old values, chunks in the wrong order).
    """
    want = [_raw(leaf.tensor) for leaf in stalwart.tree.flatten(saved).leaves.values()]
    got = stalwart.tree.flatten(loaded).leaves.values()
    return all(_raw(leaf.tensor) in want for leaf in got)


def _raw(t: torch.Tensor) -> tuple[torch.dtype, bytes]:
    return t.dtype, t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


class Hang(Exception):
    """A case ran past its time limit."""


def _alarm(signum: int, frame: Any) -> None:
    raise Hang()


def run_case(fx: Fixture, case: Case) -> str:
    """Apply ``case``, ask verify and load about it, restore step 2; return the outcome.

    Outcomes: ``loaded`` (exactly the saved data), ``refused`` (a stalwart error), or a
    failure: ``raw:<where>:<type>``, ``silent:<where>``, ``disagree:<verify>/<load>``.
    """
    root = fx.root
    (root / manifest_key(2)).write_bytes(case.manifest)
    for key, data in case.packs.items():
        if data is None:
            (root / key).unlink()
        else:
            (root / key).write_bytes(data)
    try:
        return _judge(fx, case)
    finally:
        (root / manifest_key(2)).write_bytes(fx.manifest)
        for key in case.packs:
            (root / key).write_bytes(fx.packs[key])


def stated(fx: Fixture, manifest: bytes) -> dict[str, torch.Tensor] | None:
    """Each tensor as the manifest states it: its shards assembled from hash-named chunks.

    None when the manifest cannot state one (a chunk or a box that no reading could fill);
    a reader must then refuse it.
    """
    doc = json.loads(manifest)
    out: dict[str, torch.Tensor] = {}
    try:
        for name, e in doc["tensors"].items():
            t = torch.zeros(e["shape"], dtype=stalwart.tree.dtype_from_name(e["dtype"]))
            # bool stays as bytes: a copy would turn a stored 0xF8 into 1, yet a reader
            # returns the stored bytes (the format's bools are 0 or 1; others are kept).
            work = t.view(torch.uint8) if t.dtype == torch.bool else t
            for sh in e["shards"]:
                raw = b"".join(fx.chunks[c[0]] for c in sh["chunks"])
                box = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else None
                box = (
                    box.view(work.dtype).reshape(sh["sizes"])
                    if box is not None
                    else torch.empty(sh["sizes"], dtype=work.dtype)
                )
                region = work
                for d, (o, z) in enumerate(zip(sh["offsets"], sh["sizes"], strict=True)):
                    region = region.narrow(d, o, z)
                region.copy_(box)
            out[name] = t
    except (KeyError, RuntimeError, ValueError, TypeError, StalwartError):
        return None
    return out


def _zeroed(tree: Any) -> Any:
    """``tree`` with every tensor and array zeroed (a resume's freshly built state)."""
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, np.ndarray):
        return np.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: _zeroed(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_zeroed(v) for v in tree)
    return tree


def _judge_mix(fx: Fixture, case: Case) -> str:
    """A mixed-up, resealed manifest: each load refused, or exactly what it states."""
    verdicts = []
    for target in (None, _zeroed(fx.trees[2])):
        with stalwart.Checkpointer(fx.root) as ck:
            try:
                tree = ck.load(target, step=2)
            except StalwartError:
                verdicts.append("refused")
                continue
            except Exception as e:
                return f"raw:load:{type(e).__name__}"
        if same_tree(tree, fx.trees[2]):
            verdicts.append("loaded")
            continue
        says = stated(fx, case.manifest)
        leaves = stalwart.tree.flatten(tree).leaves
        if says is None or any(
            fqn not in says or _raw(leaf.tensor) != _raw(says[fqn]) for fqn, leaf in leaves.items()
        ):
            return "silent:load" if target is None else "silent:target"
        verdicts.append("rewritten")
    return "rewritten" if "rewritten" in verdicts else max(verdicts)  # refused > loaded


def _judge(fx: Fixture, case: Case) -> str:
    if case.kind.startswith("mix-"):
        return _judge_mix(fx, case)
    with stalwart.Checkpointer(fx.root) as ck:
        try:
            v_ok = verify_step(ck, 2).ok
        except StalwartError:
            v_ok = False
        except Exception as e:  # the very thing being counted
            return f"raw:verify:{type(e).__name__}"
    with stalwart.Checkpointer(fx.root) as ck:
        try:
            tree, l_ok = ck.load(None, step=2), True
        except StalwartError:
            tree, l_ok = None, False
        except Exception as e:
            return f"raw:load:{type(e).__name__}"
    if l_ok:
        good = same_tensors if case.resealed else same_tree
        if not good(tree, fx.trees[2]):
            return "silent:load"
    if v_ok != l_ok:
        return f"disagree:verify={v_ok}/load={l_ok}"
    with stalwart.Checkpointer(fx.root) as ck:
        try:
            tree = ck.load(None, fallback=True)
        except StalwartError:
            # Step 1 is intact unless the damaged pack is one step 1 shares (dedup).
            return "refused" if case.packs else "fallback-failed"
        except Exception as e:
            return f"raw:fallback:{type(e).__name__}"
        step = ck.last_load.step if ck.last_load else None
    if step == 1 and not same_tree(tree, fx.trees[1]):
        return "silent:fallback"
    if step == 2 and not (
        l_ok and (same_tensors if case.resealed else same_tree)(tree, fx.trees[2])
    ):
        return "silent:fallback"
    return "loaded" if l_ok else "refused"


def fuzz(
    cases: int, seed: int, hang_s: float, workdir: Path, keep: Path | None = None
) -> collections.Counter[str]:
    """Run ``cases`` random cases; count outcomes by damage kind and verdict.

    Failing cases are copied under ``keep`` (a root each) when it is given.
    """
    fx = build_fixture(workdir / "ck")
    ch = RandomChooser(seed)
    counts: collections.Counter[str] = collections.Counter()
    signal.signal(signal.SIGALRM, _alarm)
    for i in range(cases):
        case = mutate(fx, ch)
        signal.setitimer(signal.ITIMER_REAL, hang_s)
        try:
            outcome = run_case(fx, case)
        except Hang:
            outcome = "hang"
            (fx.root / manifest_key(2)).write_bytes(fx.manifest)
            for key, data in fx.packs.items():
                (fx.root / key).write_bytes(data)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        counts[f"{case.kind}{'+sealed' if case.resealed else ''} {outcome}"] += 1
        counts[f"ALL {outcome.split(':')[0]}"] += 1
        if outcome.split(":")[0] not in ("loaded", "refused", "rewritten"):
            print(f"case {i}: {case.kind} sealed={case.resealed}: {outcome}", flush=True)
            if keep is not None:
                _keep(fx, case, keep / f"case-{i:06d}")
    return counts


def _keep(fx: Fixture, case: Case, out: Path) -> None:
    """Copy the fixture's root with ``case`` applied to ``out``, to replay a failure."""
    import shutil

    shutil.copytree(fx.root, out)
    (out / manifest_key(2)).write_bytes(case.manifest)
    for key, data in case.packs.items():
        if data is None:
            (out / key).unlink()
        else:
            (out / key).write_bytes(data)


def main() -> None:
    """Parse arguments, fuzz, print the counts."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--hang-s", type=float, default=30.0)
    ap.add_argument("--keep", type=Path, help="copy the root of each failing case here")
    args = ap.parse_args()
    logging.getLogger("stalwart").setLevel(logging.ERROR)  # fallbacks warn, case after case
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        counts = fuzz(args.cases, args.seed, args.hang_s, Path(tmp), args.keep)
    print(f"{args.cases} cases, seed {args.seed}, {time.perf_counter() - t0:.0f} s")
    for k in sorted(counts):
        print(f"{counts[k]:7d}  {k}")
    bad = sum(
        v
        for k, v in counts.items()
        if k.startswith("ALL ") and k[4:] not in ("loaded", "refused", "rewritten")
    )
    print(f"failures (raw / silent / disagree / hang): {bad}")


if __name__ == "__main__":
    main()
