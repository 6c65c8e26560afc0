"""The pointer file :class:`~stalwart.integrations.lightning.StalwartCheckpointIO` writes at
Lightning's checkpoint path: its format, reading, atomic writing, and where its root is.

**Format (version 2).** Three short lines of guard, then one JSON object::

    ctorch
    device
    (U~stalwart pointer, not a torch.save file: call ...install_loader() first, ...tR.
    {"stalwart.lightning.pointer": 2, "root": "stalwart", "step": 7, "global_step": 16, ...}

The guard is a pickle that ``torch.load`` runs up to ``torch.device(<the message>)`` (an
allow-listed call, with or without ``weights_only``), so a process that loads the pointer
without stalwart's loader (``MyModule.load_from_checkpoint`` before
:func:`~stalwart.integrations.lightning.install_loader`) fails with
``RuntimeError: Invalid device string: 'stalwart pointer, ...: call ...install_loader()
first ...'`` rather than torch's advice to unpickle the file with ``weights_only=False``.
Nothing in it runs code: the payload is the JSON line.

``root`` is relative to the pointer file's folder (``stalwart`` for the default root beside the
checkpoints), so a copied or renamed run folder still loads; a URL (``s3://...``) stays as is.
Version 1 pointers (plain JSON, an absolute ``root``) are still read.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from typing import Any

from stalwart.errors import CheckpointNotFoundError, CorruptCheckpointError

__all__ = ["POINTER_KEY", "is_pointer", "missing_root", "read_pointer", "write_pointer"]

POINTER_KEY = "stalwart.lightning.pointer"
POINTER_VERSION = 2
_MAX_POINTER_BYTES = 1 << 16
GUARD_MESSAGE = (
    "stalwart pointer, not a torch.save file: call "
    "stalwart.integrations.lightning.install_loader() first, or read_checkpoint(path)"
)
# protocol-0 GLOBAL torch.device, MARK, SHORT_BINSTRING (one length byte: 32..126 keeps the
# file printable ASCII), TUPLE, REDUCE, STOP.
assert 32 <= len(GUARD_MESSAGE) <= 126
GUARD = b"ctorch\ndevice\n(U" + bytes([len(GUARD_MESSAGE)]) + GUARD_MESSAGE.encode() + b"tR.\n"


def is_pointer(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a local file that starts like a stalwart pointer (any version)."""
    text = os.fspath(path)
    if "://" in text or not os.path.isfile(text):
        return False
    with open(text, "rb") as f:
        head = f.read(len(GUARD) + 256)
    if head.startswith(GUARD):
        return True
    return head.lstrip().startswith(b"{") and POINTER_KEY.encode() in head


def read_pointer(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The pointer at ``path`` with its ``root`` made absolute (a URL stays as is).

    Returns:
        The pointer, or None when ``path`` holds something else (a ``torch.save`` file).

    Raises:
        CheckpointNotFoundError: ``path`` does not exist.
        CorruptCheckpointError: ``path`` starts like a pointer but is damaged.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            head = f.read(_MAX_POINTER_BYTES + 1)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"checkpoint {path} does not exist; check the path") from None
    body = head.removeprefix(GUARD)
    if body is head and not head.lstrip().startswith(b"{"):
        return None
    try:
        ptr = json.loads(body)
    except ValueError as e:
        raise CorruptCheckpointError(f"{path} is a damaged stalwart pointer file ({e})") from e
    if not (isinstance(ptr, dict) and isinstance(ptr.get(POINTER_KEY), int)):
        raise CorruptCheckpointError(f"{path} is JSON but not a stalwart pointer file")
    if not (isinstance(ptr.get("root"), str) and isinstance(ptr.get("step"), int)):
        raise CorruptCheckpointError(f"{path}: pointer lacks a root or a step: {ptr!r}")
    root = ptr["root"]
    if "://" not in root and not os.path.isabs(root):
        ptr["root"] = os.path.normpath(os.path.join(_folder(path), root))
    return ptr


def write_pointer(path: str, ptr: dict[str, Any]) -> None:
    """Write ``ptr`` (its ``root`` absolute or a URL) to ``path`` atomically (temp, fsync,
    rename), with the guard and the root relative to ``path``'s folder."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    root = ptr["root"]
    if "://" not in root:
        with contextlib.suppress(ValueError):  # another drive (Windows): stays absolute
            root = os.path.relpath(root, os.path.dirname(os.path.abspath(path)))
    doc = {POINTER_KEY: POINTER_VERSION, **ptr, "root": root}
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(GUARD + json.dumps(doc).encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def missing_root(path: str | os.PathLike[str], ptr: dict[str, Any]) -> str | None:
    """Why ``ptr``'s root cannot be read, as a message for the user; None when it exists
    (or is a URL, which the store itself checks)."""
    root = ptr["root"]
    if "://" in root or os.path.isdir(root):
        return None
    return (
        f"the stalwart root {root} does not exist; that path came from the pointer file "
        f"{os.fspath(path)}. If the run folder was moved or copied without its root, copy the "
        "root back beside the pointer (or point at it: read_checkpoint(path, root=...)); a "
        "pointer written before stalwart stored relative roots names the old absolute root"
    )


def _folder(path: str) -> str:
    """The folder a relative root is resolved from: the real file's, for a symlinked pointer."""
    real = os.path.realpath(path) if os.path.islink(path) else os.path.abspath(path)
    return os.path.dirname(real)
