"""The byte-store contract every backend implements, and the key rules they share.

A backend is deliberately tiny: write a whole object, read a byte range (into a buffer, or as
bytes), delete, list, close. Everything else (packing, content addressing, commit, retention,
tiers, erasure coding) is written once above it, so adding a backend means implementing these
six methods and passing the contract tests in ``tests/unit/test_storage_contract.py``.

Two guarantees carry the checkpoint commit protocol, so every backend must give them:

* ``write`` is **atomic**: a reader sees either no object or the whole object, never a prefix
  (temp file + rename on disks; on object stores a single PUT, or an upload in parts that
  the store publishes only when it completes).
* ``write`` is **durable** when it returns (fsync of the file and its directory on disks).

Optional capabilities are declared, not guessed: a backend that can lend a read-only view of
a byte range implements :class:`ReadsViews`; one whose reads of an object run fastest in order
through one open handle, :class:`ReadsInOrder`; one that leaves temporaries a crashed writer
may strand implements :class:`RemovesStaleTemps`; one whose every read fetches bytes from
another machine says so with :class:`ReadsLeaveHost`; one whose durable ``write`` costs a flush
it can skip for a record no crash needs to keep implements :class:`WritesUnsynced`. Callers
test ``isinstance(store, ...)``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from stalwart.errors import UnsafeManifestError

__all__ = [
    "Buffer",
    "ObjectInfo",
    "ReadsInOrder",
    "ReadsLeaveHost",
    "ReadsViews",
    "RemovesStaleTemps",
    "Storage",
    "WritesUnsynced",
    "validate_key",
]

# Anything exposing the buffer protocol: bytes, bytearray, memoryview, numpy arrays.
Buffer = bytes | bytearray | memoryview

_KEY_PART = re.compile(r"^[A-Za-z0-9._=+\-]+$")


@dataclass(frozen=True)
class ObjectInfo:
    """One object in a store.

    Attributes:
        key: the object's key relative to the store root (``/``-separated).
        size: its length in bytes.
        mtime: last modification time, seconds since the epoch (0.0 when the store has none).
    """

    key: str
    size: int
    mtime: float


def validate_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key, else raise :class:`UnsafeManifestError`.

    Keys come from manifests, which may come from an untrusted source, so they must never
    escape the store: no absolute paths, no ``..``, no URL schemes, no backslashes, no empty
    or dot-only parts, only a conservative character set.
    """
    if not isinstance(key, str) or not key:
        raise UnsafeManifestError(f"storage key {key!r} is empty or not a string")
    if key.startswith("/") or "\\" in key or "://" in key or ":" in key:
        raise UnsafeManifestError(
            f"storage key {key!r} is absolute or names a scheme; keys must be relative "
            "paths inside the checkpoint root"
        )
    for part in key.split("/"):
        if part in ("", ".", "..") or not _KEY_PART.match(part):
            raise UnsafeManifestError(
                f"storage key {key!r} has an unsafe part {part!r}; keys may only contain "
                "letters, digits and ._=+- between single slashes, and never '..'"
            )
    return key


@runtime_checkable
class Storage(Protocol):
    """A flat namespace of immutable byte objects under one root.

    Keys are relative, ``/``-separated and pass :func:`validate_key`. Backends translate
    their native errors into :mod:`stalwart.errors` (``ObjectNotFoundError``,
    ``StorageFullError``, ``StoragePermissionError``, ``TransientStorageError``,
    ``StorageError``) at this boundary.
    """

    url: str
    """Where the store lives, as a user would type it (a path or an fsspec URL)."""

    def write(self, key: str, data: Iterable[Buffer]) -> int:
        """Write the object ``key`` from consecutive buffers, atomically and durably.

        Returns the number of bytes written. An existing object is replaced atomically.
        On failure nothing is left under ``key`` (a temporary may be cleaned up later).
        """
        ...

    def read_into(self, key: str, offset: int, out: memoryview) -> int:
        """Read up to ``len(out)`` bytes at ``offset`` into ``out``; return how many were read.

        Fewer bytes than asked means the object ends early (the caller decides whether that
        is truncation). Raises ``ObjectNotFoundError`` when the key does not exist.
        """
        ...

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        """Read ``length`` bytes at ``offset`` (to the end when ``None``)."""
        ...

    def delete(self, key: str) -> None:
        """Delete ``key``; deleting a missing key is not an error."""
        ...

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """List objects whose key starts with ``prefix`` (a folder like ``manifests/``)."""
        ...

    def close(self) -> None:
        """Release connections and thread pools; the store must not be used afterwards."""
        ...


@runtime_checkable
class ReadsViews(Protocol):
    """A store that lends bytes without a copy of its own (``LocalStorage``).

    Readers use it when present (one read into a reused buffer, checked before it is copied
    where it belongs) and fall back to ``Storage.read_into`` otherwise.
    """

    def read_view(self, key: str, offset: int, length: int) -> AbstractContextManager[memoryview]:
        """Bytes ``[offset, offset + length)`` of ``key``, valid inside the ``with`` only."""
        ...


@runtime_checkable
class ReadsInOrder(Protocol):
    """A store whose reads of one object run fastest in order, through one open handle (a
    file on this host: the kernel reads ahead of one descriptor's sequential reads, and a
    descriptor opened per read, or reads issued out of order by several threads, defeat it).

    Loads read each object's ranges in order, one thread per object, inside ``hold_open``.
    """

    def hold_open(self, key: str) -> AbstractContextManager[None]:
        """Reads of ``key`` inside the ``with`` share one open handle (nested: counted)."""
        ...


@runtime_checkable
class RemovesStaleTemps(Protocol):
    """A store whose interrupted writes can leave temporaries behind (files on a disk).

    Garbage collection calls it after deleting unreferenced packs.
    """

    def remove_stale_temps(self, older_than_s: float) -> int:
        """Delete temporaries no live writer holds, older than ``older_than_s``; count them."""
        ...


@runtime_checkable
class ReadsLeaveHost(Protocol):
    """A store that says whether reading it fetches bytes from another machine (object stores).

    Distributed loads share such reads inside a host (each byte fetched once per host, then
    handed between its ranks); a store without it counts as local, where the page cache
    already reads each byte once per host.
    """

    @property
    def reads_leave_host(self) -> bool:
        """True when every read reaches another machine, for every rank anew."""
        ...


@runtime_checkable
class WritesUnsynced(Protocol):
    """A store whose durable ``write`` pays for a flush (``fsync`` on a disk) that it can skip.

    For records that only matter while the process that wrote them runs, so that losing them
    in a crash of the host loses nothing (a lease: it protects a read or save in flight, which
    the crash ends anyway). Leases use it when present and ``Storage.write`` otherwise.
    """

    def write_unsynced(self, key: str, data: Iterable[Buffer]) -> int:
        """``Storage.write``, atomic and visible to other readers as before, but not durable."""
        ...
