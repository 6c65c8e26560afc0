"""Bounded staging (``CheckpointOptions(max_staging_bytes=...)``): real saves on tmp dirs.

A capped ``save_async`` stages the state window by window through one buffer that never
grows past the cap (read from the buffer pool's own allocation counters, not from timings),
writes the exact bytes (loaded back bit for bit), cuts the same chunks as an unbounded save
(a second save of the same state writes nothing), and never reads the state after it returns.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

import stalwart
from stalwart.checkpoint.buffer_pool import HOST_BUFFERS
from stalwart.checkpoint.durable.plan import LocalItem
from stalwart.checkpoint.durable.staging import plan_windows
from stalwart.checkpoint.options import CheckpointOptions
from stalwart.errors import ConfigError

CHUNK = 64 << 10
CAP = 256 << 10


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(300, 1000, generator=g),  # 1.2 MB: split over several windows
        "mid": torch.randn(150, 1000, generator=g),  # 600 KB: larger than the cap too
        "bf16": torch.randn(7, 333, generator=g).to(torch.bfloat16),  # odd size, unaligned
        "small": torch.randn(5, generator=g),
        "empty": torch.empty(0, 4),
        "ints": torch.arange(1000, dtype=torch.int64) * seed,
        "transposed": torch.randn(200, 300, generator=g).t(),  # not contiguous
    }


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )


def _zeros(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def test_a_capped_save_stays_under_the_cap_and_loads_bit_exact(tmp_path: Path) -> None:
    opts = CheckpointOptions(chunk_bytes=CHUNK, max_staging_bytes=CAP)
    state = _state(1)
    total = sum(v.numel() * v.element_size() for v in state.values())
    assert total > 5 * CAP
    made = HOST_BUFFERS.made
    with stalwart.Checkpointer(tmp_path / "capped", opts) as ck:
        pending = ck.save_async(1, state)
        assert pending.wait_staged(0)  # returned only once every window was copied
        result = pending.wait()
        buf = pending.slot
        assert buf is not None
        # The pool made one buffer for this root, and every allocation into it, summed,
        # stayed within the cap: peak staging memory <= cap.
        assert HOST_BUFFERS.made == made + 1
        assert 0 < buf.allocated_bytes <= CAP and buf.capacity <= CAP
        m = ck.manifest(1)
        packs = {c.pack for c in m.chunks()}
        assert len(packs) >= total // CAP  # one pack per window
        assert result.bytes_total == total
        back = _zeros(state)
        ck.load(back, step=1)
    assert _equal(back, state)


def test_windows_cut_the_same_chunks_as_an_unbounded_save(tmp_path: Path) -> None:
    state = _state(2)
    with stalwart.Checkpointer(tmp_path, CheckpointOptions(chunk_bytes=CHUNK)) as ck:
        ck.save_async(1, state).wait()
    capped = CheckpointOptions(chunk_bytes=CHUNK, max_staging_bytes=CAP)
    with stalwart.Checkpointer(tmp_path, capped) as ck:
        again = ck.save_async(2, state).wait()
        assert again.bytes_written == 0  # every chunk deduplicated against step 1
        for name in state:
            one = [[c.hash for c in s.chunks] for s in ck.manifest(1).tensors[name].shards]
            two = [[c.hash for c in s.chunks] for s in ck.manifest(2).tensors[name].shards]
            assert one == two, name
        assert len(ck.manifest(2).tensors["big"].shards[0].chunks) == -(-1_200_000 // CHUNK)


def test_the_state_is_not_read_after_the_call_returns(tmp_path: Path) -> None:
    opts = CheckpointOptions(chunk_bytes=CHUNK, max_staging_bytes=CAP)
    state = _state(3)
    want = {k: v.clone() for k, v in state.items()}
    with stalwart.Checkpointer(tmp_path, opts) as ck:
        pending = ck.save_async(1, state)
        for v in state.values():  # training goes on at once, overwriting everything
            v.fill_(7) if v.dtype != torch.bool else None
        pending.wait()
        back = _zeros(want)
        ck.load(back, step=1)
    assert _equal(back, want)


def test_windows_never_exceed_the_cap_and_cover_every_byte_once() -> None:
    tensors = [torch.empty(n, dtype=torch.uint8) for n in (0, 10, CHUNK * 3 + 5, 1, CAP, 70)]
    items = [LocalItem(f"t{i}", "uint8", (t.numel(),), (0,), (t.numel(),), t) for i, t in
             enumerate(tensors)]  # fmt: skip
    windows = plan_windows(items, CAP, CHUNK)
    covered: dict[str, list[tuple[int, int]]] = {}
    for w in windows:
        assert max(p.offset + p.stop - p.start for p in w) <= CAP
        assert all(p.offset % 64 == 0 and p.start % CHUNK == 0 for p in w)
        for p in w:
            covered.setdefault(p.item.fqn, []).append((p.start, p.stop))
    for it in items:
        spans = covered[it.fqn]
        assert spans[0][0] == 0 and spans[-1][1] == it.nbytes
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert len(windows) > 1


@pytest.mark.parametrize("bad", [0, -1, CHUNK - 1, True, 1.5, "256M"])
def test_a_bad_cap_is_refused_with_the_fix(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"max_staging_bytes=.*int >= chunk_bytes"):
        CheckpointOptions(chunk_bytes=CHUNK, max_staging_bytes=bad)  # type: ignore[arg-type]


def test_a_window_that_fails_to_write_releases_the_caller_and_surfaces(tmp_path: Path) -> None:
    from stalwart.errors import StorageFullError
    from stalwart.storage.local import LocalStorage
    from stalwart.testing import FlakyStorage

    writes = {"n": 0}

    def second_pack(op: str, key: str) -> bool:  # the second window's pack of step 2 fails
        if op == "write" and key.startswith("packs/step-00000000000000000002"):
            writes["n"] += 1
            return writes["n"] == 2
        return False

    store = FlakyStorage(LocalStorage(tmp_path), fail_on=second_pack, error=StorageFullError)
    opts = CheckpointOptions(chunk_bytes=CHUNK, max_staging_bytes=CAP)
    ck = stalwart.Checkpointer(store, opts)
    ck.save_async(1, _state(4)).wait()
    pending = ck.save_async(2, _state(5))  # returns: it does not wait for windows never staged
    with pytest.raises(StorageFullError):
        pending.wait()
    assert ck.steps() == [1]
    back = _zeros(_state(4))
    ck.load(back)
    assert _equal(back, _state(4))
    ck.save_async(3, _state(6)).wait()  # the buffer went back: the next save goes on
    assert ck.steps() == [1, 3]
    ck.close()
