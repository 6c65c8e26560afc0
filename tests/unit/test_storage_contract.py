"""The storage contract every backend passes, plus backend-specific and fault-injection tests.

``StorageContract`` holds one test per guarantee of :class:`stalwart.storage.Storage`; each
backend runs it through a subclass that only provides the ``store`` fixture.
"""

from __future__ import annotations

import array
import errno
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from stalwart.errors import (
    ConfigError,
    ObjectNotFoundError,
    StorageError,
    StorageFullError,
    StoragePermissionError,
    TransientStorageError,
    UnsafeManifestError,
)
from stalwart.storage import (
    FsspecStorage,
    LocalStorage,
    MemoryStorage,
    RetryPolicy,
    Storage,
    open_storage,
)
from stalwart.storage.base import WritesUnsynced
from stalwart.storage.local import TEMP_PREFIX, translate_os_error
from stalwart.storage.retry import call_with_retry, is_transient
from stalwart.testing import FlakyStorage
from stalwart.testing.s3_server import S3Server

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
UNSAFE_KEYS = ["../x", "/abs", "s3://x", "a//b", "a\\b", "a/./b", "", "a/"]


def _failing_chunks(first: bytes, exc: Exception) -> Iterator[bytes]:
    yield first
    raise exc


class StorageContract:
    """One test per guarantee; subclasses provide a ``store`` fixture."""

    has_mtime = True

    @pytest.fixture
    def store(self) -> Storage:
        raise NotImplementedError

    def test_is_a_storage(self, store: Storage) -> None:
        assert isinstance(store, Storage)
        assert isinstance(store.url, str) and store.url

    def test_round_trip_of_several_buffers(self, store: Storage) -> None:
        floats = array.array("d", [1.5, -2.0, 3.25])
        parts = [b"abc", bytearray(b"de"), memoryview(b"xyz")[1:], memoryview(floats)]
        expected = b"abcdeyz" + floats.tobytes()
        assert store.write("a/b/obj", parts) == len(expected)
        assert store.read("a/b/obj") == expected
        assert store.read("a/b/obj", 3, 2) == b"de"

    def test_read_into_at_offsets(self, store: Storage) -> None:
        data = bytes(range(256))
        store.write("blob", [data])
        out = bytearray(b"\xff" * 40)
        assert store.read_into("blob", 100, memoryview(out)[10:30]) == 20
        assert out[10:30] == data[100:120]
        assert out[:10] == b"\xff" * 10 and out[30:] == b"\xff" * 10
        assert store.read_into("blob", 0, memoryview(out)) == 40
        assert bytes(out) == data[:40]

    def test_short_read_at_end_returns_fewer_bytes(self, store: Storage) -> None:
        store.write("blob", [b"0123456789"])
        out = bytearray(8)
        assert store.read_into("blob", 7, memoryview(out)) == 3
        assert out[:3] == b"789"
        assert store.read_into("blob", 10, memoryview(out)) == 0
        assert store.read("blob", 7, 100) == b"789"
        assert store.read("blob", 10) == b""

    def test_missing_key_raises_object_not_found(self, store: Storage) -> None:
        for call in (
            lambda: store.read("no/such/key"),
            lambda: store.read("no/such/key", 0, 0),
            lambda: store.read_into("no/such/key", 0, memoryview(bytearray(4))),
        ):
            with pytest.raises(ObjectNotFoundError) as info:
                call()
            assert isinstance(info.value, FileNotFoundError)

    def test_overwrite_replaces_and_failed_overwrite_keeps_old(self, store: Storage) -> None:
        store.write("k", [b"first version, long"])
        store.write("k", [b"second"])
        assert store.read("k") == b"second"
        assert [(i.key, i.size) for i in store.list("k")] == [("k", 6)]
        with pytest.raises(RuntimeError, match="producer died"):
            store.write("k", _failing_chunks(b"third", RuntimeError("producer died")))
        assert store.read("k") == b"second"

    def test_delete(self, store: Storage) -> None:
        store.delete("never/written")  # a missing key is fine
        store.write("gone", [b"x"])
        store.delete("gone")
        with pytest.raises(ObjectNotFoundError):
            store.read("gone")
        assert store.list() == []

    def test_list_with_prefix(self, store: Storage) -> None:
        keys = ["manifests/step-1.json", "manifests/step-2.json", "packs/ab/cd", "packs/ab/efg"]
        for k in [*keys, "packsx", "top"]:
            store.write(k, [k.encode()])
        assert [i.key for i in store.list("manifests/")] == keys[:2]
        assert [i.key for i in store.list("packs/")] == keys[2:]
        assert [i.key for i in store.list("packs/ab/e")] == ["packs/ab/efg"]
        assert [i.key for i in store.list("pack")] == [*keys[2:], "packsx"]
        assert store.list("nothing/") == []
        infos = store.list()
        assert [i.key for i in infos] == sorted([*keys, "packsx", "top"])
        assert all(i.size == len(i.key) for i in infos)
        if self.has_mtime:
            assert all(abs(i.mtime - time.time()) < 3600 for i in infos)

    @pytest.mark.parametrize("key", UNSAFE_KEYS)
    def test_unsafe_keys_are_rejected(self, store: Storage, key: str) -> None:
        with pytest.raises(UnsafeManifestError):
            store.write(key, [b"x"])
        with pytest.raises(UnsafeManifestError):
            store.read(key)
        with pytest.raises(UnsafeManifestError):
            store.delete(key)

    def test_zero_length_object(self, store: Storage) -> None:
        assert store.write("empty", [b"", memoryview(b"")]) == 0
        assert store.write("empty2", []) == 0
        assert store.read("empty") == b""
        assert store.read_into("empty", 0, memoryview(bytearray(4))) == 0
        assert [(i.key, i.size) for i in store.list("empty")] == [("empty", 0), ("empty2", 0)]

    def test_20_mib_object_round_trip(self, store: Storage) -> None:
        data = os.urandom(20 * MiB)
        view = memoryview(data)
        chunks = [view[i : i + 3 * MiB] for i in range(0, len(data), 3 * MiB)]
        assert store.write("big/obj", chunks) == len(data)
        out = bytearray(len(data))
        assert store.read_into("big/obj", 0, memoryview(out)) == len(data)
        assert out == data
        assert store.read("big/obj", 17 * MiB, 10) == data[17 * MiB : 17 * MiB + 10]


