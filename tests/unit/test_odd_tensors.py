"""Tensors that are not plain memory: lazy conjugation, expanded targets, shared memory.

Conjugated and negated views are saved as the values they stand for; an expanded target is
refused before any byte is written; leaves that share memory come back sharing it on a load
without a target (the manifest's ``aliases``), and a manifest whose records disagree with
its bytes or whose skeleton leaf names another tensor's entry is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import blake3
import pytest
import torch

import stalwart
from stalwart.checkpoint.durable.aliases import TensorAlias, share_aliases
from stalwart.checkpoint.durable.manifest import Manifest, manifest_key
from stalwart.errors import CorruptCheckpointError, StateMismatchError


def _reseal(path: Path, edit: object) -> None:
    """Edit the manifest at ``path`` with ``edit(doc)`` and recompute its checksum."""
    doc = json.loads(path.read_bytes())
    del doc["checksum"]
    edit(doc)  # type: ignore[operator]
    body = json.dumps(doc, separators=(",", ":")).encode()
    path.write_bytes(
        body[:-1] + b',"checksum":"' + blake3.blake3(body).hexdigest().encode() + b'"}'
    )


def test_conjugated_and_negated_views_round_trip_as_their_values(tmp_path: Path) -> None:
    c = torch.randn(3, dtype=torch.complex64)
    n = torch.arange(4.0)
    state = {"conj": c.conj(), "neg": torch._neg_view(n), "conj_neg": c.conj().imag}
    with stalwart.Checkpointer(tmp_path) as ck:
        ck.save(1, state)
        out = ck.load(None)
        assert torch.equal(out["conj"], c.conj().resolve_conj())
        assert not out["conj"].is_conj()
        assert torch.equal(out["neg"], -n)
        assert torch.equal(out["conj_neg"], -c.imag)
        target = {k: torch.zeros_like(v.resolve_conj().resolve_neg()) for k, v in state.items()}
        ck.load(target)
        assert torch.equal(target["conj"], c.conj().resolve_conj())


def test_an_expanded_target_is_refused_before_any_byte_is_written(tmp_path: Path) -> None:
    with stalwart.Checkpointer(tmp_path) as ck:
        ck.save(1, {"a": torch.ones(3), "x": torch.arange(10.0).reshape(5, 2)})
        a = torch.zeros(3)
        with pytest.raises(StateMismatchError, match="expanded or overlapping view") as info:
            ck.load({"a": a, "x": torch.zeros(2).expand(5, 2)})
        assert "contiguous" in str(info.value)
        assert torch.equal(a, torch.zeros(3))  # nothing was read into the other target
        strided = torch.zeros(5, 4)[:, ::2]  # strided but not overlapping: loads
        ck.load({"a": a, "x": strided})
        assert torch.equal(strided, torch.arange(10.0).reshape(5, 2))


def test_shared_memory_is_recorded_and_stored_once(tmp_path: Path) -> None:
    w = torch.randn(4, 3)
    with stalwart.Checkpointer(tmp_path) as ck:
        ck.save(1, {"a": w, "b": w, "view": w[1], "cols": w[:, 1]})
        m = ck.manifest(1)
    assert m.aliases == {
        "b": TensorAlias("a", 0, (3, 1)),
        "view": TensorAlias("a", 3, (1,)),
        "cols": TensorAlias("a", 1, (3,)),
    }
    assert m.tensors["a"].shards[0].chunks == m.tensors["b"].shards[0].chunks  # one copy


def test_a_load_without_target_shares_memory_again(tmp_path: Path) -> None:
    w = torch.randn(4, 3)
    with stalwart.Checkpointer(tmp_path) as ck:
        ck.save(1, {"a": w, "b": w, "view": w[1], "cols": w[:, 1]})
        out = ck.load()
    assert out["a"] is out["b"]
    assert torch.equal(out["a"], w) and torch.equal(out["view"], w[1])
    assert out["view"].untyped_storage().data_ptr() == out["a"].untyped_storage().data_ptr()
    assert out["view"].storage_offset() == 3 and out["cols"].stride() == (3,)
    out["a"][1, 1] = 100.0
    assert out["view"][1] == 100.0 and out["cols"][1] == 100.0 and out["b"][1, 1] == 100.0


def test_share_aliases_refuses_a_record_its_bytes_contradict() -> None:
    base = torch.arange(12.0).reshape(4, 3)
    tensors = {"a": base, "view": base[2].clone(), "same": base.clone()}
    aliases = {"view": TensorAlias("a", 3, (1,)), "same": TensorAlias("a", 0, (3, 1))}
    with pytest.raises(CorruptCheckpointError, match="recorded as a view of 'a'"):
        share_aliases(aliases, tensors, {"a", "view", "same"}, "test")
    tensors = {"a": base, "view": base[1].clone(), "same": base.clone()}
    share_aliases(aliases, tensors, {"a", "view", "same"}, "test")
    assert tensors["same"] is base and tensors["view"].storage_offset() == 3
    kept = {"a": base, "view": base[1].clone()}  # a caller's target keeps its own memory
    share_aliases(aliases, kept, {"a"}, "test")
    assert kept["view"].storage_offset() == 0


@pytest.mark.parametrize(
    "record",
    [
        {"of": "missing", "offset": 0, "strides": [1]},
        {"of": "view", "offset": 0, "strides": [1]},
        {"of": "a", "offset": 10, "strides": [1]},
        {"of": "a", "offset": 0, "strides": [100]},
        {"of": "a", "offset": 0, "strides": [1, 1]},
        {"of": "a", "offset": -1, "strides": [1]},
        {"of": "a", "offset": True, "strides": [1]},
        "not an object",
    ],
)
def test_a_malformed_alias_record_is_refused_at_parse(tmp_path: Path, record: object) -> None:
    w = torch.randn(4, 3)
    with stalwart.Checkpointer(tmp_path) as ck:
        ck.save(1, {"a": w, "view": w[1]})
    path = tmp_path / manifest_key(1)
    _reseal(path, lambda doc: doc.__setitem__("aliases", {"view": record}))
    with pytest.raises(CorruptCheckpointError, match="alias"):
        Manifest.from_bytes(path.read_bytes())


def test_a_skeleton_leaf_naming_another_entry_is_refused_at_parse(tmp_path: Path) -> None:
    with stalwart.Checkpointer(tmp_path) as ck:
        ck.save(1, {"a": torch.ones(3), "b": torch.zeros(3)})
    path = tmp_path / manifest_key(1)

    def point_a_at_b(doc: dict) -> None:  # type: ignore[type-arg]
        for _key, node in doc["skeleton"]["v"]:
            if node["v"] == "a":
                node["v"] = "b"

    _reseal(path, point_a_at_b)
    with pytest.raises(CorruptCheckpointError, match="names the entry of tensor 'b'"):
        Manifest.from_bytes(path.read_bytes())
    with stalwart.Checkpointer(tmp_path) as ck, pytest.raises(CorruptCheckpointError):
        ck.load(None)


def test_odd_keys_still_name_their_own_entries(tmp_path: Path) -> None:
    state = {2: torch.ones(1), True: {None: [torch.zeros(2), (torch.ones(1),)]}, "x.y": 3}
    with stalwart.Checkpointer(tmp_path) as ck:
        ck.save(1, state)
        out = ck.load(None)
    assert torch.equal(out[True][None][0], torch.zeros(2)) and out["x.y"] == 3
    assert torch.equal(out[2], torch.ones(1)) and torch.equal(out[True][None][1][0], torch.ones(1))
