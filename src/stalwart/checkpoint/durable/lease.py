"""Leases: records under ``leases/`` that hold steps and packs back from retention and GC.

A reader takes a lease on the step it loads and its packs; a writer on the steps it lists
and the packs it deduplicates against, from before it lists them until its manifest is
written. Each lease lasts ``lease_s`` seconds. :func:`read_leases` is what retention and
collection (:mod:`.gc`) see: the union of the live ones, and when the oldest was taken (a pack
written after that may belong to a save in flight).

A lease is a small JSON object (``steps``, ``packs``, ``expires_unix``, ``owner``: host, pid
and pid namespace). It is dead, ignored and removed when it has expired, or when its owner ran
on this host, in this pid namespace, and that process no longer exists (a killed job does not
hold retention back for ``lease_s``). Expiry is read from a :data:`Clock`: ``time.time`` by
default; a test passes a fake one and advances it instead of sleeping until a lease ends.

A read goes ahead without its lease where none can be written: on a read-only store (our own
gc cannot run there either) and on a full one (a full disk must not lock the user out of
every checkpoint; a warning, once per store, says that gc may then race the read). A writer's
lease has no such way out: a save that cannot write its lease cannot write its packs either.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from stalwart.checkpoint.durable.manifest import Manifest, committed_manifests, manifest_key
from stalwart.errors import (
    CorruptCheckpointError,
    ObjectNotFoundError,
    StepRetiredError,
    StorageFullError,
    StoragePermissionError,
    UnsafePathError,
)
from stalwart.storage.base import ObjectInfo, Storage, WritesUnsynced

__all__ = ["Clock", "Lease", "LiveLeases", "check_committed", "read_leases"]

log = logging.getLogger(__name__)
LEASE_PREFIX = "leases/"
Clock = Callable[[], float]
"""Wall time in seconds since the epoch, as ``time.time`` gives it (leases compare across hosts)."""
UNREADABLE_S = 3600.0
"""A lease that does not parse is removed (by a reader asked to remove dead ones) once its
file is this old: leases are not flushed, so a crash of the host may leave one empty."""
CLOCK_SLACK_S = 2.0
"""Packs written up to this long before a live lease's file count as written after it
(file timestamps come from a coarse clock, and from the file server on a network disk)."""
_WARNED_FULL: set[str] = set()  # stores whose readers were told once that they read unleased


def _owner() -> dict[str, Any]:
    """Who holds a lease: enough to tell, on the same host, whether that process still runs."""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    return {"host": socket.gethostname(), "pid": os.getpid(), "pidns": pidns}


def _owner_is_dead(owner: Any) -> bool:
    """True only when ``owner`` provably ran on this host and pid namespace and is gone."""
    if not isinstance(owner, dict) or not isinstance(owner.get("pid"), int):
        return False
    me = _owner()
    if owner.get("host") != me["host"] or owner.get("pidns") != me["pidns"] or not me["pidns"]:
        return False  # another machine or container: only expiry can tell
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists but belongs to someone else: alive
        return False
    return False


class Lease:
    """Protects steps and packs from retention and GC while held (a context manager).

    It expires ``lease_s`` seconds after it is made, by ``clock``.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        steps: Iterable[int],
        packs: Iterable[str],
        lease_s: float,
        clock: Clock = time.time,
        reading: bool = False,
    ) -> None:
        self.storage = storage
        self.key = f"{LEASE_PREFIX}{uuid.uuid4().hex}.json"
        self.doc = {
            "steps": sorted(set(steps)),
            "packs": sorted(set(packs)),
            "expires_unix": clock() + lease_s,
            "owner": _owner(),
            "reading": reading,  # a load or verify of ``steps`` (a save only dedups against them)
        }
        self.held = False

    def __enter__(self) -> Lease:
        # Not flushed where the store can skip it: a crash that loses the lease also ends what
        # it protects (4 ranks loading at once on one disk: 3-12 ms each, on the load's path).
        store = self.storage
        write = store.write_unsynced if isinstance(store, WritesUnsynced) else store.write
        try:
            write(self.key, [json.dumps(self.doc).encode()])
            self.held = True
        except UnsafePathError:
            raise  # a linked leases/ folder is a broken root, not a read-only one
        except StoragePermissionError:
            # A read-only location (a published checkpoint) cannot be garbage collected by
            # us either; reading it without a lease is safe from our own GC.
            log.info("read-only store %s: reading without a lease", self.storage.url)
            self.held = False
        except StorageFullError:
            if not self.doc["reading"]:
                raise  # a save: its packs would not fit either
            self.held = False
            _warn_full(store.url)
        return self

    def check_committed(self, m: Manifest, where: str, *, deep: bool = False) -> None:
        """:func:`check_committed` of ``m`` on this lease's store (call it once held)."""
        check_committed(self.storage, m, where, deep=deep)

    def __exit__(self, *exc: object) -> None:
        if not self.held:
            return
        try:
            self.storage.delete(self.key)
        except OSError:  # an expired lease is harmless; GC removes it
            log.warning("could not remove lease %s", self.key, exc_info=True)


