"""Erasure codecs, the stripe layout and in-memory snapshots, in one process."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from stalwart.checkpoint.capture import ALIGN_BYTES, HostBuffer
from stalwart.checkpoint.memory.erasure import ErasureGroup
from stalwart.checkpoint.memory.erasure_codec import (
    ReedSolomonCodec,
    StripeLayout,
    XorCodec,
    make_codec,
)
from stalwart.checkpoint.memory.snapshot import Snapshot
from stalwart.errors import ConfigError, CorruptCheckpointError, StateMismatchError

pytestmark = pytest.mark.timeout(60)

# -- codecs ------------------------------------------------------------------------------------


def _stripe(k: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(k)]


CODECS = [
    pytest.param(lambda: XorCodec(4), id="xor-4+1"),
    pytest.param(lambda: XorCodec(1), id="xor-1+1"),
    pytest.param(lambda: ReedSolomonCodec(4, 2), id="rs-4+2-cauchy"),
    pytest.param(lambda: ReedSolomonCodec(3, 2), id="rs-3+2-cauchy"),
    pytest.param(lambda: ReedSolomonCodec(4, 2, "isa_l_rs_vand"), id="rs-4+2-vand"),
    pytest.param(lambda: ReedSolomonCodec(3, 2, "liberasurecode_rs_vand"), id="rs-3+2-libec"),
    pytest.param(lambda: ReedSolomonCodec(4, 1), id="rs-4+1"),
]


@pytest.mark.parametrize("make", CODECS)
@pytest.mark.parametrize("size", [64, 640])
def test_codec_rebuilds_every_combination_of_lost_pieces(make, size: int) -> None:
    codec = make()
    k, m = codec.k, codec.m
    data = _stripe(k, size, seed=size + k)
    parity = [np.empty(size, dtype=np.uint8) for _ in range(m)]
    codec.encode(_stripe(k, size, seed=0), parity)  # RS: the next encode takes the fast path
    meta = codec.encode(data, parity)
    assert len(meta) == codec.meta_nbytes()
    every = data + parity
    for r in range(1, m + 1):
        for lost in itertools.combinations(range(k + m), r):
            have = {i: every[i] for i in range(k + m) if i not in lost}
            got = codec.decode(have, meta, list(lost))
            for i in lost:
                np.testing.assert_array_equal(got[i], every[i], err_msg=f"lost {lost}, piece {i}")


@pytest.mark.parametrize("make", CODECS)
def test_codec_refuses_too_few_pieces(make) -> None:
    codec = make()
    k, m = codec.k, codec.m
    data = _stripe(k, 64, seed=1)
    parity = [np.empty(64, dtype=np.uint8) for _ in range(m)]
    meta = codec.encode(data, parity)
    have = {i: p for i, p in enumerate(data[: k - 1])}
    with pytest.raises(CorruptCheckpointError, match=f"needs {k}"):
        codec.decode(have, meta, [k - 1])


@pytest.mark.parametrize("backend", ["isa_l_rs_cauchy", "isa_l_rs_vand"])
def test_rs_repeat_encodes_match_the_first(backend: str) -> None:
    """Later encodes of the same piece size take pyeclib's reconstruct path: same bytes."""
    first, again = ReedSolomonCodec(3, 2, backend), ReedSolomonCodec(3, 2, backend)
    again.encode(_stripe(3, 192, seed=0), [np.empty(192, dtype=np.uint8) for _ in range(2)])
    data = _stripe(3, 192, seed=1)
    p1 = [np.empty(192, dtype=np.uint8) for _ in range(2)]
    p2 = [np.empty(192, dtype=np.uint8) for _ in range(2)]
    assert first.encode(data, p1) == again.encode(data, p2)
    for a, b in zip(p1, p2, strict=True):
        np.testing.assert_array_equal(a, b)


def test_xor_parity_is_the_xor() -> None:
    data = _stripe(3, 128, seed=7)
    parity = [np.empty(128, dtype=np.uint8)]
    XorCodec(3).encode(data, parity)
    np.testing.assert_array_equal(parity[0], data[0] ^ data[1] ^ data[2])


def test_make_codec() -> None:
    assert isinstance(make_codec("auto", 4, 1), XorCodec)
    rs = make_codec("auto", 4, 2)
    assert isinstance(rs, ReedSolomonCodec) and rs.backend == "isa_l_rs_cauchy"
    assert make_codec("rs:isa_l_rs_vand", 3, 2).backend == "isa_l_rs_vand"  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="m=1"):
        make_codec("xor", 4, 2)
    with pytest.raises(ConfigError, match="unknown codec"):
        make_codec("zfec", 4, 2)
    with pytest.raises(ConfigError, match="pyeclib cannot build"):
        make_codec("rs:no_such_backend", 4, 2)
    with pytest.raises(ConfigError, match="group is 4\\+2"):
        make_codec(XorCodec(4), 4, 2)


# -- layout ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("k", "m"), [(4, 1), (4, 2), (3, 1), (3, 2), (1, 1), (8, 3)])
def test_stripe_layout_properties(k: int, m: int) -> None:
    lay = StripeLayout(k, m)
    n = k + m
    for j in range(n):
        data, parity = lay.data_members(j), lay.parity_holders(j)
        assert len(data) == k and len(parity) == m
        assert sorted(data + parity) == list(range(n)), "every member holds one piece"
        assert lay.encoder(j) in parity
        for i, member in enumerate(lay.members(j)):
            assert lay.piece_index(member, j) == i
    for member in range(n):
        assert len(lay.data_stripes(member)) == k
        assert len(lay.parity_stripes(member)) == m
        assert set(lay.data_stripes(member)).isdisjoint(lay.parity_stripes(member))
    # Losing any m members leaves every stripe with at least k pieces.
    for lost in itertools.combinations(range(n), m):
        for j in range(n):
            assert sum(1 for h in lay.members(j) if h not in lost) >= k


