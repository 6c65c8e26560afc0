"""A damaged manifest never loads as wrong data and never escapes as a raw exception.

Each case from the adversarial review of issue 9: the manifest is damaged (a byte flip, or
an edit resealed with a valid checksum, as a buggy writer would leave it), then ``load``
and ``verify`` must both refuse it with a stalwart error, and ``fallback=True`` must reach
the intact older step.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import stalwart
from bench.fuzz_manifest import HOLE, reseal
from stalwart.checkpoint.durable.integrity import MAX_TREE_DEPTH
from stalwart.checkpoint.durable.manifest import FORMAT_VERSION, MAX_STEP, Manifest, manifest_key
from stalwart.checkpoint.tools.verify import verify_step
from stalwart.errors import (
    ConfigError,
    CorruptCheckpointError,
    UnsupportedValueError,
)

OPTS = stalwart.CheckpointOptions(chunk_bytes=4096)


def _w(step: int) -> torch.Tensor:
    """16 rows of 1 KiB, every 4 KiB chunk different (no dedup inside the tensor)."""
    return torch.arange(16 * 256, dtype=torch.float32).reshape(16, 256) + step


def _root(tmp_path: Path) -> Path:
    """Steps 1 and 2 of a small tree; step 2's ``w`` cut into two shards of rows 0-3, 4-15."""
    root = tmp_path / "ck"
    with stalwart.Checkpointer(root, OPTS) as ck:
        for step in (1, 2):
            ck.save(step, {"w": _w(step), "epoch": step + 4})
    doc = json.loads((root / manifest_key(2)).read_bytes())
    chunks = doc["tensors"]["w"]["shards"][0]["chunks"]
    doc["tensors"]["w"]["shards"] = [
        {"offsets": [0, 0], "sizes": [4, 256], "chunks": chunks[:1]},
        {"offsets": [4, 0], "sizes": [12, 256], "chunks": chunks[1:]},
    ]
    (root / manifest_key(2)).write_bytes(reseal(doc))
    return root


def _edit(root: Path, change: Callable[[dict[str, Any]], str | None]) -> None:
    """Apply ``change`` to step 2's manifest and reseal it (``change`` may return raw text
    that replaces the placeholder ``HOLE``)."""
    path = root / manifest_key(2)
    doc = json.loads(path.read_bytes())
    raw = change(doc) or ""
    path.write_bytes(reseal(doc, raw))


def _assert_refused(root: Path, match: str) -> None:
    """Load and verify both refuse step 2 with a stalwart error; fallback reaches step 1."""
    with stalwart.Checkpointer(root) as ck, pytest.raises(CorruptCheckpointError, match=match):
        ck.load(None, step=2)
    with stalwart.Checkpointer(root) as ck:
        report = verify_step(ck, 2)
        assert not report.ok and any(match in d for d in report.damaged), report.damaged
    with stalwart.Checkpointer(root) as ck:
        tree = ck.load(None, fallback=True)
        assert ck.last_load is not None and ck.last_load.step == 1
        assert torch.equal(tree["w"], _w(1)) and tree["epoch"] == 5


def test_the_two_shard_fixture_loads(tmp_path: Path) -> None:
    root = _root(tmp_path)
    with stalwart.Checkpointer(root) as ck:
        assert torch.equal(ck.load(None)["w"], _w(2))
        assert verify_step(ck, 2).ok


def test_a_shard_with_no_chunks_is_refused(tmp_path: Path) -> None:
    root = _root(tmp_path)
    _edit(root, lambda d: d["tensors"]["w"]["shards"][1].update(chunks=[]))
    _assert_refused(root, "has chunks of 0 bytes, its box needs 12288")


def test_overlapping_shards_that_sum_to_the_tensor_are_refused(tmp_path: Path) -> None:
    root = _root(tmp_path)
    # Rows 0-3 and 0-11: 16 rows in all, yet rows 12-15 are never written.
    _edit(root, lambda d: d["tensors"]["w"]["shards"][1].update(offsets=[0, 0]))
    _assert_refused(root, "overlap")


