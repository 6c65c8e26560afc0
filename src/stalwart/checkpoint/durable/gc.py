"""Retention and garbage collection, safe while other processes read or write.

Deleting a checkpoint deletes its manifest only (the un-commit); its pack files become
garbage once no manifest references them. Collection deletes an unreferenced pack only when

* it is older than ``grace_s`` (a save in flight elsewhere writes packs before its manifest
  exists, and those packs must survive until it commits), and
* no live *lease* names it. A reader takes a lease on the packs of the step it loads, and a
  writer on the packs it deduplicates against, for ``lease_s`` seconds; retention also keeps
  the manifests of leased steps until the lease ends.

Leases are small JSON objects under ``leases/``; an expired lease is ignored and removed.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from stalwart.checkpoint.durable.manifest import (
    MANIFEST_PREFIX,
    Manifest,
    manifest_key,
    step_from_key,
)
from stalwart.checkpoint.policy import RetentionPolicy
from stalwart.errors import CorruptCheckpointError, ObjectNotFoundError, StoragePermissionError
from stalwart.storage.base import Storage

__all__ = ["GCReport", "Lease", "apply_retention", "collect_garbage", "read_leases"]

log = logging.getLogger(__name__)
LEASE_PREFIX = "leases/"
PACK_PREFIX = "packs/"


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
        }
        self.held = False

    def __enter__(self) -> Lease:
        try:
            self.storage.write(self.key, [json.dumps(self.doc).encode()])
            self.held = True
        except StoragePermissionError:
            # A read-only location (a published checkpoint) cannot be garbage collected by
            # us either; reading it without a lease is safe from our own GC.
            log.info("read-only store %s: reading without a lease", self.storage.url)
            self.held = False
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.held:
            return
        try:
            self.storage.delete(self.key)
        except OSError:  # an expired lease is harmless; GC removes it
            log.warning("could not remove lease %s", self.key, exc_info=True)


@dataclass
class _Leases:
    steps: set[int] = field(default_factory=set)
    packs: set[str] = field(default_factory=set)


def read_leases(storage: Storage, *, remove_expired: bool = False) -> _Leases:
    """Union of the steps and packs named by live leases."""
    live = _Leases()
    now = time.time()
    for info in storage.list(LEASE_PREFIX):
        try:
            doc = json.loads(storage.read(info.key))
            expires = float(doc["expires_unix"])
        except (ObjectNotFoundError, ValueError, KeyError, TypeError):
            continue  # released meanwhile, or garbage
        if expires < now:
            if remove_expired:
                storage.delete(info.key)
            continue
        live.steps.update(int(s) for s in doc.get("steps", []))
        live.packs.update(str(p) for p in doc.get("packs", []))
    return live


@dataclass
class GCReport:
    """What retention and collection did.

    Attributes:
        deleted_steps: steps whose manifests were deleted by retention.
        deleted_packs: pack keys removed.
        bytes_freed: bytes of the removed packs.
        kept_packs: packs still referenced, leased or too young.
    """

    deleted_steps: list[int] = field(default_factory=list)
    deleted_packs: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    kept_packs: int = 0


def collect_garbage(
    storage: Storage, *, grace_s: float, report: GCReport | None = None
) -> GCReport:
    """Delete pack files no committed manifest or live lease references.

    Raises:
        CorruptCheckpointError: a manifest cannot be parsed; nothing is deleted, since the
            packs it references cannot be known. Delete or repair that step first.
    """
    report = report or GCReport()
    referenced: set[str] = set()
    for info in storage.list(MANIFEST_PREFIX):
        if step_from_key(info.key) is None:
            continue
        try:
            data = storage.read(info.key)
        except ObjectNotFoundError:
            continue  # deleted meanwhile
        try:
            referenced |= Manifest.from_bytes(data, where=info.key).packs()
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(
                f"garbage collection stopped without deleting anything: {e}. Remove the "
                f"damaged manifest ({info.key}) with `stalwart ckpt verify` / delete, then retry"
            ) from e
    leased = read_leases(storage, remove_expired=True).packs
    now = time.time()
    for info in storage.list(PACK_PREFIX):
        if info.key in referenced or info.key in leased or now - info.mtime < grace_s:
            report.kept_packs += 1
            continue
        storage.delete(info.key)
        report.deleted_packs.append(info.key)
        report.bytes_freed += info.size
    remove_temps = getattr(storage, "remove_stale_temps", None)
    if callable(remove_temps):
        remove_temps(grace_s)
    return report


def apply_retention(
    store: Storage,
    policy: RetentionPolicy,
    steps: list[int],
    manifest: Callable[[int], Manifest],
) -> GCReport:
    """Delete the steps ``policy`` does not keep (unless leased) and packs only they used.

    Packs of deleted steps were committed, so no save in flight is writing them: they go at
    once, without the grace period that protects never-committed packs. With a damaged
    manifest among ``steps`` nothing is deleted (its references are unknown).
    """
    report = GCReport()
    keep = set(policy.keep(steps))
    leases = read_leases(store)
    doomed = [s for s in steps if s not in keep and s not in leases.steps]
    if not doomed:
        return report
    kept_packs: set[str] = set(leases.packs)
    doomed_packs: set[str] = set()
    for s in steps:
        try:
            packs = manifest(s).packs()
        except CorruptCheckpointError:
            return report  # unknown references: delete nothing (gc() explains)
        (doomed_packs if s in doomed else kept_packs).update(packs)
    for s in doomed:
        store.delete(manifest_key(s))
        report.deleted_steps.append(s)
    sizes = {i.key: i.size for i in store.list("packs/")}
    for p in sorted(doomed_packs - kept_packs):
        store.delete(p)
        report.deleted_packs.append(p)
        report.bytes_freed += sizes.get(p, 0)
    log.info("retention deleted steps %s and %d packs", doomed, len(report.deleted_packs))
    return report
