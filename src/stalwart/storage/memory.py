"""An in-process byte store, for tests and for staging small objects without a disk.

Objects live in a process-global table of namespaces, like fsspec's ``memory://``: two
``MemoryStorage("x")`` instances see the same objects, so a test can save through one handle and
load through another. Each object is an immutable ``bytes`` that is swapped in under a lock, so
writes are atomic by construction; nothing is durable beyond the process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import ClassVar

from stalwart.errors import ConfigError, ObjectNotFoundError
from stalwart.storage.base import Buffer, ObjectInfo, validate_key

__all__ = ["MemoryStorage"]


class MemoryStorage:
    """Objects as ``bytes`` in a process-global namespace.

    Args:
        name: the namespace; instances with the same name share their objects.
    """

    _namespaces: ClassVar[dict[str, dict[str, tuple[bytes, float]]]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.url = f"memory://{name}"
        with self._lock:
            self._objects = self._namespaces.setdefault(name, {})

    def __repr__(self) -> str:
        return f"MemoryStorage({self.name!r})"

    @classmethod
    def clear_namespace(cls, name: str) -> None:
        """Drop every object in namespace ``name`` (live instances see it empty)."""
        with cls._lock:
            objects = cls._namespaces.get(name)
            if objects is not None:
                objects.clear()

    def _get(self, key: str) -> bytes:
        validate_key(key)
        with self._lock:
            entry = self._objects.get(key)
        if entry is None:
            raise ObjectNotFoundError(f"no object {key!r} in {self.url}")
        return entry[0]

    def write(self, key: str, data: Iterable[Buffer]) -> int:
        """Store ``key`` as the concatenation of ``data``; return its size."""
        validate_key(key)
        # Joined before taking the lock: an exception from ``data`` stores nothing.
        payload = b"".join(data)
        with self._lock:
            self._objects[key] = (payload, time.time())
        return len(payload)

    def read_into(self, key: str, offset: int, out: memoryview) -> int:
        """Copy up to ``len(out)`` bytes at ``offset`` into ``out``; return the count."""
        if offset < 0:
            raise ConfigError(f"read offset must be >= 0, got {offset}")
        data = self._get(key)
        view = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        n = max(0, min(len(view), len(data) - offset))
        view[:n] = memoryview(data)[offset : offset + n]
        return n

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        """Read ``length`` bytes at ``offset`` (to the end when ``None``)."""
        if offset < 0 or (length is not None and length < 0):
            raise ConfigError(f"read offset and length must be >= 0, got {offset}, {length}")
        data = self._get(key)
        if offset == 0 and (length is None or length >= len(data)):
            return data
        return data[offset : None if length is None else offset + length]

    def delete(self, key: str) -> None:
        """Delete ``key``; a missing key is fine."""
        validate_key(key)
        with self._lock:
            self._objects.pop(key, None)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Objects whose key starts with ``prefix``, sorted by key."""
        with self._lock:
            items = [(k, v) for k, v in self._objects.items() if k.startswith(prefix)]
        return [ObjectInfo(k, len(data), mtime) for k, (data, mtime) in sorted(items)]

    def close(self) -> None:
        """Nothing to release; the namespace outlives the handle (see ``clear_namespace``)."""
