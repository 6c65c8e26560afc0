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
no gap: packs are listed first, then leases, then manifests, then leases again, and last the
manifests' listing once more. A pack listed before the leases were read was written before
then; if its save's lease was gone by then, that save had committed, and the manifests read
afterwards name the pack. The second read of the leases sees the pack leases that saves took
while the manifests were read (a save leases the packs it deduplicates against only once it
has read the manifests naming them, and drops those a step replaced meanwhile no longer
names: see ``Saver``); the last listing sees a save that took its leases after the first read
and committed before the second, whose manifest the first read missed: the reads then start
again. So ``grace_s=0`` is safe while stalwart's own saves and loads run; the grace remains
for writers that take no lease.

Temporaries of dead writers go too (:mod:`stalwart.storage.temps`): one whose writer claimed
it goes as soon as its lock is free, whatever its age and the grace, so the pack a killed save
was writing frees its space at the next collection; their bytes count in ``bytes_freed``.

What a lease is, and when one is live, is :mod:`.lease`'s. :func:`collect_garbage` reads
lease expiry and pack age from its ``clock`` (``time.time`` unless a test passes a fake one).

Nothing under the root may be a symbolic link (see :mod:`stalwart.storage.confine`): a
``packs/`` shared by two roots through links would let one root's collection delete the
other's packs, so the store refuses links and collection stops with an
:class:`~stalwart.errors.UnsafePathError` before deleting anything.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from stalwart.checkpoint.durable.lease import Clock, LiveLeases, read_leases
from stalwart.checkpoint.durable.manifest import Manifest, committed_manifests, manifest_key
from stalwart.checkpoint.policy import RetentionPolicy, kept_steps
from stalwart.errors import CheckpointNotFoundError, CorruptCheckpointError, ObjectNotFoundError
from stalwart.storage.base import ObjectInfo, RemovesStaleTemps, Storage
from stalwart.storage.temps import RemovedTemps

__all__ = ["GCReport", "apply_retention", "collect_garbage", "discard_uncommitted", "retire"]

log = logging.getLogger(__name__)
PACK_PREFIX = "packs/"
PACK_NAME = re.compile(r"^packs/step-\d{20}-rank\d{5}-[0-9a-f]{12}\.pack$")
"""The names :class:`~stalwart.Checkpointer` gives its packs; gc deletes no other file."""
READ_ATTEMPTS = 3
"""Reads of leases and manifests a collection starts before it gives up for this time, when
saves keep committing while it reads (each commit between two reads starts them again)."""


@dataclass
class GCReport:
    """What retention and collection did.

    Attributes:
        deleted_steps: steps whose manifests were deleted by retention.
        deleted_packs: pack keys removed.
        bytes_freed: bytes of the removed packs and temporaries.
        kept_packs: packs still referenced, leased, maybe a save's in flight, or too young.
        skipped: files under ``packs/`` whose names stalwart never gives a pack; left alone.
        temps_removed: temporaries of dead writers removed: held by no live writer, and
            (unless their writer claimed them) older than the grace.
        temps_bytes_freed: the part of ``bytes_freed`` those temporaries held.
    """

    deleted_steps: list[int] = field(default_factory=list)
    deleted_packs: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    kept_packs: int = 0
    skipped: list[str] = field(default_factory=list)
    temps_removed: int = 0
    temps_bytes_freed: int = 0


def _referenced_packs(
    storage: Storage,
    manifest: Callable[[int], Manifest] | None = None,
    listed: dict[int, ObjectInfo] | None = None,
) -> set[str]:
    """Packs named by the manifests on the store now (read through ``manifest`` if given), or
    by those of ``listed`` (a listing made before the call).

    Raises:
        CorruptCheckpointError: a manifest cannot be parsed (its references are unknown).
    """
    referenced: set[str] = set()
    listed = committed_manifests(storage) if listed is None else listed
    for step, info in listed.items():
        try:
            if manifest is not None:
                referenced |= manifest(step).packs()
            else:
                data = storage.read(info.key)
                referenced |= Manifest.from_bytes(data, where=info.key).packs()
        except (ObjectNotFoundError, CheckpointNotFoundError):
            continue  # deleted meanwhile
    return referenced


def _in_use(storage: Storage, clock: Clock) -> tuple[LiveLeases, set[str]] | None:
    """The live leases and the packs the manifests name, read in the order that misses no
    save (module docstring); None (and a warning) when no pack may go this time.

    A live lease may name a step whose manifest is gone: a writer leases the steps it lists,
    then reads their manifests and deduplicates against their packs, so a step deleted in
    between (``ckpt rm``) leaves packs that only that writer knows it will reference, and no
    pack may go until its lease ends.

    Raises:
        CorruptCheckpointError: a manifest cannot be parsed.
    """
    for _ in range(READ_ATTEMPTS):
        leases = read_leases(storage, remove_expired=True, clock=clock)
        listed = committed_manifests(storage)
        referenced = _referenced_packs(storage, listed=listed)
        leases.add(read_leases(storage, clock=clock))  # pack leases taken meanwhile
        if committed_manifests(storage) != listed:
            continue  # a save committed meanwhile: its lease may have come and gone unseen
        retired = leases.steps - set(listed)
        if not retired:
            return leases, referenced
        log.warning(
            "gc deleted no pack: step(s) %s were deleted while a live lease named them (a "
            "save deduplicating against them, or a load); run gc again once it has finished",
            sorted(retired),
        )
        return None
    log.warning(
        "gc deleted no pack: saves committed while it read the manifests, %d times in a row; "
        "run gc again",
        READ_ATTEMPTS,
    )
    return None


