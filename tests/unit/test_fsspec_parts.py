"""Large objects on S3 go up in parts (multipart upload), atomically, against a real S3 server.

A pack is a rank's whole share of a save: one PUT of the joined buffers held it twice in
memory and could not pass S3's 5 GB limit for one PUT. Above ``STREAM_BYTES`` the object is
uploaded in parts; a failure aborts the upload, so no object (or the old one) is seen.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import stalwart
import stalwart.storage.fsspec_storage as fsspec_storage
from stalwart.errors import ObjectNotFoundError, StorageError
from stalwart.storage.fsspec_storage import FsspecStorage
from stalwart.testing.s3_server import S3Server

PART = 5 << 20  # S3's smallest part


@pytest.fixture
def store(s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> FsspecStorage:
    monkeypatch.setattr(fsspec_storage, "STREAM_BYTES", PART)
    return FsspecStorage(f"s3://{s3_bucket}/ckpt", storage_options=s3_server.storage_options)


def _pieces(n: int, size: int = 3 << 20) -> list[bytes]:
    return [bytes([i % 251]) * size for i in range(n)]


def _root(store: FsspecStorage) -> str:
    """``bucket/prefix`` of an ``s3://`` store."""
    return store.url.removeprefix("s3://").rstrip("/")


def _etag(store: FsspecStorage, key: str) -> str:
    store.fs.invalidate_cache()
    return str(store.fs.info(f"{_root(store)}/{key}")["ETag"]).strip('"')


def _uploads_in_progress(store: FsspecStorage) -> list[object]:
    bucket = _root(store).split("/", 1)[0]
    return list(store.fs.list_multipart_uploads(bucket))


def _failing(pieces: list[bytes], after: int) -> Iterator[bytes]:
    yield from pieces[:after]
    raise RuntimeError("producer died")


def test_a_large_object_goes_up_in_parts_and_reads_back(store: FsspecStorage) -> None:
    pieces = _pieces(5)  # 15 MiB: parts of 5 MiB
    assert store.write("packs/big.pack", pieces) == 15 << 20
    assert store.read("packs/big.pack") == b"".join(pieces)
    assert _etag(store, "packs/big.pack").endswith("-3")  # S3 names a multipart object's parts
    assert store.write("small", [b"x" * 1000]) == 1000
    assert "-" not in _etag(store, "small")  # one PUT below the threshold
    assert not _uploads_in_progress(store)


def test_a_failed_upload_in_parts_keeps_the_old_object_and_leaves_no_upload(
    store: FsspecStorage,
) -> None:
    store.write("k", [b"old"])
    with pytest.raises(RuntimeError, match="producer died"):
        store.write("k", _failing(_pieces(6), after=4))  # 12 MiB sent: 2 parts uploaded
    assert store.read("k") == b"old"
    assert not _uploads_in_progress(store)  # the multipart upload was aborted
    with pytest.raises(RuntimeError, match="producer died"):
        store.write("new", _failing(_pieces(6), after=4))
    with pytest.raises(ObjectNotFoundError):
        store.read("new")
    assert not _uploads_in_progress(store)


def test_a_checkpoint_larger_than_a_part_saves_and_loads_exactly(
    s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fsspec_storage, "STREAM_BYTES", PART)
    url = f"s3://{s3_bucket}/run"
    opts = stalwart.CheckpointOptions(chunk_bytes=1 << 20)
    g = torch.Generator().manual_seed(3)
    state = {"w": torch.randn(4 << 20, generator=g), "b": torch.randn(1000, generator=g)}
    with stalwart.Checkpointer(url, opts, storage_options=s3_server.storage_options) as ck:
        ck.save(1, state)  # a 16 MiB pack: 4 parts
        packs = [i for i in ck.storage.list("packs/")]
        assert len(packs) == 1 and packs[0].size > 3 * PART
        assert _etag(ck.storage, packs[0].key).endswith("-4")  # type: ignore[arg-type]
        back = ck.load(None, 1)
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])


def test_a_store_failure_between_parts_raises_a_storage_error_and_keeps_the_old_object(
    s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store loses the upload after two parts (its uploads aborted from outside): the next
    part fails, the error is translated into stalwart's and the old object stays."""
    monkeypatch.setattr(fsspec_storage, "STREAM_BYTES", PART)
    # One try per request: botocore and s3fs would each retry moto's 500 (about 10 s)
    options = {**s3_server.storage_options, "config_kwargs": {"retries": {"max_attempts": 1}}}
    store = FsspecStorage(f"s3://{s3_bucket}/ckpt", storage_options=options)
    monkeypatch.setattr(store.fs, "retries", 1)
    store.write("k", [b"old"])
    bucket = _root(store).split("/", 1)[0]

    def lost_midway() -> Iterator[bytes]:
        pieces = _pieces(6)
        yield from pieces[:4]  # 12 MiB: two parts of 5 MiB are up
        for u in _uploads_in_progress(store):
            store.fs.call_s3("abort_multipart_upload", Bucket=bucket, **_upload_of(u))
        yield from pieces[4:]

    with pytest.raises(StorageError) as failed:
        store.write("k", lost_midway())
    assert "write s3://" in str(failed.value) and "retry the save" in str(failed.value)
    assert store.read("k") == b"old"
    assert not _uploads_in_progress(store)


def _upload_of(u: object) -> dict[str, str]:
    assert isinstance(u, dict)
    return {"Key": u["Key"], "UploadId": u["UploadId"]}