class TestLocalStorage(StorageContract):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Storage:
        return LocalStorage(tmp_path / "root")


class TestMemoryStorage(StorageContract):
    @pytest.fixture
    def store(self) -> Iterator[Storage]:
        name = f"test-{uuid.uuid4().hex}"
        yield MemoryStorage(name)
        MemoryStorage.clear_namespace(name)


class TestFsspecMemory(StorageContract):
    @pytest.fixture
    def store(self) -> Storage:
        return FsspecStorage(f"memory://stalwart-test/{uuid.uuid4().hex}")


class TestFsspecS3(StorageContract):
    @pytest.fixture
    def store(self, s3_server: S3Server, s3_bucket: str) -> Storage:
        return FsspecStorage(f"s3://{s3_bucket}/ckpt", storage_options=s3_server.storage_options)


# -- local specifics ---------------------------------------------------------------------------


def _all_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_local_failed_write_leaves_no_object_and_no_temp(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    with pytest.raises(OSError, match="disk vanished"):
        store.write("packs/p1", _failing_chunks(b"x" * 100_000, OSError("disk vanished")))
    assert _all_files(tmp_path) == []
    with pytest.raises(ObjectNotFoundError):
        store.read("packs/p1")


def test_local_unsynced_write_is_atomic_and_skips_only_the_flushes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lease's write (``WritesUnsynced``): replaced whole, no temporary left, no fsync, and a
    failed one keeps the object it would have replaced; ``write`` still flushes."""
    store = LocalStorage(tmp_path)
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    assert isinstance(store, WritesUnsynced)
    assert store.write_unsynced("leases/a.json", [b"{", b"}"]) == 2
    assert store.write_unsynced("leases/a.json", [b"[1]"]) == 3
    assert store.read("leases/a.json") == b"[1]" and synced == []
    with pytest.raises(OSError, match="disk vanished"):
        store.write_unsynced("leases/a.json", _failing_chunks(b"x", OSError("disk vanished")))
    assert store.read("leases/a.json") == b"[1]"
    assert _all_files(tmp_path) == ["leases/a.json"]
    store.write("leases/b.json", [b"{}"])
    assert len(synced) >= 2  # the file and its folder


def test_a_lease_is_written_unsynced_where_the_store_can_and_durably_elsewhere(
    tmp_path: Path,
) -> None:
    from stalwart.checkpoint.durable.lease import Lease, read_leases

    class Plain(MemoryStorage):
        writes: list[str]

        def write(self, key: str, data: Any) -> int:
            self.writes.append(key)
            return super().write(key, data)

    class Unsynced(Plain):
        def write_unsynced(self, key: str, data: Any) -> int:
            self.writes.append("unsynced " + key)
            return MemoryStorage.write(self, key, data)

    for store, kind in ((Plain(), ""), (Unsynced(), "unsynced ")):
        store.writes = []
        with Lease(store, steps=[3], packs=["p"], lease_s=60.0, reading=True) as lease:
            assert store.writes == [kind + lease.key]
            assert read_leases(store).read_steps == {3}
        assert read_leases(store).steps == set()


def test_local_missing_root_without_create(tmp_path: Path) -> None:
    with pytest.raises(ObjectNotFoundError, match=r"does not exist.*create=True"):
        LocalStorage(tmp_path / "absent", create=False)
    assert not (tmp_path / "absent").exists()
    (tmp_path / "afile").write_bytes(b"")
    with pytest.raises(ConfigError, match="not a directory"):
        LocalStorage(tmp_path / "afile")


def test_local_list_walks_only_the_prefix_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalStorage(tmp_path)
    for k in ["manifests/m1", "packs/a/b", "packs/c/d", "other/x"]:
        store.write(k, [b"1"])
    scanned: list[str] = []
    real_scandir = os.scandir

    def recording_scandir(path: str | int) -> object:
        # The store walks by descriptor (never through a link): name the folder it holds.
        where = os.readlink(f"/proc/self/fd/{path}") if isinstance(path, int) else path
        scanned.append(os.path.relpath(where, tmp_path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", recording_scandir)
    assert [i.key for i in store.list("manifests/")] == ["manifests/m1"]
    assert scanned == ["manifests"]
    scanned.clear()
    assert [i.key for i in store.list("packs/a")] == ["packs/a/b"]
    assert scanned == ["packs", os.path.join("packs", "a")]


def test_local_remove_stale_temps(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    store.write("packs/p1", [b"data"])
    old = tmp_path / "packs" / f"{TEMP_PREFIX}{uuid.uuid4().hex}-p2"
    fresh = tmp_path / f"{TEMP_PREFIX}{uuid.uuid4().hex}-m"
    foreign = tmp_path / f"{TEMP_PREFIX}not-ours"  # not a name the store gives: never removed
    for p in (old, fresh, foreign):
        p.write_bytes(b"partial")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert [i.key for i in store.list()] == ["packs/p1"]
    assert store.remove_stale_temps(older_than_s=3600) == 1
    assert not old.exists() and fresh.exists()
    assert store.remove_stale_temps(older_than_s=0) == 1  # nobody holds it: a dead writer's
    assert _all_files(tmp_path) == [foreign.name, "packs/p1"]


def test_local_translates_errnos() -> None:
    def t(code: int) -> StorageError:
        return translate_os_error(OSError(code, os.strerror(code)), "/ckpt/x", "write")

    assert isinstance(t(errno.ENOENT), ObjectNotFoundError)
    assert isinstance(t(errno.ENOSPC), StorageFullError)
    assert isinstance(t(errno.EDQUOT), StorageFullError)
    for code in (errno.EACCES, errno.EPERM, errno.EROFS):
        err = t(code)
        assert isinstance(err, StoragePermissionError) and isinstance(err, PermissionError)
        assert "read-only or not writable" in str(err) and "writable checkpoint root" in str(err)
    other = t(errno.EIO)
    assert type(other) is StorageError and "/ckpt/x" in str(other)


def test_local_real_disk_full(tmpfs: Callable[[str], Path]) -> None:
    root = tmpfs("size=1m")
    store = LocalStorage(root)
    store.write("manifests/step-1", [b"committed"])
    with pytest.raises(StorageFullError, match="no space left on device") as info:
        store.write("packs/big", [memoryview(bytes(3 * MiB))])
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.__cause__.errno == errno.ENOSPC
    assert "earlier checkpoints are untouched" in str(info.value)
    assert _all_files(root) == ["manifests/step-1"]  # the temp was removed
    assert store.read("manifests/step-1") == b"committed"


def test_local_real_read_only_mount(tmpfs: Callable[[str], Path]) -> None:
    root = tmpfs("size=1m,ro")
    store = LocalStorage(root)
    with pytest.raises(StoragePermissionError, match="read-only or not writable"):
        store.write("manifests/step-1", [b"x"])
    assert store.list() == []


# -- open_storage ------------------------------------------------------------------------------


def test_open_storage_dispatch(tmp_path: Path) -> None:
    local = open_storage(tmp_path / "a")
    assert isinstance(local, LocalStorage) and local.url == str(tmp_path / "a")
    assert isinstance(open_storage(f"file://{tmp_path}/b"), LocalStorage)
    assert open_storage(local) is local
    name = f"ns-{uuid.uuid4().hex}"
    first, second = open_storage(f"memory://{name}"), open_storage(f"memory://{name}")
    assert isinstance(first, MemoryStorage)
    first.write("k", [b"shared"])
    assert second.read("k") == b"shared"
    MemoryStorage.clear_namespace(name)
    assert second.list() == []
    remote = open_storage("s3://some-bucket/run", storage_options={"anon": True})
    assert isinstance(remote, FsspecStorage) and remote.url == "s3://some-bucket/run"
    with pytest.raises(ObjectNotFoundError, match="create=True"):
        open_storage(tmp_path / "missing", create=False)


def test_open_storage_unknown_scheme_lists_known() -> None:
    with pytest.raises(ConfigError, match=r"unknown storage scheme 'bogus'.*\bs3\b"):
        open_storage("bogus://x/y")


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)


def test_import_is_light_and_missing_s3fs_gives_install_hint() -> None:
    proc = _run_python(
        "import sys\n"
        "import stalwart.storage\n"
        "assert 'fsspec' not in sys.modules, 'fsspec imported at import time'\n"
        "sys.modules['s3fs'] = None  # as if not installed\n"
        "from stalwart.errors import ConfigError\n"
        "try:\n"
        "    stalwart.storage.open_storage('s3://bucket/x')\n"
        "except ConfigError as e:\n"
        "    print(e)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'stalwart[s3]'" in proc.stdout


# -- fsspec retries and error translation ------------------------------------------------------


class ScriptedMemoryFS(MemoryFileSystem):
    """A real in-memory filesystem whose next calls raise scripted errors first."""

    protocol = "scriptedmem"
    cachable = False
    script: list[BaseException] = []  # noqa: RUF012 - shared by design, reset per test
    attempts = 0

    def _next(self) -> None:
        type(self).attempts += 1
        if self.script:
            raise self.script.pop(0)

    def pipe_file(self, path: str, value: bytes, *args: Any, **kwargs: Any) -> Any:
        self._next()
        return super().pipe_file(path, value, *args, **kwargs)

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> Any:
        self._next()
        return super().cat_file(path, start=start, end=end, **kwargs)


@pytest.fixture
def scripted() -> Iterator[type[ScriptedMemoryFS]]:
    import fsspec

    fsspec.register_implementation("scriptedmem", ScriptedMemoryFS, clobber=True)
    ScriptedMemoryFS.script, ScriptedMemoryFS.attempts = [], 0
    yield ScriptedMemoryFS
    ScriptedMemoryFS.script = []


FAST = RetryPolicy(attempts=3, initial_backoff_s=0.0, max_backoff_s=0.0)


def _scripted_store() -> FsspecStorage:
    return FsspecStorage(f"scriptedmem://t/{uuid.uuid4().hex}", retry=FAST)


def test_fsspec_retries_transient_errors_then_succeeds(
    scripted: type[ScriptedMemoryFS], caplog: pytest.LogCaptureFixture
) -> None:
    store = _scripted_store()
    scripted.script = [ConnectionResetError("reset"), TimeoutError("slow")]
    assert store.write("k", [b"payload"]) == 7
    assert scripted.attempts == 3
    assert sum("retrying" in r.getMessage() for r in caplog.records) == 2
    scripted.script = [OSError(errno.ETIMEDOUT, "timed out")]
    assert store.read("k") == b"payload"


def test_fsspec_permanent_error_fails_at_once(scripted: type[ScriptedMemoryFS]) -> None:
    store = _scripted_store()
    scripted.script = [PermissionError("AccessDenied")]
    with pytest.raises(StoragePermissionError, match="access denied"):
        store.write("k", [b"x"])
    assert scripted.attempts == 1
    with pytest.raises(ObjectNotFoundError):
        store.read("missing")
    assert scripted.attempts == 2


def test_fsspec_exhausted_retries_raise_transient(scripted: type[ScriptedMemoryFS]) -> None:
    store = _scripted_store()
    scripted.script = [ConnectionError("down")] * 5
    with pytest.raises(TransientStorageError, match="after 3 attempts") as info:
        store.write("k", [b"x"])
    assert isinstance(info.value.__cause__, ConnectionError)
    assert scripted.attempts == 3
    with pytest.raises(ObjectNotFoundError):  # nothing was written
        store.read("k")


def test_s3_missing_bucket_names_it(s3_server: S3Server) -> None:
    store = FsspecStorage("s3://no-such-bucket-xyz/ckpt", storage_options=s3_server.storage_options)
    with pytest.raises(ObjectNotFoundError, match="bucket 'no-such-bucket-xyz' does not exist"):
        store.write("k", [b"x"])


def test_is_transient_classification() -> None:
    from botocore.exceptions import ClientError

    def s3_error(code: str, status: int) -> OSError:
        err = ClientError(
            {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "Op"
        )
        translated = OSError(errno.EBUSY, code)  # what s3fs raises, chained like s3fs does
        translated.__cause__ = err
        return translated

    assert is_transient(s3_error("SlowDown", 503))
    assert is_transient(s3_error("InternalError", 500))
    assert not is_transient(s3_error("NoSuchKey", 404))
    assert not is_transient(s3_error("AccessDenied", 403))
    assert is_transient(OSError(errno.ECONNRESET, "reset"))
    assert is_transient(TransientStorageError("throttled"))
    assert not is_transient(StorageFullError("full"))
    assert not is_transient(FileNotFoundError("x"))
    assert not is_transient(ValueError("x"))


def test_retry_policy_validation_and_backoff() -> None:
    with pytest.raises(ConfigError):
        RetryPolicy(attempts=0)
    with pytest.raises(ConfigError):
        RetryPolicy(initial_backoff_s=3.0, max_backoff_s=1.0)
    with pytest.raises(ConfigError):
        RetryPolicy(multiplier=0.5)
    with pytest.raises(TypeError):
        RetryPolicy(5)  # keyword-only: positional arguments are refused
    policy = RetryPolicy(attempts=6, initial_backoff_s=1.0, max_backoff_s=4.0, multiplier=2.0)
    waits: list[float] = []
    calls = iter([TimeoutError()] * 5 + [None])

    def op() -> str:
        err = next(calls)
        if err is not None:
            raise err
        return "ok"

    assert call_with_retry(op, policy=policy, what="op", sleep=waits.append) == "ok"
    for wait, base in zip(waits, [1.0, 2.0, 4.0, 4.0, 4.0], strict=True):
        assert base / 2 <= wait <= base


# -- FlakyStorage -------------------------------------------------------------------------------


def test_flaky_fail_every_counts_calls() -> None:
    flaky = FlakyStorage(MemoryStorage(f"f-{uuid.uuid4().hex}"), fail_every=3)
    flaky.write("a", [b"1"])
    assert flaky.read("a") == b"1"
    with pytest.raises(TransientStorageError, match="injected failure: list"):
        flaky.list()
    assert flaky.read("a") == b"1"
    assert flaky.calls == {"write": 1, "read": 2, "list": 1}
    assert flaky.failures == {"list": 1} and flaky.injected == 1


def test_flaky_full_disk_on_packs_only() -> None:
    inner = MemoryStorage(f"f-{uuid.uuid4().hex}")
    flaky = FlakyStorage(
        inner,
        fail_on=lambda op, key: op == "write" and key.startswith("packs/"),
        error=StorageFullError,
    )
    with pytest.raises(StorageFullError):
        flaky.write("packs/p1", [b"data"])
    flaky.write("manifests/m1", [b"m"])
    assert [i.key for i in inner.list()] == ["manifests/m1"]  # failed call never reached inner
    assert flaky.failures == {"write": 1}


def test_flaky_probability_is_seeded_and_retry_recovers() -> None:
    def pattern(seed: int) -> list[bool]:
        flaky = FlakyStorage(MemoryStorage("p"), fail_probability=0.5, seed=seed)
        out = []
        for _ in range(32):
            try:
                flaky.list()
                out.append(False)
            except TransientStorageError:
                out.append(True)
        return out

    assert pattern(1) == pattern(1)
    assert 0 < sum(pattern(1)) < 32
    flaky = FlakyStorage(MemoryStorage(f"f-{uuid.uuid4().hex}"), fail_every=2)
    flaky.write("k", [b"v"])  # call 1
    assert call_with_retry(lambda: flaky.read("k"), policy=FAST, what="read") == b"v"
    assert flaky.calls["read"] == 2 and flaky.injected == 1
    with pytest.raises(ConfigError):
        FlakyStorage(MemoryStorage("p"), fail_probability=1.5)
    with pytest.raises(ConfigError):
        FlakyStorage(MemoryStorage("p"), fail_every=0)
