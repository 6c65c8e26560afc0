"""verify / diff / export / import on real checkpoints written by the engine into tmp_path."""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stalwart import Checkpointer, CheckpointOptions
from stalwart.checkpoint.durable.manifest import manifest_key
from stalwart.checkpoint.tools.diff import diff_steps
from stalwart.checkpoint.tools.export import export_step, import_file
from stalwart.checkpoint.tools.verify import verify_all, verify_step
from stalwart.cli.diff_html import write_diff_html
from stalwart.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError
from stalwart.storage import LocalStorage
from stalwart.storage.base import Buffer, ObjectInfo

pytestmark = pytest.mark.timeout(120)

OPTS = CheckpointOptions(chunk_bytes=4096, io_threads=2)


class CountingStorage:
    """A LocalStorage that counts the pack bytes read through it (a real store, watched)."""

    def __init__(self, root: Path) -> None:
        self.inner = LocalStorage(root)
        self.url = self.inner.url
        self.pack_reads = 0

    def write(self, key: str, data: Iterable[Buffer]) -> int:
        return self.inner.write(key, data)

    def read_into(self, key: str, offset: int, out: memoryview) -> int:
        if key.startswith("packs/"):
            self.pack_reads += 1
        return self.inner.read_into(key, offset, out)

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        if key.startswith("packs/"):
            self.pack_reads += 1
        return self.inner.read(key, offset, length)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return self.inner.list(prefix)

    def close(self) -> None:
        self.inner.close()


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def _pack_of(ck: Checkpointer, step: int, fqn: str) -> tuple[str, list[int]]:
    """The pack holding ``fqn`` in ``step`` and the offsets of its chunks there."""
    chunks = [c for s in ck.manifest(step).tensors[fqn].shards for c in s.chunks]
    assert len({c.pack for c in chunks}) == 1
    return chunks[0].pack, [c.offset for c in chunks]


# -- verify --------------------------------------------------------------------------------


@pytest.fixture
def three_packs(tmp_path: Path) -> Iterator[tuple[Checkpointer, Path]]:
    """Step 3 references three packs: ``a`` (step 1's), ``b`` (step 2's) and ``c`` (its own)."""
    root = tmp_path / "ck"
    ck = Checkpointer(root, OPTS)
    a, b, c = torch.randn(1024), torch.randn(2048), torch.randn(4096)  # 1, 2 and 4 chunks
    ck.save(1, {"a": a})
    ck.save(2, {"a": a, "b": b})
    ck.save(3, {"a": a, "b": b, "c": c, "c_again": c.clone(), "step": 3})
    yield ck, root
    ck.close()


def test_verify_intact(three_packs: tuple[Checkpointer, Path]) -> None:
    ck, _ = three_packs
    r = verify_step(ck, 3)
    assert r.ok and r.damaged == []
    # c and c_again share their 4 chunks: read once. a: 1, b: 2, c: 4 distinct chunks.
    assert r.chunks_checked == 7
    assert r.bytes_checked == (1024 + 2048 + 4096) * 4
    assert [x.ok for x in verify_all(ck)] == [True, True, True]


def test_verify_lists_every_damaged_chunk(three_packs: tuple[Checkpointer, Path]) -> None:
    ck, root = three_packs
    pack_a, _ = _pack_of(ck, 3, "a")
    pack_b, offs_b = _pack_of(ck, 3, "b")
    pack_c, offs_c = _pack_of(ck, 3, "c")
    assert len({pack_a, pack_b, pack_c}) == 3
    # Flip one byte in two of c's four chunks.
    with open(root / pack_c, "r+b") as f:
        for off in (offs_c[1] + 7, offs_c[3] + 100):
            f.seek(off)
            byte = f.read(1)
            f.seek(off)
            f.write(bytes([byte[0] ^ 0x10]))
    # Truncate b's pack inside its second chunk; delete a's pack.
    os.truncate(root / pack_b, offs_b[1] + 10)
    os.remove(root / pack_a)

    r = verify_step(ck, 3)
    assert not r.ok
    assert r.chunks_checked == 7  # every chunk checked, not only up to the first bad one
    text = "\n".join(r.damaged)
    flips = [d for d in r.damaged if "does not match its hash" in d]
    # 2 flipped chunks, each reported for c and for c_again (shared by dedup).
    assert len(flips) == 4
    assert sum("'c'" in d for d in flips) == 2 and sum("'c_again'" in d for d in flips) == 2
    assert all(pack_c in d for d in flips)
    # Reported in manifest order: tensor by tensor, chunk by chunk.
    assert ["'c' " in flips[0], "chunk 2/4" in flips[0], "chunk 4/4" in flips[1]] == [True] * 3
    assert "'c_again'" in flips[2] and "chunk 2/4" in flips[2]
    trunc = [d for d in r.damaged if "truncated" in d]
    assert len(trunc) == 1 and "'b'" in trunc[0] and pack_b in trunc[0]
    missing = [d for d in r.damaged if "missing" in d]
    assert len(missing) == 1 and "'a'" in missing[0] and pack_a in missing[0]
    assert len(r.damaged) == 6, text
    # Step 1 shares a's pack: damaged too; the report per step is independent.
    by_step = {x.step: x.ok for x in verify_all(ck)}
    assert by_step == {1: False, 2: False, 3: False}


