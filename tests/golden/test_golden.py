"""Every released format version's golden checkpoint keeps loading, bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import stalwart
from stalwart.checkpoint.durable.chunk_ref import chunk_check
from stalwart.errors import CorruptCheckpointError
from tests.golden.make_golden import golden_state

HERE = Path(__file__).resolve().parent


def _loads_as_written(version: str) -> stalwart.Checkpointer:
    """The golden root of ``version``: steps 42 and 43, step 42 equal to the golden state."""
    ckpt = stalwart.Checkpointer(HERE / version)
    assert ckpt.steps() == [42, 43]
    expected = golden_state()
    loaded = ckpt.load(None, step=42)
    for k, v in expected["model"].items():
        assert torch.equal(loaded["model"][k], v)
    assert {k: loaded[k] for k in ("step", "lr", "name", "sizes")} == {
        k: expected[k] for k in ("step", "lr", "name", "sizes")
    }
    assert ckpt.load(None)["step"] == 43
    return ckpt


def test_v1_golden_checkpoint_loads() -> None:
    ckpt = _loads_as_written("v1")
    assert ckpt.manifest(42).metadata["written_by"] == "0.1.0"


def test_v2_golden_checkpoint_loads_and_carries_its_checksum() -> None:
    ckpt = _loads_as_written("v2")
    assert all(ckpt.verify(s).ok for s in (42, 43))
    for version in ("v1", "v2"):  # v1 has no manifest checksum; v2 ends with one
        data = (HERE / version / "manifests" / "step-00000000000000000042.json").read_bytes()
        assert (b',"checksum":"' in data[-80:]) == (version == "v2")


def test_v3_golden_checkpoint_loads_and_records_a_check_per_chunk(tmp_path: Path) -> None:
    """Format 3 records each chunk's XXH3-128, which loads check; a flipped bit in a pack is
    still a CorruptCheckpointError, and the audit (verify) checks the BLAKE3 names too."""
    ckpt = _loads_as_written("v3")
    assert all(ckpt.verify(s).ok for s in (42, 43))
    doc = json.loads((HERE / "v3" / "manifests" / "step-00000000000000000042.json").read_bytes())
    assert doc["version"] == 3
    refs = [c for t in doc["tensors"].values() for s in t["shards"] for c in s["chunks"]]
    pack = (HERE / "v3" / refs[0][2]).read_bytes()
    for h, _n, _pack, off, length, codec, check in refs:
        assert codec == "none" and check == chunk_check(pack[off : off + length]), h

    copy = tmp_path / "v3"
    shutil.copytree(HERE / "v3", copy)
    packfile = copy / refs[0][2]
    data = bytearray(packfile.read_bytes())
    data[refs[0][3] + 5] ^= 0x10
    packfile.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="does not match"):
        stalwart.Checkpointer(copy).load(None, step=42)
    assert not stalwart.Checkpointer(copy).verify(42).ok


def test_a_v3_save_deduplicates_against_v2_chunks_and_records_their_checks(
    tmp_path: Path,
) -> None:
    shutil.copytree(HERE / "v2", tmp_path / "root")
    ckpt = stalwart.Checkpointer(tmp_path / "root")
    r = ckpt.save(44, golden_state())
    assert r.bytes_written == 0  # every chunk is a version 2 step's
    doc = json.loads(
        (tmp_path / "root" / "manifests" / "step-00000000000000000044.json").read_text()
    )
    refs = [c for t in doc["tensors"].values() for s in t["shards"] for c in s["chunks"]]
    assert doc["version"] == 3 and refs and all(len(c) == 7 for c in refs)
    loaded = ckpt.load(None, step=44)
    for k, v in golden_state()["model"].items():
        assert torch.equal(loaded["model"][k], v)
    assert ckpt.verify(44).ok and ckpt.verify(42).ok