def collect_garbage(
    storage: Storage, *, grace_s: float, report: GCReport | None = None, clock: Clock = time.time
) -> GCReport:
    """Delete pack files stalwart wrote that no committed manifest or live lease references.

    An unreferenced pack is kept while a live lease names it, while it may belong to a save
    in flight (it was written after a live lease was taken), and while it is younger than
    ``grace_s``. Temporaries go once no live writer holds them: at once when their writer
    claimed them, else once older than ``grace_s``. ``clock`` tells which leases expired and
    how old a pack is.

    Raises:
        CorruptCheckpointError: a manifest cannot be parsed; nothing is deleted, since the
            packs it references cannot be known. Delete or repair that step first.
        UnsafePathError: a folder under the root is a symbolic link; nothing is deleted.
    """
    report = report or GCReport()
    packs = storage.list(PACK_PREFIX)  # first: see the module docstring
    try:
        in_use = _in_use(storage, clock)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(
            f"garbage collection stopped without deleting anything: {e}. Find the damaged "
            "step with `stalwart ckpt verify ROOT`, remove it with `stalwart ckpt rm ROOT N`, "
            "then retry"
        ) from e
    leases, referenced = in_use or (LiveLeases(), set())
    now = clock()
    for info in packs:
        if not PACK_NAME.match(info.key):
            report.skipped.append(info.key)
            continue
        if (
            in_use is None  # which packs leased steps used is unknown now
            or info.key in referenced
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
        removed = storage.remove_stale_temps(grace_s)
        report.temps_removed = int(removed)
        if isinstance(removed, RemovedTemps):
            report.temps_bytes_freed = removed.bytes_freed
            report.bytes_freed += removed.bytes_freed
    return report


def discard_uncommitted(storage: Storage, packs: Iterable[str]) -> list[str]:
    """Delete ``packs``, written by a save that failed, unless something names one now.

    The failure may have come after the manifest was written (a flush of the folder that
    failed after the rename, a commit another rank made before the collective failed): a
    pack that a manifest or a live lease names stays, and so does every pack when a
    manifest cannot be read. Returns the keys deleted.
    """
    leases = read_leases(storage)
    try:
        referenced = _referenced_packs(storage)
    except CorruptCheckpointError:
        return []
    leases.add(read_leases(storage))
    doomed = sorted({p for p in packs if PACK_NAME.match(p)} - referenced - leases.packs)
    for key in doomed:
        storage.delete(key)
    return doomed


def _retention_stopped(step: int, err: Exception) -> None:
    log.warning(
        "retention deleted nothing, and will not until step %d is repaired or removed (find "
        "the damage with `stalwart ckpt verify ROOT`, remove the step with `stalwart ckpt rm "
        "ROOT %d`): %s",
        step,
        step,
        err,
    )


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
    report = retire(store, doomed, steps, manifest)
    log.info(
        "retention deleted steps %s and %d packs", report.deleted_steps, len(report.deleted_packs)
    )
    return report


def retire(
    store: Storage,
    doomed: list[int],
    steps: list[int],
    manifest: Callable[[int], Manifest],
    *,
    asked: bool = False,
) -> GCReport:
    """Un-commit the ``doomed`` steps (of the committed ``steps``) and delete at once the
    packs only they used.

    Their packs were committed, so no save in flight is writing them: no grace period. After
    the un-commit, leases and manifests are read again, so a pack that a step committed
    meanwhile (another writer's dedup) or a leased step uses is kept. A damaged manifest
    stops retention before it deletes anything; steps the user ``asked`` to delete go even
    then (a damaged one is what they clear away), but no pack does: gc's grace takes over.
    """
    report, packs_of, damaged = GCReport(), dict[int, set[str]](), False
    for s in steps:
        try:
            packs_of[s] = manifest(s).packs()
        except CheckpointNotFoundError:
            continue  # another process deleted it meanwhile
        except CorruptCheckpointError as e:  # unknown references: delete no pack
            if not asked:
                _retention_stopped(s, e)
                return report
            damaged = True
    for s in doomed:
        if s in packs_of or asked:
            try:
                store.delete(manifest_key(s))
            except ObjectNotFoundError:
                continue  # another process deleted it meanwhile
            report.deleted_steps.append(s)
    if damaged:
        return report
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
    try:
        sizes = {i.key: i.size for i in store.list(PACK_PREFIX)}
    except OSError as e:  # packs/ a link (UnsafePathError): the un-commit stands, packs as is
        if not asked:
            raise
        log.warning("deleted step(s) %s; their packs are left as they are: %s", doomed, e)
        return report
    for p in sorted(doomed_packs - kept):
        store.delete(p)
        report.deleted_packs.append(p)
        report.bytes_freed += sizes.get(p, 0)
    return report