def test_verify_damaged_manifest_is_a_report_not_a_traceback(
    three_packs: tuple[Checkpointer, Path],
) -> None:
    ck, root = three_packs
    (root / manifest_key(2)).write_bytes(b'{"format": "stalwart.checkpoint", "vers')
    r = verify_step(ck, 2)
    assert not r.ok and r.chunks_checked == 0
    assert len(r.damaged) == 1 and "manifest of step 2" in r.damaged[0]
    assert [x.ok for x in verify_all(ck)] == [True, False, True]
    with pytest.raises(CheckpointNotFoundError, match="step 9"):
        verify_step(ck, 9)


def test_verify_shards_that_do_not_cover_their_tensor(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "ck", OPTS) as ck:
        ck.save(1, {"w": torch.randn(8, 8)})
        key = manifest_key(1)
        doc = json.loads((tmp_path / "ck" / key).read_bytes())
        doc["tensors"]["w"]["shape"] = [16, 8]  # the one shard now covers half of it
        (tmp_path / "ck" / key).write_bytes(json.dumps(doc).encode())
        r = verify_step(ck, 1)
    assert not r.ok
    assert any("cover 64 of 128 elements" in d for d in r.damaged), r.damaged


# -- diff ----------------------------------------------------------------------------------


def test_diff_reads_only_what_hashes_cannot_settle(tmp_path: Path) -> None:
    store = CountingStorage(tmp_path / "ck")
    m = _model()
    with Checkpointer(store, OPTS) as ck:
        ck.save(1, {"model": m.state_dict(), "step": 1, "name": "run", "lr": 0.1})
        ck.save(2, {"model": m.state_dict(), "step": 1, "name": "run", "lr": 0.1})
        store.pack_reads = 0
        same = diff_steps(ck, 1, 2)
        assert store.pack_reads == 0 and same.bytes_read == 0 and same.tensors_read == 0
        assert same.identical and same.counts()["unchanged"] == 4
        assert all(r.compared_by == "hash" for r in same.tensors)

        first = m[0]
        assert isinstance(first, torch.nn.Linear)
        old_w = first.weight.detach().clone()
        with torch.no_grad():
            first.weight[3, 5] += 0.5
            first.weight[10, 0] -= 2.0
        sd = m.state_dict()
        del sd["2.bias"]
        sd["extra"] = torch.ones(3)
        ck.save(3, {"model": sd, "step": 3, "lr": 0.1, "wd": 0.01})
        store.pack_reads = 0
        r = diff_steps(ck, 2, 3)
    assert store.pack_reads > 0
    rows = {x.name: x for x in r.tensors}
    assert rows["model.0.bias"].status == "unchanged"
    assert rows["model.0.bias"].compared_by == "hash"
    assert rows["model.2.weight"].status == "unchanged"
    assert rows["model.2.bias"].status == "removed"
    assert rows["model.extra"].status == "added"
    w = rows["model.0.weight"]
    assert w.status == "changed" and w.compared_by == "data"
    assert w.changed_elements == 2 and w.numel == 64 * 32
    new_w = first.weight.detach()
    delta = (new_w.double() - old_w.double()).flatten()
    assert w.l2 == pytest.approx(float(delta.norm()))
    assert w.max_abs == pytest.approx(float(delta.abs().max()))
    assert w.relative == pytest.approx(float(delta.norm() / old_w.double().norm()))
    assert r.tensors_read == 1 and r.bytes_read == 2 * 64 * 32 * 4
    values = {v.path: v for v in r.values}
    assert (values["step"].status, values["step"].old, values["step"].new) == ("changed", "1", "3")
    assert values["name"].status == "removed" and values["name"].old == "'run'"
    assert values["wd"].status == "added" and values["wd"].new == "0.01"
    assert "lr" not in values

    doc = json.loads(json.dumps(r.to_json(), allow_nan=False))  # strict JSON
    assert doc["a"] == 2 and doc["b"] == 3 and doc["identical"] is False
    assert doc["counts"] == {
        "unchanged": 2,
        "changed": 1,
        "added": 1,
        "removed": 1,
        "reshaped": 0,
    }
    row = next(t for t in doc["tensors"] if t["name"] == "model.0.weight")
    assert row["shape"] == [64, 32] and row["changed_elements"] == 2
    assert {v["path"] for v in doc["values"]} == {"step", "name", "wd"}

    html_path = write_diff_html(r, tmp_path / "diff.html")
    page = html_path.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page
    for name in ("model.0.weight", "model.extra", "model.2.bias", "wd"):
        assert name in page
    assert "http://" not in page and "https://" not in page and "<script src" not in page


