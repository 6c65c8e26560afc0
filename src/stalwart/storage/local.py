"""A byte store on a local or network-mounted filesystem, on plain ``os`` for speed.

Atomicity comes from writing a temporary file next to the target (``.tmp-<uuid>-<name>``) and
``os.replace``-ing it into place; durability from ``fsync`` of the file before the rename and of
the directory (and any directory created for it) after. Reads go straight into the caller's
buffer with ``os.preadv``, so restoring a tensor does not copy through an intermediate ``bytes``.
A crash can leave temporaries behind; they are invisible to :meth:`LocalStorage.list` and
:meth:`LocalStorage.remove_stale_temps` deletes those no live writer holds
(:mod:`stalwart.storage.temps`).

Nothing below the root may be a symbolic link, folder or object: every call opens the key's
folders one by one without following links and refuses a link with
:class:`~stalwart.errors.UnsafePathError` (:mod:`stalwart.storage.confine` says why and how).
The root itself may be reached through a link: to keep checkpoints on a bigger disk, put the
whole root there.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import threading
from collections.abc import Iterable, Iterator

import stalwart.storage.direct_io as direct_io
from stalwart.errors import (
    ConfigError,
    ObjectNotFoundError,
    StorageError,
    StorageFullError,
    StoragePermissionError,
)
from stalwart.storage.base import Buffer, ObjectInfo, validate_key
from stalwart.storage.confine import NOFOLLOW, Folders, link_error, open_folders, refuse_link, walk
from stalwart.storage.temps import TEMP_PREFIX, create_claimed, remove_stale

__all__ = ["MAP_READS", "TEMP_PREFIX", "LocalStorage", "fsync_dir"]

logger = logging.getLogger(__name__)

MAP_READS = False
"""``read_view`` maps the page cache (``direct_io.map_range``) instead of reading into a buffer.

Off by default. Mapped, 4 gloo ranks loading a replicated 1 GB each on 2 cores spent 0.05
CPU-s in the kernel instead of 0.2 and loaded in 0.96 s against 1.2 (DDP 1 GB loads 0.92-0.94x
the fastest peer instead of 1.02-1.07x); but at 8 GiB (4 ranks, FSDP2, every page cold from
the disk once), interleaved in one run, mapped loads took 1.13x as long as buffered ones
(paired by round), and 1.56x where one rank read it all (docs/benchmarks.md, "Fifth round").
Users' states are that size: buffers."""

_FULL_ERRNOS = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})
_PERMISSION_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
_OPEN_FLAGS_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
_OPEN_FLAGS_READ = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | NOFOLLOW


def translate_os_error(e: OSError, path: str, op: str) -> StorageError:
    """Map an ``OSError`` raised while doing ``op`` on ``path`` to a stalwart storage error."""
    if e.errno == errno.ENOENT:
        return ObjectNotFoundError(f"no object at {path} ({op}): {e.strerror or e}")
    if e.errno == errno.ELOOP:  # O_NOFOLLOW met a link
        return link_error(path, op)
    if e.errno in _FULL_ERRNOS:
        return StorageFullError(
            f"no space left on device writing {path}; free space or choose another root "
            "— earlier checkpoints are untouched"
        )
    if e.errno in _PERMISSION_ERRNOS:
        return StoragePermissionError(
            f"cannot {op} {path}: the location is read-only or not writable "
            f"({e.strerror or e}); choose a writable checkpoint root"
        )
    return StorageError(f"{op} {path} failed: {e}")


def _byte_view(buf: Buffer) -> memoryview:
    """A flat unsigned-byte view of ``buf`` (no copy unless it is not contiguous)."""
    view = memoryview(buf)
    if not view.contiguous:
        view = memoryview(view.tobytes())
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


