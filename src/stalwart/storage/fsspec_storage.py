"""A byte store on any fsspec filesystem: S3, GCS, Azure, ``memory://`` ... (not local paths).

Atomicity on object stores comes from writing each object with one PUT (``pipe_file`` of the
whole payload), or, above ``STREAM_BYTES`` on S3 and GCS, with an upload in parts that the store
publishes only when it completes (aborted on failure): readers see the old object or the new
one, never a prefix. Every call runs under a :class:`~stalwart.storage.retry.RetryPolicy`, so
throttling and dropped connections are retried with backoff, while permanent errors (no such
key or bucket, access denied) fail at once, translated into :mod:`stalwart.errors`. fsspec and
its backends are imported lazily, on first construction, with an install hint when one is
missing. Local paths (``file://``) are refused: :class:`~stalwart.storage.local.LocalStorage`
serves them and never follows a link out of the root, which fsspec's local filesystem would.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import functools
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from stalwart.errors import (
    ConfigError,
    ObjectNotFoundError,
    StalwartError,
    StorageError,
    StorageFullError,
    StoragePermissionError,
)
from stalwart.storage.base import Buffer, ObjectInfo, validate_key
from stalwart.storage.retry import RetryPolicy, call_with_retry, error_code

__all__ = ["FsspecStorage"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Extras that provide a backend, for the install hint when its import fails.
_EXTRAS = {"s3": "s3", "s3a": "s3"}
_PERMISSION_CODES = frozenset({"AccessDenied", "Forbidden", "403", "AllAccessDisabled"})
_EMPTY_RANGE_CODES = frozenset({"InvalidRange", "416"})


_IN_PROCESS = frozenset({"memory"})
"""fsspec protocols whose bytes never leave the process."""

_STREAMS_ATOMICALLY = frozenset({"s3", "s3a", "gs", "gcs"})
"""Protocols whose files written in parts appear whole, and only at ``close``: S3's multipart
upload (aborted by ``discard``), GCS's resumable upload (cancelled by ``discard``)."""

STREAM_BYTES = 64 << 20
"""Objects larger than this are uploaded in parts of this size where the store publishes them
atomically (``_STREAMS_ATOMICALLY``), instead of one PUT of the joined buffers: memory stays at
one part, not the whole object (a pack is a rank's whole share of a save), and objects past
S3's 5 GB limit for one PUT can be written. Smaller objects keep the one PUT, retried whole."""


def _install_hint(protocol: str) -> str:
    extra = _EXTRAS.get(protocol)
    if extra:
        return f"pip install 'stalwart[{extra}]'"
    return f"install the fsspec implementation for {protocol}:// (see fsspec's registry)"


def _mtime(info: dict[str, Any]) -> float:
    for field in ("LastModified", "mtime", "created"):
        value = info.get(field)
        if isinstance(value, _dt.datetime):
            return value.timestamp()
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):
            try:
                return _dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return 0.0


def _is_local(fs: Any) -> bool:
    """True for fsspec's local filesystem, also behind a ``dir::`` prefix."""
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem) or isinstance(getattr(fs, "fs", None), LocalFileSystem)