def test_diff_reshape_dtype_nan_and_escaping(tmp_path: Path) -> None:
    a = {"v": torch.tensor([1.0, float("nan"), 3.0]), "r": torch.zeros(4), "z": torch.zeros(2)}
    a["t"] = torch.arange(6, dtype=torch.int32)
    a["x<script>"] = torch.ones(2)
    b = {"v": torch.tensor([1.0, float("nan"), float("inf")]), "r": torch.zeros(2, 2)}
    b["z"] = torch.tensor([0.0, 1.0])
    b["t"] = torch.arange(6, dtype=torch.int64)
    b["x<script>"] = torch.ones(2) * 2
    with Checkpointer(tmp_path / "ck", OPTS) as ck:
        ck.save(1, a)
        ck.save(2, b)
        r = diff_steps(ck, 1, 2)
    rows = {x.name: x for x in r.tensors}
    assert rows["r"].status == "reshaped" and rows["r"].old_shape == (4,)
    assert rows["v"].status == "changed"
    assert rows["v"].changed_elements == 1 and rows["v"].nonfinite == 1  # NaN == NaN
    assert rows["z"].relative == math.inf  # a was all zeros
    assert rows["t"].status == "changed" and rows["t"].old_dtype == "int32"
    assert rows["t"].changed_elements == 0
    doc = json.loads(json.dumps(r.to_json(), allow_nan=False))
    assert next(t for t in doc["tensors"] if t["name"] == "z")["relative"] == "inf"
    page = write_diff_html(r, tmp_path / "d.html").read_text()
    assert "x&lt;script&gt;" in page and "x<script>" not in page


# -- export --------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path: Path) -> Iterator[tuple[Checkpointer, dict[str, Any]]]:
    m = _model()
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(2, 32)).sum().backward()
    opt.step()
    state = {"model": m.state_dict(), "optim": opt.state_dict(), "step": 7, "arr": np.arange(4)}
    ck = Checkpointer(tmp_path / "ck", OPTS)
    ck.save(7, state, metadata={"run": "r1"})
    yield ck, state
    ck.close()


