"""The checkpoint engine on one process: round trips, dedup, retention, GC and bad input."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import stalwart
from stalwart.checkpoint.durable.manifest import Manifest, manifest_key
from stalwart.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    StateMismatchError,
    StorageFullError,
    StoragePermissionError,
    UnsafeManifestError,
    UnsupportedValueError,
)
from stalwart.storage import LocalStorage

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def rich_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "fp32": torch.randn(33, 17, generator=g),
        "fp16": torch.randn(8, 8, generator=g).half(),
        "bf16": torch.randn(5, 3, generator=g).bfloat16(),
        "fp8": {
            "e4m3": torch.randn(16, generator=g).to(torch.float8_e4m3fn),
            "e5m2": torch.randn(16, generator=g).to(torch.float8_e5m2),
        },
        "int8": torch.randint(-128, 127, (7, 9), generator=g, dtype=torch.int8),
        "bool": torch.rand(10, generator=g) > 0.5,
        "int64": torch.arange(12).reshape(3, 4),
        "complex": torch.randn(4, generator=g, dtype=torch.complex64),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(6, 4, generator=g).t(),
        "numpy": np.arange(10, dtype=np.float32),
        "nested": [1, 2.5, None, (3, "a", b"\x00\xff"), {"deep": torch.ones(2)}],
        3: "int key",
        "big": 2**80,
        "nan": math.nan,
        "inf": -math.inf,
        "flag": True,
        "dtype": torch.bfloat16,
    }


def zeros_like_tree(tree):
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree.contiguous()) if tree.numel() else tree.clone()
    if isinstance(tree, np.ndarray):
        return np.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: zeros_like_tree(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(zeros_like_tree(v) for v in tree)
    return tree


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_tree_equal(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(_raw(a), _raw(b))  # bitwise: NaNs and -0.0 count
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_tree_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_tree_equal(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b and type(a) is type(b)


def packs(root: Path) -> list[Path]:
    return sorted((root / "packs").glob("*.pack")) if (root / "packs").exists() else []


def test_round_trip_every_supported_leaf(tmp_path: Path) -> None:
    state = rich_state()
    ckpt = stalwart.Checkpointer(tmp_path)
    ckpt.save(7, state)
    target = zeros_like_tree(state)
    loaded = ckpt.load(target)
    assert_tree_equal(state, loaded)
    # in place: the target's own tensors now hold the data
    assert torch.equal(target["fp32"], state["fp32"])
    assert loaded["fp32"] is target["fp32"]
    assert_tree_equal(state, ckpt.load())  # the consolidated view without a target


def test_manifest_is_json_and_packs_are_raw_tensor_bytes(tmp_path: Path) -> None:
    t = torch.arange(1000, dtype=torch.float32)
    stalwart.Checkpointer(tmp_path).save(1, {"t": t})
    doc = json.loads((tmp_path / manifest_key(1)).read_bytes())
    assert doc["format"] == "stalwart.checkpoint" and doc["version"] == 3
    (pack,) = packs(tmp_path)
    assert pack.read_bytes() == t.numpy().tobytes()  # no pickle, no framing


def test_modules_and_optimizers_are_stateful(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    ckpt = stalwart.Checkpointer(tmp_path)
    ckpt.save(1, {"model": model, "optim": opt})
    model2 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    ckpt.load({"model": model2, "optim": opt2})  # optimizer state is allocated from the file
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)
    assert opt2.param_groups[0]["lr"] == 0.01
    assert torch.equal(
        opt.state_dict()["state"][0]["exp_avg"], opt2.state_dict()["state"][0]["exp_avg"]
    )


def test_identical_second_save_writes_nothing(tmp_path: Path) -> None:
    state = {"w": torch.randn(256, 1024), "b": torch.randn(1024)}
    ckpt = stalwart.Checkpointer(tmp_path)
    first = ckpt.save(1, state)
    second = ckpt.save(2, state)
    assert first.bytes_written == first.bytes_total > 0
    assert second.bytes_written == 0 and second.bytes_reused == second.bytes_total
    assert len(packs(tmp_path)) == 1  # a fully deduplicated save creates no pack


def test_frozen_90_percent_writes_about_10_percent(tmp_path: Path) -> None:
    state = {f"frozen{i}": torch.randn(64, 1024) for i in range(9)} | {
        "head": torch.randn(64, 1024)
    }
    opts = stalwart.CheckpointOptions(chunk_bytes=64 * 1024)
    ckpt = stalwart.Checkpointer(tmp_path, opts)
    ckpt.save(1, state)
    state["head"].add_(1.0)
    r = ckpt.save(2, state)
    assert r.bytes_written == state["head"].numel() * 4
    assert 0.09 < r.bytes_written / r.bytes_total < 0.11
    assert torch.equal(ckpt.load(None, 2)["head"], state["head"])
    assert not torch.equal(ckpt.load(None, 1)["head"], state["head"])


def test_zstd_compression_round_trip_and_smaller(tmp_path: Path) -> None:
    state = {"zeros": torch.zeros(512, 512), "noise": torch.randn(64, 64)}
    ckpt = stalwart.Checkpointer(tmp_path, stalwart.CheckpointOptions(compression="zstd"))
    r = ckpt.save(1, state)
    assert r.bytes_written < r.bytes_total / 4
    assert_tree_equal(state, ckpt.load(None))


def test_steps_latest_and_step_selection(tmp_path: Path) -> None:
    ckpt = stalwart.Checkpointer(tmp_path)
    assert ckpt.steps() == [] and ckpt.latest_step() is None
    for s in (10, 2, 30):
        ckpt.save(s, {"x": torch.tensor(float(s))})
    assert ckpt.steps() == [2, 10, 30] and ckpt.latest_step() == 30
    assert ckpt.load()["x"].item() == 30.0
    assert ckpt.load(None, step=10)["x"].item() == 10.0
    assert ckpt.last_load is not None and ckpt.last_load.step == 10


# -- bad input ---------------------------------------------------------------------------------


def test_root_that_does_not_exist(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    ckpt = stalwart.Checkpointer(missing)
    assert ckpt.steps() == []
    with pytest.raises(CheckpointNotFoundError, match=r"does not exist|no committed checkpoint"):
        ckpt.load({"x": torch.zeros(1)})
    assert not missing.exists()  # reading never creates the root


def test_step_never_committed_lists_the_committed_ones(tmp_path: Path) -> None:
    ckpt = stalwart.Checkpointer(tmp_path)
    ckpt.save(1, {"x": torch.zeros(1)})
    with pytest.raises(CheckpointNotFoundError, match=r"step 5 .*committed steps: \[1\]"):
        ckpt.load(None, step=5)
    assert isinstance(CheckpointNotFoundError("x"), FileNotFoundError)


def test_mismatched_keys_shapes_and_dtypes_are_all_listed(tmp_path: Path) -> None:
    ckpt = stalwart.Checkpointer(tmp_path)
    ckpt.save(1, {"a": torch.ones(3), "b": torch.ones(2, 2), "c": torch.ones(4)})
    target = {
        "a": torch.zeros(3),
        "b": torch.zeros(3, 2),
        "c": torch.zeros(4, dtype=torch.float16),
        "d": torch.zeros(1),
    }
    with pytest.raises(StateMismatchError) as info:
        ckpt.load(target)
    msg = str(info.value)
    assert "b: shape [3, 2] in the state, [2, 2]" in msg
    assert "c: dtype float16" in msg and "d: in the state but not in the checkpoint" in msg
    assert "strict=False" in msg
    assert torch.equal(target["a"], torch.zeros(3))  # nothing was touched
    ckpt.load(target, strict=False)
    assert torch.equal(target["a"], torch.ones(3)) and torch.equal(target["b"], torch.zeros(3, 2))
    assert ckpt.last_load is not None and len(ckpt.last_load.mismatched) == 3


class Opaque:
    pass


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"x": Opaque()}, "Opaque"),
        ({"x": {Opaque()}}, "Opaque"),  # sets are stored now; their members must be too
        ({(1, 2): torch.ones(1)}, "dict key"),
        ({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, "same name 'a.b'"),
        ({"n": 10**5000}, r"int at 'n' has more than \d+ digits.*as bytes"),
    ],
)
def test_unsupported_values_are_refused_before_writing(tmp_path: Path, bad, match: str) -> None:
    ckpt = stalwart.Checkpointer(tmp_path)
    with pytest.raises(UnsupportedValueError, match=match):
        ckpt.save(1, bad)
    assert ckpt.steps() == [] and packs(tmp_path) == []


def test_invalid_arguments(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        stalwart.CheckpointOptions(chunk_bytes=10)
    with pytest.raises(ConfigError):
        stalwart.CheckpointOptions(compression="lz4")
    with pytest.raises(ConfigError):
        stalwart.KeepLast(0)
    with pytest.raises(ConfigError):
        stalwart.Checkpointer(tmp_path).save(-1, {})


# -- integrity ---------------------------------------------------------------------------------


def _two_steps(root: Path) -> stalwart.Checkpointer:
    ckpt = stalwart.Checkpointer(root, stalwart.CheckpointOptions(chunk_bytes=4096))
    ckpt.save(1, {"w": torch.full((4096,), 1.0), "keep": torch.arange(10)})
    ckpt.save(2, {"w": torch.full((4096,), 2.0), "keep": torch.arange(10)})
    return ckpt


def _newest_pack(root: Path) -> Path:
    return max(packs(root), key=lambda p: p.name)


def test_flipped_byte_is_detected_and_named(tmp_path: Path) -> None:
    ckpt = _two_steps(tmp_path)
    pack = _newest_pack(tmp_path)
    data = bytearray(pack.read_bytes())
    data[100] ^= 0x10  # identical chunks dedup within a save: the pack is one chunk
    pack.write_bytes(bytes(data))
    target = {"w": torch.zeros(4096), "keep": torch.zeros(10, dtype=torch.int64)}
    with pytest.raises(CorruptCheckpointError) as info:
        ckpt.load(target)
    msg = str(info.value)
    assert "step 2" in msg and "'w'" in msg and "offsets [0]" in msg and pack.name in msg
    assert "fallback=True" in msg
    ckpt.load(target, fallback=True)
    assert torch.equal(target["w"], torch.full((4096,), 1.0))
    assert ckpt.last_load is not None and ckpt.last_load.step == 1
    assert ckpt.last_load.skipped and ckpt.last_load.skipped[0][0] == 2


def test_truncated_and_missing_packs_are_detected(tmp_path: Path) -> None:
    ckpt = _two_steps(tmp_path)
    pack = _newest_pack(tmp_path)
    pack.write_bytes(pack.read_bytes()[:-100])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        ckpt.load(None)
    pack.unlink()
    with pytest.raises(CorruptCheckpointError, match="pack file is missing"):
        ckpt.load(None)
    assert ckpt.load(None, fallback=True)["w"][0].item() == 1.0


def test_damaged_manifest_falls_back(tmp_path: Path) -> None:
    ckpt = _two_steps(tmp_path)
    (tmp_path / manifest_key(2)).write_bytes(b'{"format": "stalwart.checkpoint", "vers')
    fresh = stalwart.Checkpointer(tmp_path)
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        fresh.load(None)
    assert fresh.load(None, fallback=True)["w"][0].item() == 1.0
    del ckpt


def test_all_damaged_raises_with_every_reason(tmp_path: Path) -> None:
    _two_steps(tmp_path)
    for p in packs(tmp_path):
        p.unlink()
    with pytest.raises(CorruptCheckpointError, match=r"no checkpoint .* verifies") as info:
        stalwart.Checkpointer(tmp_path).load(None, fallback=True)
    assert len(info.value.damaged) == 2


@pytest.mark.parametrize("pack", ["../../etc/passwd", "/etc/passwd", "s3://bucket/x", "packs/../x"])
def test_manifest_cannot_point_outside_the_store(tmp_path: Path, pack: str) -> None:
    ckpt = stalwart.Checkpointer(tmp_path)
    ckpt.save(1, {"x": torch.ones(4)})
    path = tmp_path / manifest_key(1)
    doc = json.loads(path.read_bytes())
    doc["tensors"]["x"]["shards"][0]["chunks"][0][2] = pack
    path.write_text(json.dumps(doc))
    with pytest.raises(UnsafeManifestError):
        stalwart.Checkpointer(tmp_path).load(None)


def test_unknown_format_version_says_upgrade(tmp_path: Path) -> None:
    stalwart.Checkpointer(tmp_path).save(1, {"x": torch.ones(1)})
    path = tmp_path / manifest_key(1)
    doc = json.loads(path.read_bytes())
    doc["version"] = 99
    path.write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError, match="upgrade stalwart"):
        stalwart.Checkpointer(tmp_path).load(None)


# -- retention and garbage collection ----------------------------------------------------------


def test_keep_last_deletes_old_steps_and_their_packs(tmp_path: Path) -> None:
    opts = stalwart.CheckpointOptions(
        keep=stalwart.AnyOf(stalwart.KeepLast(2), stalwart.KeepEvery(4))
    )
    ckpt = stalwart.Checkpointer(tmp_path, opts)
    shared = torch.randn(1000)
    for s in range(1, 7):
        ckpt.save(s, {"shared": shared, "own": torch.full((1000,), float(s))})
    assert ckpt.steps() == [4, 5, 6]
    referenced = set().union(*(ckpt.manifest(s).packs() for s in ckpt.steps()))
    assert {f"packs/{p.name}" for p in packs(tmp_path)} == referenced
    for s in ckpt.steps():  # the shared chunk lived in step 1's pack, which must survive
        loaded = ckpt.load(None, s)
        assert torch.equal(loaded["shared"], shared) and loaded["own"][0].item() == s


def test_gc_removes_orphans_only_after_grace_and_respects_leases(tmp_path: Path) -> None:
    ckpt = stalwart.Checkpointer(tmp_path)
    ckpt.save(1, {"x": torch.ones(10)})
    orphan = tmp_path / "packs" / "step-00000000000000000002-rank00000-deadbeef0000.pack"
    orphan.write_bytes(b"left by a crashed save")
    assert ckpt.gc().deleted_packs == []  # too young: a save may still be in flight
    old = time.time() - 7200
    os.utime(orphan, (old, old))
    store = LocalStorage(tmp_path)
    from stalwart.checkpoint.durable.lease import Lease

    with Lease(store, steps=[], packs=[f"packs/{orphan.name}"], lease_s=60):
        assert ckpt.gc().deleted_packs == []
    report = ckpt.gc()
    assert report.deleted_packs == [f"packs/{orphan.name}"] and report.bytes_freed == 22
    assert torch.equal(ckpt.load(None)["x"], torch.ones(10))
    assert list((tmp_path / "leases").iterdir()) == []


def test_gc_with_a_damaged_manifest_deletes_nothing(tmp_path: Path) -> None:
    ckpt = _two_steps(tmp_path)
    (tmp_path / manifest_key(1)).write_text("garbage")
    before = packs(tmp_path)
    with pytest.raises(CorruptCheckpointError, match=r"deleted nothing|without deleting"):
        stalwart.Checkpointer(tmp_path).gc(grace_s=0)
    assert packs(tmp_path) == before
    del ckpt


# -- real storage failures ---------------------------------------------------------------------


def test_full_disk_fails_cleanly_and_keeps_earlier_checkpoints(
    tmpfs: Callable[[str], Path],
) -> None:
    root = tmpfs("size=2m")
    ckpt = stalwart.Checkpointer(root)
    ckpt.save(1, {"x": torch.ones(1000)})
    with pytest.raises(StorageFullError, match="no space left"):
        ckpt.save(2, {"x": torch.randn(2 * MiB // 4 + 1000)})
    assert ckpt.steps() == [1]
    assert torch.equal(stalwart.Checkpointer(root).load(None)["x"], torch.ones(1000))
    assert not [p for p in root.rglob("*") if p.name.startswith(".tmp-")]


def test_read_only_location_says_so(tmpfs: Callable[[str], Path]) -> None:
    root = tmpfs("size=1m,ro")
    with pytest.raises(StoragePermissionError, match="read-only or not writable"):
        stalwart.Checkpointer(root).save(1, {"x": torch.ones(3)})


def test_s3_round_trip_dedup_and_corruption(s3_server, s3_bucket: str) -> None:
    url = f"s3://{s3_bucket}/runs/exp1"
    opts = s3_server.storage_options
    ckpt = stalwart.Checkpointer(url, storage_options=opts)
    state = {"w": torch.randn(300, 300), "step": 3}
    ckpt.save(1, state)
    assert ckpt.save(2, state).bytes_written == 0
    fresh = stalwart.Checkpointer(url, storage_options=opts)
    assert fresh.steps() == [1, 2]
    target = {"w": torch.zeros(300, 300), "step": 0}
    assert fresh.load(target)["step"] == 3 and torch.equal(target["w"], state["w"])
    import s3fs

    fs = s3fs.S3FileSystem(**opts)
    (pack,) = fs.find(f"{s3_bucket}/runs/exp1/packs")
    data = bytearray(fs.cat_file(pack))
    data[100] ^= 1
    fs.pipe_file(pack, bytes(data))
    with pytest.raises(CorruptCheckpointError, match="does not match its hash"):
        stalwart.Checkpointer(url, storage_options=opts).load(target)


def test_manifest_parser_never_fails_unexpectedly(tmp_path: Path) -> None:
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st

    stalwart.Checkpointer(tmp_path).save(1, rich_state())
    good = (tmp_path / manifest_key(1)).read_bytes()

    @hypothesis.settings(max_examples=300, deadline=None)
    @hypothesis.given(st.integers(0, len(good) - 1), st.binary(min_size=1, max_size=8))
    def mutate(pos: int, junk: bytes) -> None:
        data = good[:pos] + junk + good[pos + len(junk) :]
        with contextlib.suppress(CorruptCheckpointError):  # anything else fails the test
            Manifest.from_bytes(data)

    mutate()


def test_a_read_only_checkpoint_still_loads(tmp_path: Path, tmpfs: Callable[[str], Path]) -> None:
    root = tmpfs("size=4m")
    stalwart.Checkpointer(root).save(1, {"x": torch.arange(5)})
    import subprocess

    subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
    assert torch.equal(stalwart.Checkpointer(root).load(None)["x"], torch.arange(5))


def test_a_module_missing_keys_is_refused_by_the_module_itself(tmp_path: Path) -> None:
    ckpt = stalwart.Checkpointer(tmp_path)
    ckpt.save(1, {"model": torch.nn.Linear(3, 3, bias=False)})
    model = torch.nn.Linear(3, 3)  # has a bias the checkpoint lacks
    refused = r"(?s)model: Linear.load_state_dict refused .*bias"
    with pytest.raises(StateMismatchError, match=refused):
        ckpt.load({"model": model})
    ckpt.load({"model": model}, strict=False)  # loads the weight, keeps its own bias
    assert torch.equal(model.weight, ckpt.load(None)["model"]["weight"])


def test_verify_reports_every_damaged_chunk(tmp_path: Path) -> None:
    ckpt = stalwart.Checkpointer(tmp_path, stalwart.CheckpointOptions(chunk_bytes=4096))
    ckpt.save(1, {"a": torch.randn(4096), "b": torch.randn(4096)})
    assert ckpt.verify().ok
    (pack,) = packs(tmp_path)
    data = bytearray(pack.read_bytes())
    data[10] ^= 1  # in tensor a
    data[-10] ^= 1  # in tensor b
    pack.write_bytes(bytes(data))
    report = ckpt.verify(1)
    assert not report.ok and len(report.damaged) == 2
    assert any("'a'" in d for d in report.damaged) and any("'b'" in d for d in report.damaged)


def test_unchanged_chunks_skip_the_strong_hash(tmp_path: Path, monkeypatch) -> None:
    from stalwart.checkpoint.durable import persist

    hashed: list[int] = []
    real = persist.chunk_hash

    def counting(data) -> str:
        hashed.append(len(data))
        return real(data)

    monkeypatch.setattr(persist, "chunk_hash", counting)
    opts = stalwart.CheckpointOptions(chunk_bytes=64 * 1024)
    ckpt = stalwart.Checkpointer(tmp_path, opts)
    state = {"frozen": torch.randn(256, 1024), "head": torch.randn(16, 1024)}
    ckpt.save(1, state)
    hashed.clear()
    state["head"][0, 0] += 1  # one chunk of the head changes
    r = ckpt.save(2, state)
    assert hashed == [64 * 1024]  # only the changed chunk got a BLAKE3 hash
    assert r.bytes_written == 64 * 1024
    assert torch.equal(stalwart.Checkpointer(tmp_path).load(None)["head"], state["head"])
