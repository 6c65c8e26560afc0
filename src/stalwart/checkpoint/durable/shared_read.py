"""Boxes every rank loads alike are read once by the group, then broadcast.

A replicated tensor (DDP, a ``Replicate`` DTensor, a tensor the state lacks) is the same box
on every rank. Read rank by rank it costs the node its bytes once per rank: reads, hashes
and copies all multiplied by the world size. Here the ranks agree (one ``all_gather`` of box
keys) which boxes they all want; those are cut into pieces of at most ``PIECE_BYTES`` rows,
each piece given to one rank (the least loaded, counting the boxes only it reads). A rank
reads and verifies its pieces and its own boxes with the usual pipeline (``read_boxes``:
every chunk's hash checked before its bytes land); then every rank learns every rank's
outcome (a second ``all_gather``) and, only if all succeeded, each piece reaches the other
ranks: on one host through a file per reader in ``/dev/shm`` (written after verification,
read straight into place, removed once every rank met again), else broadcast from its
reader over the process group (small pieces coalesced per reader).

Every chunk is still verified before it lands, by the rank that read it; a damaged chunk
makes its reader raise ``CorruptCheckpointError`` naming tensor, shard and chunk, and the
other ranks ``PeerDamageError`` (a ``DistributedError`` carrying the same message), which
a fallback load treats as damage: every rank moves on to an older step together.
Groups whose backend cannot move CPU tensors (NCCL alone) read rank by rank.

When: by the store (``SHARED_READS = None``, the default). Where every rank's read leaves
the host (an object store, any fsspec URL but ``memory://``: ``reads_leave_host``), the
group shares; on a local disk the page cache already reads each byte once per host and
handing pieces over costs a pass, so each rank reads alone. The ranks agree in
``plan_shared``'s one ``all_gather``: if any rank's store stays on its host, all read alone.

Collective order: ``plan_shared`` (or ``withdraw`` on a rank that failed before it) then
``share_pieces``, on every rank of the group.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from stalwart.checkpoint.collective import Group
from stalwart.checkpoint.durable.persist import tensor_bytes
from stalwart.checkpoint.durable.reshard import Box, ReadStats, read_boxes
from stalwart.errors import CorruptCheckpointError, DistributedError, StepRetiredError
from stalwart.storage.base import ReadsLeaveHost, Storage

__all__ = [
    "PIECE_BYTES",
    "SHARED_READS",
    "SHM_DIR",
    "SHM_READS",
    "PeerDamageError",
    "SharedPlan",
    "can_share",
    "plan_shared",
    "read_shared",
    "reads_leave_host",
    "share_pieces",
    "withdraw",
]

PIECE_BYTES = 32 << 20
"""Shared boxes are cut into pieces of at most this many bytes (whole leading rows)."""

SHARED_READS: bool | None = None
"""Whether boxes every rank loads alike are read once by the group and shared.