def test_group_config_errors() -> None:
    with pytest.raises(ConfigError, match="k >= 1"):
        StripeLayout(0, 1)
    with pytest.raises(ConfigError, match="multiple of 5"):
        ErasureGroup(4, 1)  # no process group: a world of one


# -- snapshots ---------------------------------------------------------------------------------


class _Box:
    """A minimal stateful object (state_dict / load_state_dict)."""

    def __init__(self, w: torch.Tensor, count: int) -> None:
        self.w, self.count = w, count

    def state_dict(self) -> dict:
        return {"w": self.w, "count": self.count}

    def load_state_dict(self, sd: dict) -> None:
        self.w.copy_(sd["w"])
        self.count = sd["count"]


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "f32": torch.randn(5, 7, generator=g),
        "bf16": torch.randn(3, 3, generator=g).to(torch.bfloat16),
        "i8": torch.randint(-128, 127, (11,), generator=g, dtype=torch.int8),
        "scalar": torch.tensor(float(seed)),
        "empty": torch.empty(0, 4),
        "bool": torch.rand(9, generator=g) > 0.5,
        "f64": torch.randn(2, generator=g, dtype=torch.float64),
        "strided": torch.randn(4, 6, generator=g).t(),
        "nested": [{"x": torch.arange(3, dtype=torch.int64)}, 7, "text"],
        "box": _Box(torch.randn(2, 2, generator=g), seed),
    }


def _assert_state_equal(a: dict, b: dict) -> None:
    for key in ("f32", "bf16", "i8", "scalar", "empty", "bool", "f64", "strided"):
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape
        ab, bb = (t.contiguous().reshape(-1).view(torch.uint8) for t in (a[key], b[key]))
        assert torch.equal(ab, bb), key
    assert torch.equal(a["nested"][0]["x"], b["nested"][0]["x"])
    assert torch.equal(a["box"].w, b["box"].w) and a["box"].count == b["box"].count


def _wipe(state: dict) -> None:
    for key in ("f32", "bf16", "i8", "scalar", "empty", "bool", "f64", "strided"):
        state[key].zero_()
    state["nested"][0]["x"].zero_()
    state["box"].w.zero_()
    state["box"].count = -1


def test_snapshot_capture_restore_bit_exact() -> None:
    state = _state(3)
    snap = Snapshot.capture(state, step=12)
    assert snap.step == 12 and snap.nbytes > 0
    for rec in snap.tensors:
        assert rec.byte_offset % ALIGN_BYTES == 0
    snap.verify()
    _wipe(state)
    tree = snap.restore_into(state)
    _assert_state_equal(state, _state(3))
    assert tree["nested"][1:] == [7, "text"]
    assert tree["box"]["count"] == 3


def test_snapshot_index_round_trip() -> None:
    state = _state(5)
    snap = Snapshot.capture(state, step=2)
    again = Snapshot.from_bytes(snap.to_bytes(), snap.data.clone())
    assert again.digest == snap.digest and again.tensors == snap.tensors
    assert again.skeleton == snap.skeleton
    fresh = _state(99)
    again.restore_into(fresh)
    _assert_state_equal(fresh, _state(5))
    with pytest.raises(CorruptCheckpointError, match="needs a 1-D uint8 blob"):
        Snapshot.from_bytes(snap.to_bytes(), snap.data[:-1].clone())
    with pytest.raises(CorruptCheckpointError, match="malformed snapshot index"):
        Snapshot.from_bytes(b"{not json", snap.data)


def test_snapshot_digest_mismatch_detected() -> None:
    snap = Snapshot.capture(_state(1), step=1)
    snap.data[snap.tensors[0].byte_offset] ^= 0x10
    with pytest.raises(CorruptCheckpointError, match="fails its digest"):
        snap.verify()
    with pytest.raises(CorruptCheckpointError, match="fails its digest"):
        Snapshot.from_bytes(snap.to_bytes(), snap.data)


def test_snapshot_buffer_is_reused_and_stale_snapshots_refuse() -> None:
    buf = HostBuffer()
    first = Snapshot.capture(_state(1), step=1, buffer=buf)
    ptr = buf._data.data_ptr()
    second = Snapshot.capture(_state(2), step=2, buffer=buf)
    assert buf.allocations == 1 and buf._data.data_ptr() == ptr
    second.verify()
    with pytest.raises(CorruptCheckpointError, match="overwritten"):
        first.verify()
    with pytest.raises(CorruptCheckpointError, match="overwritten"):
        first.restore_into(_state(1))
    bigger = _state(3)
    bigger["more"] = torch.ones(10_000)
    Snapshot.capture(bigger, step=3, buffer=buf).verify()
    assert buf.allocations == 2 and buf.capacity >= 40_000


def test_snapshot_digest_ignores_stale_padding() -> None:
    buf = HostBuffer(1 << 16)
    buf._data.fill_(0xAB)  # stale bytes where alignment gaps will be
    a = Snapshot.capture(_state(4), step=1, buffer=buf)
    b = Snapshot.capture(_state(4), step=1)
    assert a.digest == b.digest


def test_snapshot_restore_refuses_other_layout() -> None:
    snap = Snapshot.capture(_state(1), step=1)
    other = _state(1)
    other["f32"] = torch.zeros(5, 8)
    with pytest.raises(StateMismatchError, match="f32"):
        snap.restore_into(other)
