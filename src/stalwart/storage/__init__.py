"""Byte stores behind one small Protocol, and :func:`open_storage` to pick one by location.

``LocalStorage`` (plain paths, ``file://``) stays on ``os`` for speed; ``MemoryStorage``
(``memory://name``) is in-process; every other scheme goes through ``FsspecStorage``, which imports
fsspec and its backend only when such a URL is opened, so importing stalwart never does.
"""

from __future__ import annotations

import os
from typing import Any

from stalwart.errors import ConfigError
from stalwart.storage.base import Buffer, ObjectInfo, Storage, validate_key
from stalwart.storage.fsspec_storage import FsspecStorage
from stalwart.storage.local import LocalStorage
from stalwart.storage.memory import MemoryStorage
from stalwart.storage.retry import RetryPolicy

__all__ = [
    "Buffer",
    "FsspecStorage",
    "LocalStorage",
    "MemoryStorage",
    "ObjectInfo",
    "RetryPolicy",
    "Storage",
    "open_storage",
    "validate_key",
]


def open_storage(
    location: str | os.PathLike[str] | Storage,
    *,
    storage_options: dict[str, Any] | None = None,
    create: bool = True,
) -> Storage:
    """Return the store for ``location``.

    Args:
        location: a ``Storage`` (returned as is), a local path or ``file://`` URL
            (``LocalStorage``), ``memory://name`` (``MemoryStorage``), or any other fsspec URL
            such as ``s3://bucket/prefix`` (``FsspecStorage``).
        storage_options: filesystem options for fsspec URLs (credentials, endpoint, ...).
        create: create a missing local root; when ``False`` a missing root raises.

    Raises:
        ConfigError: the scheme is unknown, its backend is not installed, or options were
            given for a backend that takes none.
        ObjectNotFoundError: a local root is missing and ``create`` is ``False``.
    """
    if isinstance(location, Storage) and not isinstance(location, str | os.PathLike):
        return location
    if isinstance(location, os.PathLike):
        location = os.fspath(location)
    if not isinstance(location, str):
        raise ConfigError(
            f"storage location must be a path, a URL or a Storage, got {type(location).__name__}"
        )
    scheme, sep, rest = location.partition("://")
    if not sep:
        return LocalStorage(location, create=create)
    scheme = scheme.lower()
    if scheme in ("file", "local"):
        return LocalStorage(rest, create=create)
    if scheme == "memory":
        if storage_options:
            raise ConfigError(f"memory:// storage takes no storage_options, got {storage_options}")
        return MemoryStorage(rest.strip("/"))
    return FsspecStorage(location, storage_options=storage_options)
