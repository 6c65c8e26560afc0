"""Replicated boxes are read once by the group and broadcast, every chunk still verified.

Real gloo worlds (``run_ranks``) on real tmp dirs and a moto S3 server: the bytes the
ranks read add up to the checkpoint's unique bytes (not once per rank), values come back
exactly, and a flipped bit is found by the rank that read it, named to the others, and
skipped together by fallback. By default (``SHARED_READS = None``) an S3 store shares and a
local disk reads rank by rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stalwart.checkpoint import Checkpointer
from stalwart.testing import run_ranks
from stalwart.testing.s3_server import S3Server

from . import shared_load_ranks as ranks

pytestmark = pytest.mark.timeout(180)


def _shm_segments() -> set[Path]:
    """This host's shared-read segments now (other processes' too: compare before and after)."""
    return set(Path("/dev/shm").glob("stalwart-load-*"))


def _unique_bytes(
    root: Path | str, step: int, storage_options: dict[str, Any] | None = None
) -> int:
    m = Checkpointer(root, storage_options=storage_options).manifest(step)
    chunks = {
        (c.pack, c.offset): c.length for e in m.tensors.values() for s in e.shards for c in s.chunks
    }
    return sum(chunks.values())


@pytest.mark.parametrize(("world", "shm"), [(2, True), (3, True), (2, False), (3, False)])
def test_replicated_load_reads_each_byte_once_per_node(
    tmp_path: Path, world: int, shm: bool
) -> None:
    """Through /dev/shm files (one host) or gloo broadcasts: values exact, bytes once."""
    root = tmp_path / "ckpt"
    read = run_ranks(ranks.save_then_load, world, str(root), True, shm, timeout_s=120)
    unique = _unique_bytes(root, 1)
    assert sum(read) <= 1.05 * unique, (read, unique)
    assert sum(read) >= unique  # every chunk read by some rank
    assert sum(1 for r in read if r > 0) >= 2  # the reads are spread over ranks


def test_solo_reads_read_everything_on_every_rank(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    read = run_ranks(ranks.save_then_load, 2, str(root), False, timeout_s=120)
    assert read == [_unique_bytes(root, 1)] * 2


@pytest.mark.parametrize("world", [2, 3])
def test_remote_store_shares_reads_by_default(
    s3_server: S3Server, s3_bucket: str, world: int
) -> None:
    """S3 (moto over HTTP): by default each replicated byte is fetched once by the group."""
    url, opts = f"s3://{s3_bucket}/job", s3_server.storage_options
    read = run_ranks(ranks.save_then_load, world, url, None, True, opts, timeout_s=120)
    unique = _unique_bytes(url, 1, opts)
    assert unique <= sum(read) <= 1.05 * unique, (read, unique)
    assert sum(1 for r in read if r > 0) >= 2  # the reads are spread over ranks


def test_remote_store_forced_solo_reads_everything_on_every_rank(
    s3_server: S3Server, s3_bucket: str
) -> None:
    url, opts = f"s3://{s3_bucket}/job", s3_server.storage_options
    read = run_ranks(ranks.save_then_load, 2, url, False, True, opts, timeout_s=120)
    assert read == [_unique_bytes(url, 1, opts)] * 2


def test_local_root_reads_rank_by_rank_by_default(tmp_path: Path) -> None:
    """A local disk: the page cache reads each byte once, so each rank reads alone."""
    root = tmp_path / "ckpt"
    read = run_ranks(ranks.save_then_load, 2, str(root), None, timeout_s=120)
    assert read == [_unique_bytes(root, 1)] * 2


def test_a_load_that_will_not_share_spends_no_collective_planning_it(tmp_path: Path) -> None:
    """Whether the ranks share is settled with the listing: on a local root by default (or
    with sharing off) a load runs three small collectives and no object gather: rank 0's
    listing broadcast, the count of ranks that would share, the count of ranks that loaded;
    forced on, the plan's exchange (object gathers) comes on top."""
    alone = run_ranks(ranks.collectives_of_a_load, 2, str(tmp_path / "a"), None, timeout_s=120)
    off = run_ranks(ranks.collectives_of_a_load, 2, str(tmp_path / "b"), False, timeout_s=120)
    forced = run_ranks(ranks.collectives_of_a_load, 2, str(tmp_path / "c"), True, timeout_s=120)
    three = {"broadcast_object_list": 1, "all_reduce": 2}
    assert alone == off == [{**dict.fromkeys(alone[0], 0), **three}] * 2
    assert forced[0] == forced[1] and forced[0]["all_gather_object"] > 0


def test_no_room_in_shm_on_one_rank_sends_every_rank_back_to_reading_alone(
    tmp_path: Path,
) -> None:
    """Shared reads on one host, and rank 1 may not make files past a few KiB
    (``RLIMIT_FSIZE``, enforced by the kernel): its /dev/shm segment cannot be made, and every
    rank reads everything itself, values exact."""
    root = tmp_path / "ckpt"
    before = _shm_segments()
    read = run_ranks(ranks.save_then_load_capped, 2, str(root), timeout_s=120)
    assert read == [_unique_bytes(root, 1)] * 2
    assert _shm_segments() <= before


def test_flipped_bit_in_a_shared_box_is_named_on_every_rank(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    before = _shm_segments()
    run_ranks(ranks.save_versions, 2, str(root), timeout_s=120)
    m = Checkpointer(root).manifest(2)
    chunk = m.tensors["big"].shards[0].chunks[-1]
    assert chunk.pack not in Checkpointer(root).manifest(1).packs()
    pack = root / chunk.pack
    data = bytearray(pack.read_bytes())
    data[chunk.offset + 5] ^= 0x10
    pack.write_bytes(bytes(data))

    results = run_ranks(ranks.load_damaged, 2, str(root), timeout_s=120)
    kinds = sorted(k for k, _, _ in results)
    # The rank that read the chunk raises CorruptCheckpointError; the other is told.
    assert kinds == ["CorruptCheckpointError", "DistributedError"]
    for _, msg, _ in results:
        assert "'big'" in msg and "shard at offsets" in msg and chunk.hash[:16] in msg
        assert "does not match its hash" in msg
    assert _shm_segments() <= before  # nothing left behind
    assert [s for _, _, s in results] == [1, 1]  # fallback: both load step 1 together