None (default): decided by the store, on every load. Shared where reads leave the host
(``reads_leave_host``: S3 and other fsspec URLs), where each rank's read reaches the store
(``bench/remote_load_bench.py``); alone on local disks and in memory, where the page cache
already reads each byte once per host and handing pieces between ranks costs a pass
(``bench/dist_load_bench.py``: DDP load 1.29 s each rank alone against 1.69 s shared,
2 ranks, 1.06 GB, cold cache). True or False: forced, whatever the store; every rank
must set the same value."""

SHM_READS = True
"""Ranks of one host pass pieces through files in ``SHM_DIR`` (False: the process group)."""

SHM_DIR = "/dev/shm"

SMALL_BYTES = 1 << 20
"""Pieces below this are broadcast together, one buffer per reading rank."""


@dataclass
class SharedPlan:
    """What this rank reads (``mine``) and the shared pieces, each with its reader."""

    mine: list[Box] = field(default_factory=list)
    pieces: list[tuple[int, Box]] = field(default_factory=list)
    shm: str | None = None  # all ranks on one host: pieces go through files with this prefix


def reads_leave_host(store: Storage) -> bool:
    """True when reading ``store`` fetches bytes from another machine, for every rank anew.

    The store says so (``ReadsLeaveHost``: fsspec stores but ``memory://``, and wrappers that
    pass on what they wrap); a store that says nothing counts as local, and its ranks read
    alone unless ``SHARED_READS`` forces sharing.
    """
    return isinstance(store, ReadsLeaveHost) and store.reads_leave_host


def can_share(g: Group) -> bool:
    """True when ``g`` may share reads: several ranks, a backend that broadcasts CPU tensors,
    and ``SHARED_READS`` not False (None: ``plan_shared`` then asks the store)."""
    if g.world <= 1 or SHARED_READS is False:
        return False
    try:
        return "gloo" in str(dist.get_backend(g.pg)).lower()
    except (RuntimeError, ValueError):
        return False


def withdraw(g: Group) -> None:
    """Tell the other ranks this one will not read (it failed before): they read alone."""
    if can_share(g):
        g.all_gather(None)


def _key(b: Box) -> tuple[str, tuple[int, ...], tuple[int, ...], str]:
    return (b.fqn, tuple(b.offsets), tuple(b.dest.shape), str(b.dest.dtype))


def _nbytes(b: Box) -> int:
    return b.dest.numel() * b.dest.element_size()


def _cuts(b: Box, row_bytes: int) -> list[int]:
    """Rows to cut ``b`` at: where saved chunks end on a row, every ~``PIECE_BYTES``.

    Cutting where a chunk ends keeps every chunk in one piece (read by one rank); a box
    not saved as one shard, or whose chunks never end on a row, is cut by rows alone
    (a chunk across a cut is then read by both ranks).
    """
    shards = b.entry.shards
    whole = len(shards) == 1 and tuple(shards[0].sizes) == tuple(b.dest.shape)
    ends: list[int] = []
    if whole and tuple(shards[0].offsets) == tuple(b.offsets):
        pos = 0
        for c in shards[0].chunks[:-1]:
            pos += c.nbytes
            ends.append(pos)
    cuts, last = [], 0
    for p in ends:
        if p - last >= PIECE_BYTES and p % row_bytes == 0:
            cuts.append(p // row_bytes)
            last = p
    if cuts or (ends and ends[0] % row_bytes == 0):
        return cuts
    per = max(1, PIECE_BYTES // row_bytes)
    return list(range(per, b.dest.shape[0], per))


def _pieces(b: Box) -> list[Box]:
    """``b`` cut along its leading dimension into contiguous pieces of ~``PIECE_BYTES``."""
    if b.dest.dim() == 0 or _nbytes(b) <= PIECE_BYTES:
        return [b]
    rows = b.dest.shape[0]
    bounds = [0, *_cuts(b, max(1, _nbytes(b) // rows)), rows]
    out = []
    for a, z in itertools.pairwise(bounds):
        offsets = (b.offsets[0] + a, *b.offsets[1:])
        out.append(Box(b.entry, b.fqn, offsets, b.dest.narrow(0, a, z - a)))
    return out


def plan_shared(g: Group, boxes: list[Box], store: Storage | None = None) -> SharedPlan | None:
    """Agree which boxes every rank wants and who reads each piece; None: read alone.

    Collective. None when some rank withdrew (it failed before reading and raises), when
    ``SHARED_READS`` is None and some rank's ``store`` does not read off its host
    (``reads_leave_host``; no ``store``: local), or when the ranks want no box in common.
    """
    share = reads_leave_host(store) if SHARED_READS is None and store is not None else SHARED_READS
    keys = [(_key(b), _nbytes(b)) for b in boxes] if share else None
    gathered = g.all_gather((socket.gethostname(), uuid.uuid4().hex, keys))
    every = [x[2] for x in gathered if x is not None and x[2] is not None]
    if len(every) < g.world:
        return None
    common = set.intersection(*({k for k, _ in ks} for ks in every))
    if not common:
        return None  # nothing to share: each rank reads its own (sharded loads)
    load = [sum(n for k, n in ks if k not in common) for ks in every]
    by_key = {_key(b): b for b in boxes}
    plan = SharedPlan(mine=[b for b in boxes if _key(b) not in common])
    pieces = [p for k in sorted(common) for p in _pieces(by_key[k])]
    # Largest first to the least loaded rank: the same answer on every rank.
    order = sorted(range(len(pieces)), key=lambda i: (-_nbytes(pieces[i]), i))
    owner = [0] * len(pieces)
    for i in order:
        r = min(range(g.world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += _nbytes(pieces[i])
    plan.pieces = [(owner[i], p) for i, p in enumerate(pieces)]
    plan.mine += [p for r, p in plan.pieces if r == g.rank]
    one_host = len({h for h, _, _ in gathered}) == 1
    if SHM_READS and one_host and os.path.isdir(SHM_DIR):
        plan.shm = os.path.join(SHM_DIR, f"stalwart-load-{gathered[0][1]}")
    return plan


def _outcome(err: BaseException | None) -> tuple[str, str, list[str]] | None:
    if err is None:
        return None
    return (type(err).__name__, str(err), list(getattr(err, "damaged", []) or []))


class PeerDamageError(DistributedError):
    """Bytes another rank read for this one are damaged or retired; that rank raised it.

    The load's outcome exchange treats it as the damage it stands for (a fallback load
    moves on to an older step on every rank); the reading rank names the chunk.
    """

    def __init__(self, message: str, damaged: list[str] | None = None) -> None:
        super().__init__(message)
        self.damaged = list(damaged or [])


def _raise_remote(r: int, kind: str, msg: str, damaged: list[str]) -> None:
    if kind in (CorruptCheckpointError.__name__, StepRetiredError.__name__):
        raise PeerDamageError(f"rank {r} read damaged data for this rank: {msg}", damaged)
    raise DistributedError(f"reading the shared boxes failed on rank {r}: {kind}: {msg}")


def share_pieces(g: Group, plan: SharedPlan, err: BaseException | None) -> None:
    """Exchange read outcomes; if all ranks read their pieces, broadcast every piece.

    ``err`` is this rank's read failure (None: it read and verified its share). Collective.

    Raises:
        ``err`` on the rank that failed; on the others, the same kind of error naming it.
    """
    mine = f"{plan.shm}-{g.rank}" if plan.shm is not None else None
    try:
        if mine is not None and err is None:
            err = _publish(mine, [p for r, p in plan.pieces if r == g.rank])
        outcomes = g.all_gather(_outcome(err))
        if err is not None:
            raise err
        for r, out in enumerate(outcomes):
            if out is not None:
                _raise_remote(r, *out)
        if plan.shm is not None:
            return _take_published(g, plan, plan.shm)
    finally:
        if mine is not None:
            with contextlib.suppress(OSError):
                os.unlink(mine)  # after every rank read it (or none will)
    _broadcast(g, plan)


def _broadcast(g: Group, plan: SharedPlan) -> None:
    """Every piece from its reader to the other ranks over the process group."""
    small: dict[int, list[torch.Tensor]] = {}
    works = []
    try:
        for r, p in plan.pieces:
            flat = p.dest.reshape(-1).view(torch.uint8)
            if flat.numel() < SMALL_BYTES:
                small.setdefault(r, []).append(flat)
                continue
            src = dist.get_global_rank(g.pg, r)
            works.append(dist.broadcast(flat, src=src, group=g.pg, async_op=True))
        for r, flats in sorted(small.items()):
            n = sum(f.numel() for f in flats)
            buf = torch.cat(flats) if r == g.rank else torch.empty(n, dtype=torch.uint8)
            dist.broadcast(buf, src=dist.get_global_rank(g.pg, r), group=g.pg)
            if r != g.rank:
                for f, part in zip(flats, buf.split([f.numel() for f in flats]), strict=True):
                    f.copy_(part)
        for w in works:
            w.wait()
    except RuntimeError as e:
        raise DistributedError(
            f"broadcasting loaded tensors among {g.world} ranks failed ({e}); another rank "
            "probably died; restart the job and load again"
        ) from e


def _publish(path: str, pieces: list[Box]) -> OSError | None:
    """Write this rank's verified pieces, in plan order, to ``path``; the error if it failed."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        try:
            for p in pieces:
                view = tensor_bytes(p.dest)
                while view:
                    view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
    except OSError as e:
        return e
    return None