def test_export_safetensors_round_trip(
    saved: tuple[Checkpointer, dict[str, Any]], tmp_path: Path
) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    ck, state = saved
    out = tmp_path / "model.safetensors"
    r = export_step(ck, out)
    assert r.step == 7 and r.format == "safetensors" and out.stat().st_size == r.bytes
    flat = load_file(out)
    for k, v in state["model"].items():
        assert torch.equal(flat[f"model.{k}"], v)
    assert torch.equal(flat["optim.state.0.exp_avg"], state["optim"]["state"][0]["exp_avg"])
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    assert meta["stalwart.step"] == "7" and json.loads(meta["stalwart.metadata"]) == {"run": "r1"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left

    with pytest.raises(ConfigError, match="already exists"):
        export_step(ck, out)
    out.write_bytes(b"old")
    export_step(ck, out, overwrite=True)
    assert load_file(out).keys() == flat.keys()
    with pytest.raises(ConfigError, match="not supported"):
        export_step(ck, tmp_path / "x.bin", format="onnx")
    with pytest.raises(CheckpointNotFoundError):
        export_step(ck, tmp_path / "y.safetensors", step=8)

    # Import it back: the skeleton in the metadata rebuilds the same tree.
    with Checkpointer(tmp_path / "ck2", OPTS) as ck2:
        res = import_file(out, ck2, step=1)
        assert res.kind == "safetensors" and res.tensors == len(flat)
        back = ck2.load(None, 1)
    assert back["step"] == 7 and isinstance(back["arr"], np.ndarray)
    assert torch.equal(back["model"]["0.weight"], state["model"]["0.weight"])
    assert back["optim"]["param_groups"] == state["optim"]["param_groups"]


def test_export_torch(saved: tuple[Checkpointer, dict[str, Any]], tmp_path: Path) -> None:
    ck, state = saved
    out = tmp_path / "model.pt"
    export_step(ck, out, step=7, format="torch")
    tree = torch.load(out, weights_only=True)
    assert tree["step"] == 7
    assert torch.equal(tree["arr"], torch.arange(4))
    for k, v in state["model"].items():
        assert torch.equal(tree["model"][k], v)
    with pytest.raises(ConfigError, match="overwrite"):
        export_step(ck, out, format="torch")


def test_export_subtree_verifies_only_what_it_exports(
    saved: tuple[Checkpointer, dict[str, Any]], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    ck, state = saved
    moment = next(f for f in ck.manifest(7).tensors if f.startswith("optim.state."))
    pack, offsets = _pack_of(ck, 7, moment)
    with open(tmp_path / "ck" / pack, "r+b") as f:
        f.seek(offsets[0])
        b = f.read(1)
        f.seek(offsets[0])
        f.write(bytes([b[0] ^ 0x40]))  # an optimizer moment rots; the weights are intact
    with pytest.raises(CorruptCheckpointError, match="does not match its hash"):
        export_step(ck, tmp_path / "all.safetensors", step=7)
    r = export_step(ck, tmp_path / "model.safetensors", step=7, subtree="model")
    got = load_file(str(r.path))
    assert r.tensors == len(state["model"]) and set(got) == set(state["model"])
    for k, v in state["model"].items():
        assert torch.equal(got[k], v), k


# -- import --------------------------------------------------------------------------------


def test_import_torch_file(tmp_path: Path) -> None:
    m = _model()
    src = tmp_path / "sd.pt"
    torch.save({"model": m.state_dict(), "epoch": 3}, src)
    with Checkpointer(tmp_path / "ck", OPTS) as ck:
        r = import_file(src, ck, step=5)
        assert r.kind == "torch" and r.tensors == 4
        back = ck.load(None, 5)
        assert ck.manifest(5).metadata["stalwart.source"] == "torch:sd.pt"
        with pytest.raises(ConfigError, match="already exists"):
            import_file(src, ck, step=5)
    assert back["epoch"] == 3
    for k, v in m.state_dict().items():
        assert torch.equal(back["model"][k], v)


def test_import_plain_safetensors_file(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {
        "embed.weight": torch.randn(10, 4),
        "head.bias": torch.zeros(3, dtype=torch.bfloat16),
    }
    save_file(tensors, str(tmp_path / "m.safetensors"))
    with Checkpointer(tmp_path / "ck", OPTS) as ck:
        assert import_file(tmp_path / "m.safetensors", ck, step=0).kind == "safetensors"
        back = ck.load(None, 0)
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert torch.equal(back[k], v) and back[k].dtype == v.dtype


def test_import_dcp_checkpoint(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    m = _model()
    state = {"model": m.state_dict(), "step": 12}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    with Checkpointer(tmp_path / "ck", OPTS) as ck:
        r = import_file(tmp_path / "dcp", ck, step=12)
        back = ck.load(None, 12)
    assert r.kind == "dcp" and r.tensors == 4
    assert back["step"] == 12
    for k, v in m.state_dict().items():
        assert torch.equal(back["model"][k], v)

    # A DCP checkpoint with a truncated data file: a clear error, nothing committed.
    for data_file in (tmp_path / "dcp").glob("*.distcp"):
        os.truncate(data_file, data_file.stat().st_size // 2)
    with Checkpointer(tmp_path / "ck", OPTS) as ck:
        with pytest.raises(CorruptCheckpointError, match="could not be read"):
            import_file(tmp_path / "dcp", ck, step=13)
        assert ck.steps() == [12]


class _Opaque:
    def __init__(self) -> None:
        self.x = 1


def test_import_errors_are_clear(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    ck = Checkpointer(tmp_path / "ck", OPTS)
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        import_file(tmp_path / "nope.pt", ck, step=1)
    (tmp_path / "notes.txt").write_text("hello, not a checkpoint")
    with pytest.raises(ConfigError, match=r"safetensors file, a torch\.save file, or a DCP"):
        import_file(tmp_path / "notes.txt", ck, step=1)
    (tmp_path / "folder").mkdir()
    with pytest.raises(ConfigError, match=r"\.metadata"):
        import_file(tmp_path / "folder", ck, step=1)

    torch.save({"w": torch.randn(256, 256)}, tmp_path / "full.pt")
    data = (tmp_path / "full.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        import_file(tmp_path / "cut.pt", ck, step=1)

    save_file({"w": torch.randn(256, 256)}, str(tmp_path / "full.safetensors"))
    data = (tmp_path / "full.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        import_file(tmp_path / "cut.safetensors", ck, step=1)
    (tmp_path / "head.safetensors").write_bytes(data[:20])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        import_file(tmp_path / "head.safetensors", ck, step=1)

    torch.save({"w": torch.ones(2), "obj": _Opaque()}, tmp_path / "unsafe.pt")
    with pytest.raises(ConfigError, match="Re-save"):
        import_file(tmp_path / "unsafe.pt", ck, step=1)
    assert ck.steps() == []  # nothing was committed by any failed import
    ck.close()