def test_a_flipped_plain_value_fails_the_checksum(tmp_path: Path) -> None:
    root = _root(tmp_path)
    path = root / manifest_key(2)
    data = path.read_bytes()
    assert data.count(b'"v":"6"') == 1  # epoch 6, stored as the string "6"
    path.write_bytes(data.replace(b'"v":"6"', b'"v":"8"'))
    _assert_refused(root, "does not match its checksum")


def test_every_single_byte_flip_is_caught(tmp_path: Path) -> None:
    data = (_root(tmp_path) / manifest_key(2)).read_bytes()
    for i in range(len(data)):
        for bit in (0x01, 0x20):
            bad = bytearray(data)
            bad[i] ^= bit
            with pytest.raises(CorruptCheckpointError):
                Manifest.from_bytes(bytes(bad))


def test_a_v1_manifest_with_a_checksum_is_checked(tmp_path: Path) -> None:
    # A "version":3 (or 2) damaged into 1 must not skip the checksum.
    root = _root(tmp_path)
    path = root / manifest_key(2)
    now = f'"version":{FORMAT_VERSION}'.encode()
    assert now in path.read_bytes()
    path.write_bytes(path.read_bytes().replace(now, b'"version":1'))
    _assert_refused(root, "does not match its checksum")


def test_a_v2_manifest_without_checksum_is_refused(tmp_path: Path) -> None:
    root = _root(tmp_path)
    path = root / manifest_key(2)
    doc = json.loads(path.read_bytes())
    del doc["checksum"]
    path.write_bytes(json.dumps(doc, separators=(",", ":")).encode())
    _assert_refused(root, "must end with its checksum")