def _take_published(g: Group, plan: SharedPlan, prefix: str) -> None:
    """Read the other ranks' pieces from their files into place; then all ranks meet."""
    problem = None
    try:
        for r in range(g.world):
            if r == g.rank:
                continue
            with open(f"{prefix}-{r}", "rb", buffering=0) as f:
                for owner, p in plan.pieces:
                    if owner != r:
                        continue
                    view = tensor_bytes(p.dest)
                    while view:
                        n = f.readinto(view)
                        if not n:
                            raise OSError(f"{prefix}-{r} ends early")
                        view = view[n:]
    except OSError as e:
        problem = f"{type(e).__name__}: {e}"
    failed = [(r, m) for r, m in enumerate(g.all_gather(problem)) if m is not None]
    if failed:
        raise DistributedError(
            f"sharing loaded tensors through {SHM_DIR} failed on rank {failed[0][0]} "
            f"({failed[0][1]}); free space there or set shared_read.SHM_READS = False"
        )


def read_shared(
    storage: Storage,
    boxes: list[Box],
    g: Group,
    *,
    pool: ThreadPoolExecutor,
    where: str,
    verify_pool: ThreadPoolExecutor | None = None,
) -> ReadStats:
    """``read_boxes`` for the group: boxes every rank wants read once and broadcast.

    Collective (every rank of ``g`` calls it, or ``withdraw``). Returns this rank's reads.
    """
    plan = plan_shared(g, boxes, storage)
    if plan is None:  # alone: a rank withdrew (it raises), a local store, nothing in common
        return read_boxes(storage, boxes, pool=pool, where=where, verify_pool=verify_pool)
    stats, err = ReadStats(), None
    try:
        stats = read_boxes(storage, plan.mine, pool=pool, where=where, verify_pool=verify_pool)
    except Exception as e:  # carried to every rank by share_pieces
        err = e
    share_pieces(g, plan, err)
    return stats
