"""Retention and garbage collection, safe while other processes read or write.

Deleting a checkpoint deletes its manifest only (the un-commit); its pack files become
garbage once no manifest references them. Collection deletes an unreferenced pack only when

* its name is one this engine gives its packs (``packs/step-<20 digits>-rank<5 digits>-
  <12 hex>.pack``): anything else under ``packs/`` was not written by stalwart and is left
  alone and reported in :attr:`GCReport.skipped`;
* no live *lease* names it. A reader takes a lease on the packs of the step it loads, and a
  writer on the packs it deduplicates against, for ``lease_s`` seconds; retention also keeps
  the manifests of leased steps until the lease ends;
* it cannot belong to a save in flight (below), and it is older than ``grace_s`` (for
  writers that take no lease).

Every decision is taken from what is on the store at that moment (manifests and leases are
read afresh), never from a copy cached in one process, because another process may have
replaced or deleted a step since. Retention re-reads leases and manifests *after* its
un-commit and before deleting packs, so a step committed or leased meanwhile keeps its packs.

Leases hold whatever the grace. Every save holds a lease from before it lists the steps it
deduplicates against until its manifest is written, so collection also keeps any pack written
after a live lease was taken (it may belong to that save) and reads in an order that leaves
no gap: packs are listed first, then leases, then manifests. A pack listed before the leases
were read was written before then; if its save's lease was gone by then, that save had
committed, and the manifests read afterwards name the pack. So ``grace_s=0`` is safe while
stalwart's own saves and loads run; the grace remains for writers that take no lease.

Leases are small JSON objects under ``leases/`` that name their owner (host, pid and pid
namespace). A lease is dead, ignored and removed when it has expired, or when its owner ran on
this host, in this pid namespace, and that process no longer exists (a killed job does not
hold retention back for ``lease_s``).

Nothing under the root may be a symbolic link (see :mod:`stalwart.storage.confine`): a
``packs/`` shared by two roots through links would let one root's collection delete the
other's packs, so the store refuses links and collection stops with an
:class:`~stalwart.errors.UnsafePathError` before deleting anything.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from stalwart.checkpoint.durable.manifest import (
    MANIFEST_PREFIX,
    Manifest,
    manifest_key,
    step_from_key,
)
from stalwart.checkpoint.policy import RetentionPolicy, kept_steps
from stalwart.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ObjectNotFoundError,
    StepRetiredError,
    StoragePermissionError,
    UnsafePathError,
)
from stalwart.storage.base import ObjectInfo, RemovesStaleTemps, Storage

__all__ = [
    "GCReport",
    "Lease",
    "apply_retention",
    "check_committed",
    "collect_garbage",
    "read_leases",
]

log = logging.getLogger(__name__)
LEASE_PREFIX = "leases/"
PACK_PREFIX = "packs/"
PACK_NAME = re.compile(r"^packs/step-\d{20}-rank\d{5}-[0-9a-f]{12}\.pack$")
"""The names :class:`~stalwart.Checkpointer` gives its packs; gc deletes no other file."""
CLOCK_SLACK_S = 2.0
"""Packs written up to this long before a live lease's file count as written after it
(file timestamps come from a coarse clock, and from the file server on a network disk)."""


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
    """Protects steps and packs from retention and GC while held (a context manager)."""

    def __init__(
        self, storage: Storage, *, steps: Iterable[int], packs: Iterable[str], lease_s: float
    ) -> None:
        self.storage = storage
        self.key = f"{LEASE_PREFIX}{uuid.uuid4().hex}.json"
        self.doc = {
            "steps": sorted(set(steps)),
            "packs": sorted(set(packs)),
            "expires_unix": time.time() + lease_s,
            "owner": _owner(),
        }
        self.held = False

    def __enter__(self) -> Lease:
        try:
            self.storage.write(self.key, [json.dumps(self.doc).encode()])
            self.held = True
        except UnsafePathError:
            raise  # a linked leases/ folder is a broken root, not a read-only one
        except StoragePermissionError:
            # A read-only location (a published checkpoint) cannot be garbage collected by
            # us either; reading it without a lease is safe from our own GC.
            log.info("read-only store %s: reading without a lease", self.storage.url)
            self.held = False
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
    steps = sorted(
        s for s in (step_from_key(i.key) for i in store.list(MANIFEST_PREFIX)) if s is not None
    )
    if not steps:
        return "the root holds no committed step now"
    shown = ", ".join(map(str, steps[-5:]))
    return f"committed steps now: {'…, ' if len(steps) > 5 else ''}{shown}"


@dataclass
class _Leases:
    steps: set[int] = field(default_factory=set)
    packs: set[str] = field(default_factory=set)
    oldest_unix: float | None = None  # when the oldest live lease was written (its mtime)

    def may_own(self, pack: ObjectInfo) -> bool:
        """True when ``pack`` was written after a live lease was taken (a save in flight)."""
        return self.oldest_unix is not None and pack.mtime >= self.oldest_unix - CLOCK_SLACK_S


def read_leases(storage: Storage, *, remove_expired: bool = False) -> _Leases:
    """Union of the steps and packs named by live leases.

    A lease is dead when it expired or when its owner, on this host, no longer runs; with
    ``remove_expired`` dead leases are deleted.
    """
    live = _Leases()
    now = time.time()
    for info in storage.list(LEASE_PREFIX):
        try:
            doc = json.loads(storage.read(info.key))
            expires = float(doc["expires_unix"])
            steps = {int(s) for s in doc.get("steps", [])}
            packs = {str(p) for p in doc.get("packs", [])}
        except (ObjectNotFoundError, ValueError, KeyError, TypeError):
            continue  # released meanwhile, or garbage (a stray name is a ValueError too)
        if expires < now or _owner_is_dead(doc.get("owner")):
            if remove_expired:
                storage.delete(info.key)
            continue
        live.steps |= steps
        live.packs |= packs
        if live.oldest_unix is None or info.mtime < live.oldest_unix:
            live.oldest_unix = info.mtime
    return live


@dataclass
class GCReport:
    """What retention and collection did.

    Attributes:
        deleted_steps: steps whose manifests were deleted by retention.
        deleted_packs: pack keys removed.
        bytes_freed: bytes of the removed packs.
        kept_packs: packs still referenced, leased, maybe a save's in flight, or too young.
        skipped: files under ``packs/`` whose names stalwart never gives a pack; left alone.
        temps_removed: temporaries of crashed writes (older than the grace, held by no live
            writer) removed.
    """

    deleted_steps: list[int] = field(default_factory=list)
    deleted_packs: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    kept_packs: int = 0
    skipped: list[str] = field(default_factory=list)
    temps_removed: int = 0


def _referenced_packs(
    storage: Storage, manifest: Callable[[int], Manifest] | None = None
) -> set[str]:
    """Packs named by the manifests on the store now (read through ``manifest`` if given).

    Raises:
        CorruptCheckpointError: a manifest cannot be parsed (its references are unknown).
    """
    referenced: set[str] = set()
    for info in storage.list(MANIFEST_PREFIX):
        step = step_from_key(info.key)
        if step is None:
            continue
        try:
            if manifest is not None:
                referenced |= manifest(step).packs()
            else:
                data = storage.read(info.key)
                referenced |= Manifest.from_bytes(data, where=info.key).packs()
        except (ObjectNotFoundError, CheckpointNotFoundError):
            continue  # deleted meanwhile
    return referenced


def collect_garbage(
    storage: Storage, *, grace_s: float, report: GCReport | None = None
) -> GCReport:
    """Delete pack files stalwart wrote that no committed manifest or live lease references.

    An unreferenced pack is kept while a live lease names it, while it may belong to a save
    in flight (it was written after a live lease was taken), and while it is younger than
    ``grace_s``. Temporaries go when older than ``grace_s`` and no live writer holds them.

    Raises:
        CorruptCheckpointError: a manifest cannot be parsed; nothing is deleted, since the
            packs it references cannot be known. Delete or repair that step first.
        UnsafePathError: a folder under the root is a symbolic link; nothing is deleted.
    """
    report = report or GCReport()
    # This order closes every gap (module docstring): packs, then leases, then manifests.
    packs = storage.list(PACK_PREFIX)
    leases = read_leases(storage, remove_expired=True)
    try:
        referenced = _referenced_packs(storage)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(
            f"garbage collection stopped without deleting anything: {e}. Remove the "
            "damaged manifest with `stalwart ckpt verify` / `stalwart ckpt rm`, then retry"
        ) from e
    now = time.time()
    for info in packs:
        if not PACK_NAME.match(info.key):
            report.skipped.append(info.key)
            continue
        if (
            info.key in referenced
            or info.key in leases.packs
            or leases.may_own(info)
            or now - info.mtime < grace_s
        ):
            report.kept_packs += 1
            continue
        storage.delete(info.key)
        report.deleted_packs.append(info.key)
        report.bytes_freed += info.size
    if report.skipped:
        log.warning(
            "gc left %d file(s) under packs/ that stalwart did not name, e.g. %r; move them "
            "out of the checkpoint root",
            len(report.skipped),
            report.skipped[0],
        )
    if isinstance(storage, RemovesStaleTemps):
        report.temps_removed = int(storage.remove_stale_temps(grace_s))
    return report


def apply_retention(
    store: Storage,
    policy: RetentionPolicy,
    steps: list[int],
    manifest: Callable[[int], Manifest],
) -> GCReport:
    """Delete the steps ``policy`` does not keep (unless leased) and packs only they used.

    ``manifest`` must read the step's manifest as it is on the store now. Packs of deleted
    steps were committed, so no save in flight is writing them: they go at once, without the
    grace period that protects never-committed packs. After the un-commit, leases and
    manifests are read again, so a pack that a step committed meanwhile (another writer's
    dedup) or a leased step uses is kept. With a damaged manifest nothing is deleted.
    """
    report = GCReport()

    def metadata(s: int) -> dict[str, str]:  # for policies that rank steps (KeepBest)
        try:
            return dict(manifest(s).metadata)
        except (CheckpointNotFoundError, CorruptCheckpointError):
            return {}  # unrankable: such a policy keeps it (or another one decides)

    keep = kept_steps(policy, steps, metadata)
    leases = read_leases(store)
    doomed = [s for s in steps if s not in keep and s not in leases.steps]
    if not doomed:
        return report
    packs_of: dict[int, set[str]] = {}
    for s in steps:
        try:
            packs_of[s] = manifest(s).packs()
        except CheckpointNotFoundError:
            continue  # another process deleted it meanwhile
        except CorruptCheckpointError:
            return report  # unknown references: delete nothing (gc() explains)
    for s in doomed:
        if s in packs_of:
            store.delete(manifest_key(s))
            report.deleted_steps.append(s)
    # Re-read what is on the store after the un-commit: whoever committed or leased since
    # our first look keeps its packs (a writer leases the steps it reads before using them).
    leases = read_leases(store)
    try:
        kept = _referenced_packs(store, manifest) | leases.packs
    except CorruptCheckpointError:
        return report
    for s in leases.steps:
        kept |= packs_of.get(s, set())
    doomed_packs = set().union(*(packs_of.get(s, set()) for s in report.deleted_steps))
    sizes = {i.key: i.size for i in store.list(PACK_PREFIX)}
    for p in sorted(doomed_packs - kept):
        store.delete(p)
        report.deleted_packs.append(p)
        report.bytes_freed += sizes.get(p, 0)
    log.info(
        "retention deleted steps %s and %d packs", report.deleted_steps, len(report.deleted_packs)
    )
    return report