class LocalStorage:
    """Objects as files under a root directory; keys map to ``/``-separated relative paths.

    Args:
        root: the directory holding the objects (the path may go through links; nothing
            below it may be one).
        create: create ``root`` (and its parents) when missing; when ``False`` a missing root
            raises :class:`~stalwart.errors.ObjectNotFoundError`.
    """

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.url = self.root
        self._buffers = direct_io.AlignedBufferPool()
        self._read_buffers = direct_io.ReadBufferPool()
        self._held: dict[str, list[int]] = {}  # key -> [descriptor, holders] (hold_open)
        self._held_lock = threading.Lock()
        if not os.path.isdir(self.root):
            not_dir = (
                f"checkpoint root {self.root} exists but is not a directory; pass a directory path"
            )
            if not create:
                if os.path.exists(self.root):
                    raise ConfigError(not_dir)
                raise ObjectNotFoundError(
                    f"checkpoint root {self.root} does not exist; check the path or pass "
                    "create=True"
                )
            # No exists() check first: another rank may be creating the root right now, and
            # makedirs(exist_ok=True) accepts that; it fails only when a file is in the way.
            try:
                os.makedirs(self.root, exist_ok=True)
            except FileExistsError:
                raise ConfigError(not_dir) from None
            except OSError as e:
                raise translate_os_error(e, self.root, "create directory") from e

    def __repr__(self) -> str:
        return f"LocalStorage({self.root!r})"

    @contextlib.contextmanager
    def _object(self, key: str, op: str, *, create: bool = False) -> Iterator[tuple[Folders, str]]:
        """The open folders of ``key`` and its name there; links refused, errors translated."""
        *parts, name = validate_key(key).split("/")
        try:
            with open_folders(self.root, parts, op=op, create=create) as folders:
                yield folders, name
        except StorageError:
            raise
        except OSError as e:
            raise translate_os_error(e, os.path.join(self.root, key), op) from e

    def _open_read(self, key: str) -> int:
        """A read-only descriptor of ``key``, opened without following any link."""
        with self._object(key, "read") as (folders, name):
            return os.open(name, _OPEN_FLAGS_READ, dir_fd=folders.fd)

    @contextlib.contextmanager
    def hold_open(self, key: str) -> Iterator[None]:
        """``read_view`` of ``key`` inside the ``with`` reads through one descriptor, so the
        kernel's read-ahead follows the reads (a descriptor per read starts it anew each time:
        2 ranks loading 0.5 GB each, cold, in order through one descriptor 0.36 s against
        0.65-0.83; docs/benchmarks.md, "Sixth round"). The object stays readable while held,
        even if it is replaced or deleted meanwhile (objects are never rewritten in place)."""
        held = self._hold(key, open_it=True)
        assert held is not None
        try:
            yield
        finally:
            self._let_go(key, held)

    def _hold(self, key: str, *, open_it: bool) -> list[int] | None:
        """``[descriptor, holders]`` of ``key``, counted as used until ``_let_go``; one is
        opened when none is held and ``open_it``, else None."""
        with self._held_lock:
            held = self._held.get(key)
            if held is None and open_it:
                held = self._held[key] = [self._open_read(key), 0]
            if held is not None:
                held[1] += 1
            return held

    def _let_go(self, key: str, held: list[int]) -> None:
        with self._held_lock:
            held[1] -= 1
            if not held[1]:
                del self._held[key]
                _close_quietly(held[0])

    # -- writing ---------------------------------------------------------------------------

    def write(self, key: str, data: Iterable[Buffer]) -> int:
        """Write ``key`` atomically and durably from consecutive buffers; return its size.

        A failure (including an exception from ``data`` itself) leaves no object and no
        temporary behind; an existing object under ``key`` stays as it was.
        """
        return self._write(key, data, sync=True)

    def write_unsynced(self, key: str, data: Iterable[Buffer]) -> int:
        """:meth:`write` without its two ``fsync`` calls (``WritesUnsynced``): atomic and seen
        at once by every process of this host, but a crash of the host may lose it."""
        return self._write(key, data, sync=False)

    def _write(self, key: str, data: Iterable[Buffer], *, sync: bool) -> int:
        with self._object(key, "write", create=True) as (folders, name):
            refuse_link(folders, name, "replace")  # the rename would not follow it; be plain
            fd, tmp = create_claimed(folders.fd, name, _OPEN_FLAGS_WRITE)
            try:
                total = direct_io.write_stream(fd, (_byte_view(b) for b in data), self._buffers)
                if sync:
                    os.fsync(fd)
                os.replace(tmp, name, src_dir_fd=folders.fd, dst_dir_fd=folders.fd)
                tmp = ""
                if sync:  # the rename, and every directory entry made for it, reach the disk
                    folders.fsync()
            finally:
                _close_quietly(fd)  # the claim on the temporary ends only after the rename
                if tmp:
                    _unlink_quietly(tmp, folders.fd)
        return total

    # -- reading ---------------------------------------------------------------------------

    def read_into(self, key: str, offset: int, out: memoryview) -> int:
        """Read up to ``len(out)`` bytes at ``offset`` straight into ``out``; return the count."""
        if offset < 0:
            raise ConfigError(f"read offset must be >= 0, got {offset}")
        view = _byte_view(out)
        if view.readonly:
            raise ConfigError("read_into needs a writable buffer, got a read-only memoryview")
        fd = self._open_read(key)
        try:
            total, want = 0, len(view)
            while total < want:
                n = _pread_into(fd, view[total:], offset + total)
                if n == 0:
                    break  # end of file: a short read, the caller judges truncation
                total += n
            return total
        except OSError as e:
            raise translate_os_error(e, os.path.join(self.root, key), "read") from e
        finally:
            _close_quietly(fd)

    @contextlib.contextmanager
    def read_view(self, key: str, offset: int, length: int) -> Iterator[memoryview]:
        """Bytes ``[offset, offset + length)`` of ``key`` as a read-only view for the ``with``.

        One read into a reused page-aligned buffer (no allocation per read), so the caller
        can check the bytes before copying them where they belong; with ``MAP_READS``, the
        file's pages mapped from the page cache instead (no copy; objects are replaced by
        rename, never rewritten in place, so a mapped one does not change under the reader).
        Buffered, not O_DIRECT: with the kernel's read-ahead that measured 1.6x faster (see
        ``direct_io``). The view is shorter than ``length`` when the object ends first.
        """
        if offset < 0 or length < 0:
            raise ConfigError(f"read offset and length must be >= 0, got {offset}, {length}")
        held = self._hold(key, open_it=False)
        fd = held[0] if held is not None else self._open_read(key)
        try:
            mapped = None
            if MAP_READS:
                with contextlib.suppress(OSError):  # a filesystem that cannot map: a buffer
                    mapped = direct_io.map_range(fd, offset, length)
            if mapped is not None:
                view, release = mapped
            else:
                buf = self._read_buffers.get(length + 2 * direct_io.ALIGN)
                release = functools.partial(self._read_buffers.put, buf)
                try:
                    view = direct_io.read_range(fd, False, offset, length, buf).toreadonly()
                except OSError as e:
                    release()
                    raise translate_os_error(e, os.path.join(self.root, key), "read") from e
        finally:
            if held is None:
                _close_quietly(fd)
            else:
                self._let_go(key, held)
        try:
            yield view
        finally:
            release()

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        """Read ``length`` bytes at ``offset`` (to the end when ``None``)."""
        if offset < 0 or (length is not None and length < 0):
            raise ConfigError(f"read offset and length must be >= 0, got {offset}, {length}")
        fd = self._open_read(key)
        try:
            with open(fd, "rb", closefd=False) as f:
                f.seek(offset)
                return f.read(-1 if length is None else length)
        except OSError as e:
            raise translate_os_error(e, os.path.join(self.root, key), "read") from e
        finally:
            _close_quietly(fd)

    # -- deleting and listing --------------------------------------------------------------

    def delete(self, key: str) -> None:
        """Delete ``key``; a missing key (or folder) is fine. A link is refused, not removed."""
        try:
            with self._object(key, "delete") as (folders, name):
                refuse_link(folders, name, "delete")
                os.unlink(name, dir_fd=folders.fd)
        except (FileNotFoundError, ObjectNotFoundError):
            return

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Objects whose key starts with ``prefix``, sorted by key; temporaries are skipped.

        A prefix ending in ``/`` walks only that folder; otherwise the prefix's parent folder
        is walked, descending only into entries whose name starts with the last part. A
        missing folder lists nothing; a linked one is refused (:class:`UnsafePathError`).
        """
        folder, _, stem = prefix.rpartition("/")
        if stem:
            validate_key(stem)
        parts = validate_key(folder).split("/") if folder else []
        key_prefix = f"{folder}/" if folder else ""
        path = os.path.join(self.root, *parts)
        try:
            with open_folders(self.root, parts, op="list") as folders:
                infos = list(walk(folders.fd, key_prefix, stem=stem, hidden=TEMP_PREFIX))
        except ObjectNotFoundError:
            return []  # the folder is not there (yet): nothing in it
        except StorageError:
            raise
        except OSError as e:
            raise translate_os_error(e, path, "list") from e
        infos.sort(key=lambda i: i.key)
        return infos

    def remove_stale_temps(self, older_than_s: float) -> int:
        """Delete temporaries of crashed writes that are older than ``older_than_s`` seconds.

        Returns how many were removed. A temporary that a live writer holds is never removed,
        whatever ``older_than_s`` (see :mod:`stalwart.storage.temps`), and no link is followed.
        """
        if older_than_s < 0:
            raise ConfigError(f"older_than_s must be >= 0, got {older_than_s}")
        try:
            with open_folders(self.root, [], op="remove temporaries") as folders:
                removed = remove_stale(folders.fd, older_than_s)
        except ObjectNotFoundError:
            return 0
        if removed:
            logger.info("removed %d stale temporary file(s) under %s", removed, self.root)
        return removed

    def close(self) -> None:
        """Release the reusable write buffers (each call opens and closes its own files)."""
        self._buffers.close()
        self._read_buffers.close()


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    data = os.pread(fd, len(view), offset)  # pragma: no cover - platforms without preadv
    view[: len(data)] = data  # pragma: no cover
    return len(data)  # pragma: no cover


def fsync_dir(dirpath: str) -> None:
    """Make a rename or a new entry in ``dirpath`` durable (fsync of the folder itself)."""
    fd = os.open(dirpath, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        logger.debug("closing fd %d failed", fd, exc_info=True)


def _unlink_quietly(name: str, dir_fd: int) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=dir_fd)