class FsspecStorage:
    """Objects under an fsspec URL such as ``s3://bucket/run-7`` or ``memory://scratch``.

    Args:
        url: the root, with its scheme.
        storage_options: keyword arguments for the filesystem (credentials, endpoint, ...).
        retry: how to retry transient failures; ``RetryPolicy()`` when ``None``.

    Raises:
        ConfigError: the scheme is unknown to fsspec, or its implementation is not installed.
    """

    def __init__(
        self,
        url: str,
        *,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        try:
            import fsspec.core
        except ImportError as e:  # pragma: no cover - fsspec is a core dependency
            raise ConfigError("fsspec is required for URL storage; pip install fsspec") from e
        protocol = fsspec.core.split_protocol(url)[0] or "file"
        try:
            fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except ImportError as e:
            raise ConfigError(
                f"storage URL {url!r} needs a backend that is not installed ({e}); "
                f"{_install_hint(protocol)}"
            ) from e
        except ValueError as e:
            if "Protocol not known" not in str(e):
                raise ConfigError(f"cannot open storage URL {url!r}: {e}") from e
            from fsspec.registry import known_implementations

            raise ConfigError(
                f"unknown storage scheme {protocol!r} in {url!r}; known schemes: "
                f"{', '.join(sorted(known_implementations))}"
            ) from e
        if _is_local(fs):
            # fsspec's local filesystem follows symbolic links anywhere under the root; the
            # local store checks every path component (see stalwart.storage.confine).
            raise ConfigError(
                f"{url!r} is a local path: open it with LocalStorage (or open_storage, which "
                "picks LocalStorage for plain paths and file:// URLs), which never follows a "
                "link out of the checkpoint root"
            )
        self.url = url
        self.fs = fs
        self.protocol = protocol
        self.retry = retry if retry is not None else RetryPolicy()
        self._root = root.rstrip("/")
        # Local-like filesystems do not create parent folders on write; object stores have none.
        self._mkdirs = getattr(fs, "auto_mkdir", True) is False

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"

    @property
    def reads_leave_host(self) -> bool:
        """True but for in-process filesystems (``memory://``); see ``ReadsLeaveHost``."""
        return self.protocol.split("::")[-1] not in _IN_PROCESS

    def _path(self, key: str) -> str:
        validate_key(key)
        return f"{self._root}/{key}" if self._root else key

    def _call(self, what: str, path: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` with retries; translate whatever escapes into a stalwart error."""
        try:
            return call_with_retry(fn, policy=self.retry, what=what)
        except StalwartError:
            raise
        except Exception as e:
            raise self._translate(e, path, what) from e

    def _translate(self, e: Exception, path: str, what: str) -> StorageError:
        code = error_code(e)
        if code == "NoSuchBucket" or "bucket does not exist" in str(e):
            return self._missing_bucket(path, what)
        if isinstance(e, FileNotFoundError):
            return ObjectNotFoundError(f"no object at {self.protocol}://{path} ({what})")
        if isinstance(e, PermissionError) or code in _PERMISSION_CODES:
            return StoragePermissionError(
                f"access denied: cannot {what}; the location is read-only or the credentials "
                "lack permission — check them or choose a writable root"
            )
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
            return StorageFullError(
                f"no space left on device writing {self.protocol}://{path}; free space or "
                "choose another root — earlier checkpoints are untouched"
            )
        return StorageError(f"{what} failed: {type(e).__name__}: {e}")

    def write(self, key: str, data: Iterable[Buffer]) -> int:
        """Write ``key`` atomically; return its size.

        One PUT of the joined buffers, retried whole; an object larger than ``STREAM_BYTES``
        on a store that publishes parts atomically is uploaded in parts instead (each part
        retried by the backend), and a failure aborts the upload: no object, the old one kept.
        """
        path = self._path(key)
        head: list[Buffer] = []
        size = 0
        it = iter(data)
        if self.protocol in _STREAMS_ATOMICALLY:
            for b in it:
                head.append(b)
                size += memoryview(b).nbytes
                if size > STREAM_BYTES:
                    return self._write_in_parts(path, head, it)
        payload = b"".join([*head, *it])

        def put() -> None:
            if self._mkdirs:
                self.fs.makedirs(self.fs._parent(path), exist_ok=True)
            self.fs.pipe_file(path, payload)

        self._call(f"write {self.protocol}://{path}", path, put)
        return len(payload)

    def _write_in_parts(self, path: str, head: list[Buffer], rest: Iterator[Buffer]) -> int:
        """Upload ``head`` then ``rest`` in parts of ``STREAM_BYTES``; see :meth:`write`."""
        what = f"write {self.protocol}://{path}"
        f = self._call(what, path, lambda: self.fs.open(path, "wb", block_size=STREAM_BYTES))
        total = 0
        try:
            for b in itertools.chain(head, rest):  # the producer's errors pass unchanged
                try:
                    total += f.write(b)
                except Exception as e:  # the store's, after the backend's own retries
                    raise self._part_failed(e, path, what) from e
            try:
                f.close()  # the last part, then the upload completes: the object appears whole
            except Exception as e:
                raise self._part_failed(e, path, what) from e
        except BaseException:
            with contextlib.suppress(Exception):
                f.discard()  # abort the upload: no object, an old one under the key stays
            f.closed = True  # a discarded file must not complete the upload when collected
            raise
        return total

    def _part_failed(self, e: Exception, path: str, what: str) -> StorageError:
        """:meth:`_translate`, saying what a failed upload in parts left where the error
        itself does not say what to do (the specific errors carry their own next step)."""
        err = self._translate(e, path, what)
        if type(err) is not StorageError:
            return err
        return StorageError(
            f"{err}; the upload was aborted and the object under this key is as it was: "
            "retry the save (earlier checkpoints are untouched)"
        )

    def _cat(self, path: str, start: int | None, end: int | None) -> bytes:
        try:
            return bytes(self.fs.cat_file(path, start=start, end=end))
        except OSError as e:
            # S3 answers a range that starts at or past the end (of a possibly empty object)
            # with 416; the object exists (a missing key fails with NoSuchKey first).
            if (start is not None or end is not None) and error_code(e) in _EMPTY_RANGE_CODES:
                return b""
            raise

    def read_into(self, key: str, offset: int, out: memoryview) -> int:
        """Read up to ``len(out)`` bytes at ``offset`` into ``out``; return the count."""
        if offset < 0:
            raise ConfigError(f"read offset must be >= 0, got {offset}")
        view = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        data = self.read(key, offset, len(view))
        view[: len(data)] = data
        return len(data)

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        """Read ``length`` bytes at ``offset`` (to the end when ``None``) with ranged GETs."""
        if offset < 0 or (length is not None and length < 0):
            raise ConfigError(f"read offset and length must be >= 0, got {offset}, {length}")
        path = self._path(key)
        what = f"read {self.protocol}://{path}"
        if length == 0:
            # No bytes to fetch, but a missing key must still raise.
            self._call(what, path, functools.partial(self.fs.info, path))
            return b""
        start = offset or None
        end = None if length is None else offset + length
        return self._call(what, path, functools.partial(self._cat, path, start, end))

    def delete(self, key: str) -> None:
        """Delete ``key``; a missing key is fine."""
        path = self._path(key)

        def rm() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(path)

        self._call(f"delete {self.protocol}://{path}", path, rm)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Objects whose key starts with ``prefix``, sorted by key (listing cache bypassed)."""
        folder = prefix.rpartition("/")[0]
        base = self._path(folder) if folder else self._root

        def find() -> dict[str, dict[str, Any]]:
            # Other writers (other ranks, other hosts) change the store: never trust a cache.
            self.fs.invalidate_cache()
            try:
                return dict(self.fs.find(base, detail=True))
            except FileNotFoundError:
                self._check_bucket(base, "list")  # a missing bucket is no empty folder
                return {}

        found = self._call(f"list {self.protocol}://{base}", base, find)
        # The filesystem's own spelling of "<root>/" (memory:// adds a leading slash).
        root = self.fs._strip_protocol(self._path("k"))[: -len("k")]
        infos = []
        for name, info in found.items():
            name = self.fs._strip_protocol(name)
            if not name.startswith(root):
                continue
            key = name[len(root) :]
            if key.startswith(prefix) and info.get("type", "file") == "file":
                infos.append(ObjectInfo(key, int(info.get("size") or 0), _mtime(info)))
        infos.sort(key=lambda i: i.key)
        return infos

    def _check_bucket(self, path: str, what: str) -> None:
        """Raise the missing-bucket error when ``path``'s bucket does not exist (object stores
        name a bucket first; s3fs lists a missing bucket as a missing folder)."""
        bucket = path.lstrip("/").split("/", 1)[0]
        if self.protocol in _STREAMS_ATOMICALLY and not self.fs.exists(bucket):
            raise self._missing_bucket(path, what)

    def _missing_bucket(self, path: str, what: str) -> ObjectNotFoundError:
        bucket = path.lstrip("/").split("/", 1)[0]
        return ObjectNotFoundError(
            f"bucket {bucket!r} does not exist ({what}); create it or fix the URL {self.url!r}"
        )

    def close(self) -> None:
        """Drop our handle; fsspec caches and shares filesystem instances, so none is closed."""
        logger.debug("closing %r", self)