BAD: dict[str, tuple[Callable[[dict[str, Any]], str | None], str]] = {
    "stats 1e400": (lambda d: d["stats"].update(seconds=HOLE) or "1e400", "finite"),
    "chunk check not hex": (
        lambda d: d["tensors"]["w"]["shards"][0]["chunks"][0].__setitem__(6, "z" * 32),
        "malformed XXH3-128 check",
    ),
    "chunk check too short": (
        lambda d: d["tensors"]["w"]["shards"][0]["chunks"][0].__setitem__(6, "0" * 31),
        "malformed XXH3-128 check",
    ),
    "chunk ref of 8 members": (
        lambda d: d["tensors"]["w"]["shards"][0]["chunks"][0].append("0" * 32),
        "malformed chunk reference",
    ),
    "chunk offset 2**63": (
        lambda d: d["tensors"]["w"]["shards"][0]["chunks"][0].__setitem__(3, 2**63),
        "offset must be an int",
    ),
    "5000-digit int": (lambda d: d.update(world_size=HOLE) or "1" * 5000, "not valid JSON"),
    "raw length 2**44": (
        lambda d: d["tensors"]["w"]["shards"][0]["chunks"][0].__setitem__(1, 2**44),
        "raw bytes are stored in 4096",
    ),
    "stored length 2**44": (  # as zstd, so the raw length may stay right
        lambda d: d["tensors"]["w"]["shards"][0]["chunks"][0].__setitem__(
            slice(4, 6), [2**44, "zstd"]
        ),
        "lie outside",
    ),
    "huge shape": (lambda d: d["tensors"]["w"].update(shape=[2**40, 2**40]), "impossibly large"),
    "deep JSON": (lambda d: d.update(stats=HOLE) or "[" * 5000 + "]" * 5000, "not valid JSON"),
    "700-deep JSON": (lambda d: d.update(metadata=HOLE) or "[" * 700 + "]" * 700, "JSON object"),
    "deep skeleton": (
        lambda d: d.update(skeleton=HOLE) or '{"k":"list","v":[' * 300 + "]}" * 300,
        f"more than {MAX_TREE_DEPTH} levels",
    ),
    "skeleton dict item": (lambda d: d["skeleton"]["v"].append([1]), "malformed skeleton dict"),
    "skeleton key": (lambda d: d["skeleton"]["v"][0].__setitem__(0, ["i", "x"]), "dict key"),
    "skeleton kind": (lambda d: d["skeleton"].update(k="frob"), "malformed skeleton"),
    "skeleton not a node": (lambda d: d["skeleton"]["v"][0].__setitem__(1, 3), "skeleton node"),
    "unknown tensor": (
        lambda d: d["skeleton"]["v"][0][1].update(v="nope"),
        "names tensor 'nope', which has no entry",
    ),
    "shards not a list": (lambda d: d["tensors"]["w"].update(shards={}), "JSON list"),
    "negative size": (
        lambda d: d["tensors"]["w"]["shards"][0].update(sizes=[-4, 256]),
        "must be an int",
    ),
    "NaN offset": (
        lambda d: d["tensors"]["w"]["shards"][0]["chunks"][0].__setitem__(3, HOLE) or "NaN",
        "must be an int",
    ),
    "step past 10**20": (lambda d: d.update(step=10**20), "step must be an int"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_hostile_manifest_is_refused_as_corruption(tmp_path: Path, name: str) -> None:
    change, match = BAD[name]
    root = _root(tmp_path)
    _edit(root, change)
    _assert_refused(root, match)


def test_a_chunk_past_the_end_of_its_pack_is_never_read(tmp_path: Path) -> None:
    # A 1 KB manifest asking for 16 TiB: refused from the pack's length, nothing allocated.
    root = _root(tmp_path)

    def grow(d: dict[str, Any]) -> None:
        c = d["tensors"]["w"]["shards"][0]["chunks"][0]
        c[3] = 2**44  # offset far past the pack's end
        c.__setitem__(5, "none")

    _edit(root, grow)
    _assert_refused(root, "lie outside")


def test_two_references_to_one_pack_offset_are_each_verified(tmp_path: Path) -> None:
    # Found by the fuzzer: reads were planned per (pack, offset), so a second reference to
    # the same bytes under another hash received them unverified.
    root = _root(tmp_path)

    def alias(d: dict[str, Any]) -> None:
        first, second = (s["chunks"][0] for s in d["tensors"]["w"]["shards"])
        second[3] = first[3]

    _edit(root, alias)
    _assert_refused(root, "does not match its hash")


def test_save_refuses_steps_the_manifest_key_cannot_hold(tmp_path: Path) -> None:
    with stalwart.Checkpointer(tmp_path, OPTS) as ck:
        with pytest.raises(ConfigError, match="20 digits"):
            ck.save(MAX_STEP + 1, {"x": torch.ones(1)})
        with pytest.raises(ConfigError, match="20 digits"):
            ck.save_async(10**20, {"x": torch.ones(1)})
        ck.save(MAX_STEP, {"x": torch.ones(1)})
        assert ck.steps() == [MAX_STEP]
        assert ck.load(None)["x"].item() == 1.0


def test_save_refuses_a_tree_too_deep_to_read_back(tmp_path: Path) -> None:
    deep: Any = torch.ones(1)
    for _ in range(MAX_TREE_DEPTH + 5):
        deep = [deep]
    with stalwart.Checkpointer(tmp_path, OPTS) as ck:
        with pytest.raises(UnsupportedValueError, match="levels"):
            ck.save(1, {"x": deep})
        assert ck.steps() == []


def test_cli_verify_fails_on_a_flipped_plain_value(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from stalwart.cli.main import app

    root = _root(tmp_path)
    path = root / manifest_key(2)
    path.write_bytes(path.read_bytes().replace(b'"v":"6"', b'"v":"8"'))
    env = {"COLUMNS": "400", "NO_COLOR": "1"}
    r = CliRunner().invoke(app, ["ckpt", "verify", str(root)], env=env)
    assert r.exit_code == 1 and "checksum" in r.stdout, r.stdout
    assert "Traceback" not in r.stdout + r.stderr
