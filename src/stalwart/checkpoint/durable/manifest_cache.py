"""Parsed manifests, cached only while they match what is on the store.

Another process may replace or delete a step at any time (a second writer on the same root, a
restarted job whose old self still runs, ``stalwart ckpt rm``), so retention, garbage
collection, dedup and load must act on the manifest as stored, never on a copy cached earlier.
Parsing is the cost worth saving, so the cache keys each parse by a digest of the bytes it
came from and checks the stored bytes before every use:

* by default the manifest is read again and its digest compared (one small read, no parse);
* given the step's entry of a listing made *before* the call (size and mtime), an unchanged
  manifest is not even read, provided it was last read more than ``RACY_S`` seconds after its
  mtime. A replacement is a new file renamed into place, so it gets a newer mtime; only a
  replacement within the same timestamp tick as the original could share it, and waiting
  ``RACY_S`` past the mtime rules that out (Git's "racily clean" rule). Stores that report no
  mtime always take the read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import xxhash

from stalwart.checkpoint.durable.manifest import Manifest, manifest_key
from stalwart.errors import CorruptCheckpointError
from stalwart.storage.base import ObjectInfo, Storage

__all__ = ["RACY_S", "ManifestCache"]

RACY_S = 2.0
"""Seconds after its mtime before a (size, mtime) match alone vouches for a manifest."""


@dataclass(frozen=True)
class _Entry:
    digest: bytes
    identity: tuple[int, float] | None  # (size, mtime) from a listing made before the read
    read_unix: float  # when the bytes were read (taken just before the read)
    manifest: Manifest


class ManifestCache:
    """Parsed manifests by step, each verified against the store before it is returned."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}

    def get(
        self,
        store: Storage,
        step: int,
        *,
        listed: ObjectInfo | None = None,
    ) -> Manifest:
        """The manifest of ``step`` as stored now.

        Args:
            store: where the manifest lives.
            step: the step.
            listed: the step's entry in a listing made before this call, if any.

        Raises:
            ObjectNotFoundError: the step has no manifest (forgotten here too).
            CorruptCheckpointError: the manifest is damaged or claims another step.
        """
        e = self._entries.get(step)
        identity = (listed.size, listed.mtime) if listed is not None and listed.mtime else None
        if e and identity and e.identity == identity and e.read_unix - identity[1] > RACY_S:
            return e.manifest
        key = manifest_key(step)
        read_unix = time.time()
        try:
            data = store.read(key)
        except FileNotFoundError:
            self.forget(step)
            raise
        digest = xxhash.xxh3_128_digest(data)
        if e is not None and e.digest == digest:
            m = e.manifest
        else:
            m = Manifest.from_bytes(data, where=f"{store.url}/{key}")
            if m.step != step:
                raise CorruptCheckpointError(f"{store.url}/{key} claims step {m.step}, not {step}")
        self._entries[step] = _Entry(digest, identity, read_unix, m)
        return m

    def adopt(self, step: int, data: bytes, manifest: Manifest) -> None:
        """Remember ``manifest``, which this process just wrote as exactly ``data``.

        Still checked against the store at every use (a second writer may replace it).
        """
        self._entries[step] = _Entry(xxhash.xxh3_128_digest(data), None, 0.0, manifest)

    def forget(self, step: int) -> None:
        """Drop ``step`` (deleted, or about to be)."""
        self._entries.pop(step, None)

    def keep_only(self, steps: set[int]) -> None:
        """Drop every step not in ``steps``."""
        for s in [s for s in self._entries if s not in steps]:
            del self._entries[s]

    def clear(self) -> None:
        """Drop everything (the root was deleted)."""
        self._entries.clear()