def _warn_full(url: str) -> None:
    if url in _WARNED_FULL:
        return
    _WARNED_FULL.add(url)
    log.warning(
        "%s is full: loads read it without a lease until it has room again, so a gc or "
        "retention running meanwhile may delete a step being read (that load then fails as "
        "retired: load another step; never wrong data). Free space to read under leases",
        url,
    )


def check_committed(store: Storage, m: Manifest, where: str, *, deep: bool = False) -> None:
    """Raise :class:`StepRetiredError` unless ``m``'s step is still committed on ``store``.

    A reader calls it once its lease is written: retention and gc keep the step's packs from
    then on, but may have retired the step between the reader's manifest read and its lease.
    With ``deep`` (when a pack turned out missing) the stored manifest must also be ``m``
    itself, not a replacement saved meanwhile; a damaged stored manifest passes, so that the
    caller reports the damage.
    """
    key = manifest_key(m.step)
    try:
        data = store.read(key) if deep else store.read(key, 0, 1)
    except ObjectNotFoundError:
        raise StepRetiredError(
            f"{where}: step {m.step} was deleted while it was being loaded (retention or "
            f"`ckpt rm`); load another step: {_committed(store)}"
        ) from None
    if not deep:
        return
    try:
        stored = Manifest.from_bytes(data, where=key)
    except CorruptCheckpointError:
        return
    if stored != m:
        raise StepRetiredError(
            f"{where}: step {m.step} was replaced by another save while it was being loaded, "
            "and the packs of the copy being read were collected; load the step again"
        )


def _committed(store: Storage) -> str:
    steps = list(committed_manifests(store))
    if not steps:
        return "the root holds no committed step now"
    shown = ", ".join(map(str, steps[-5:]))
    return f"committed steps now: {'…, ' if len(steps) > 5 else ''}{shown}"


@dataclass
class LiveLeases:
    """What the live leases on a store hold: their steps and packs, and when the oldest began."""

    steps: set[int] = field(default_factory=set)
    packs: set[str] = field(default_factory=set)
    read_steps: set[int] = field(default_factory=set)  # steps a load or verify is reading
    oldest_unix: float | None = None  # when the oldest live lease was written (its mtime)

    def add(self, other: LiveLeases) -> None:
        """Count ``other``'s leases too (those of a later read of ``leases/``)."""
        self.steps |= other.steps
        self.packs |= other.packs
        self.read_steps |= other.read_steps
        if other.oldest_unix is not None and (
            self.oldest_unix is None or other.oldest_unix < self.oldest_unix
        ):
            self.oldest_unix = other.oldest_unix

    def may_own(self, pack: ObjectInfo) -> bool:
        """True when ``pack`` was written after a live lease was taken (a save in flight)."""
        return self.oldest_unix is not None and pack.mtime >= self.oldest_unix - CLOCK_SLACK_S


def read_leases(
    storage: Storage, *, remove_expired: bool = False, clock: Clock = time.time
) -> LiveLeases:
    """Union of the steps and packs named by live leases.

    A lease is dead when it expired (by ``clock``) or when its owner, on this host, no longer
    runs; with ``remove_expired`` dead leases are deleted, and so are leases that do not parse
    once :data:`UNREADABLE_S` old (one being written is never visible half-written: the rename
    is atomic).
    """
    live = LiveLeases()
    now = clock()
    for info in storage.list(LEASE_PREFIX):
        try:
            doc = json.loads(storage.read(info.key))
            expires = float(doc["expires_unix"])
            steps = {int(s) for s in doc.get("steps", [])}
            packs = {str(p) for p in doc.get("packs", [])}
        except ObjectNotFoundError:
            continue  # released meanwhile
        except (ValueError, KeyError, TypeError):  # garbage (a stray name is a ValueError too)
            if remove_expired and now - info.mtime > UNREADABLE_S:
                storage.delete(info.key)
            continue
        if expires < now or _owner_is_dead(doc.get("owner")):
            if remove_expired:
                storage.delete(info.key)
            continue
        live.steps |= steps
        live.packs |= packs
        if doc.get("reading") is True:
            live.read_steps |= steps
        if live.oldest_unix is None or info.mtime < live.oldest_unix:
            live.oldest_unix = info.mtime
    return live
