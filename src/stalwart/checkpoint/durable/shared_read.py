"""Boxes every rank loads alike are read once by the group, then shared.

A replicated tensor (DDP, a ``Replicate`` DTensor, a tensor the state lacks) is the same box
on every rank; read rank by rank, its reads, checks and copies are multiplied by the world
size. Here the ranks agree (one ``all_gather`` of box keys) which boxes they all want; those
are cut into pieces of at most ``PIECE_BYTES`` rows, each given to the least loaded rank,
which reads and verifies it with the usual pipeline (``read_boxes``: every chunk checked
before its bytes land), and the pieces reach the other ranks:

* **one host**: through ``/dev/shm`` as each lands (``shm_stream.py``): the reader lands its
  verified chunks in its segment, every rank copies each piece out as soon as it is ready,
  while the disk still reads; each byte of the host is read and hashed once;
* **several hosts**: broadcast from its reader over the process group once every rank's
  reads succeeded (small pieces coalesced per reader).

Then every rank learns every rank's outcome (an ``all_gather``): a damaged chunk makes its
reader raise ``CorruptCheckpointError`` naming tensor, shard and chunk, the others
``PeerDamageError`` (the same message), which a fallback load treats as damage, all ranks
moving on together. Groups whose backend cannot move CPU tensors (NCCL) read rank by rank.

When: ``SHARED_READS = None`` (the default) shares where every rank's reads leave the host
(``would_share``); ranks on local disks read alone, the page cache reading each byte once per
host. Collective order: ``plan_shared`` (or ``withdraw``), then the exchange, on every rank.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from stalwart.checkpoint.collective import Group
from stalwart.checkpoint.durable.reshard import Box, ReadStats, read_boxes
from stalwart.checkpoint.durable.shm_stream import Segment, copy_out, sweep
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
    "would_share",
]

log = logging.getLogger(__name__)

PIECE_BYTES = 32 << 20
"""Shared boxes are cut into pieces of at most this many bytes (whole leading rows)."""

SHARED_READS: bool | None = None
"""Whether boxes every rank loads alike are read once by the group and shared.

None (default): where every rank's store reads off its host (``would_share``,
``bench/remote_load_bench.py``). True or False: forced, whatever the store; every rank must
set the same value."""

SHM_READS = True
"""Ranks of one host pass pieces through files in ``SHM_DIR`` (False: the process group)."""

SHM_DIR = "/dev/shm"

SMALL_BYTES = 1 << 20
"""Pieces below this are broadcast together, one buffer per reading rank."""


@dataclass
class SharedPlan:
    """What this rank reads alone (``alone``) and the shared pieces, each with its reader."""

    alone: list[Box] = field(default_factory=list)
    pieces: list[tuple[int, Box]] = field(default_factory=list)
    shm: str | None = None  # all ranks on one host: pieces go through files with this prefix
    rank: int = 0

    @property
    def mine(self) -> list[Box]:
        """Every box this rank reads: its own, then the pieces it reads for the group."""
        return [*self.alone, *(p for r, p in self.pieces if r == self.rank)]


def reads_leave_host(store: Storage) -> bool:
    """True when reading ``store`` fetches bytes from another machine, for every rank anew:
    the store says so (``ReadsLeaveHost``); one that says nothing counts as local."""
    return isinstance(store, ReadsLeaveHost) and store.reads_leave_host


def would_share(store: Storage | None) -> bool:
    """This rank's say: ``SHARED_READS``, or when None, whether ``store`` reads off its host."""
    auto = SHARED_READS is None
    return (store is not None and reads_leave_host(store)) if auto else bool(SHARED_READS)


def can_share(g: Group) -> bool:
    """True when ``g`` may share reads: several ranks, a backend that broadcasts CPU tensors,
    and ``SHARED_READS`` not False (None: ``plan_shared`` then decides)."""
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

    Collective. None when some rank withdrew (it failed before reading and raises), when some
    rank's say is no (``would_share``), or when the ranks want no box in common.
    """
    keys = [(_key(b), _nbytes(b)) for b in boxes] if would_share(store) else None
    gathered = g.all_gather(
        (socket.gethostname(), uuid.uuid4().hex, keys, SHM_READS and os.path.isdir(SHM_DIR))
    )
    every = [x[2] for x in gathered if x is not None and x[2] is not None]
    if len(every) < g.world:
        return None
    common = set.intersection(*({k for k, _ in ks} for ks in every))
    if not common:
        return None  # nothing to share: each rank reads its own (sharded loads)
    load = [sum(n for k, n in ks if k not in common) for ks in every]
    by_key = {_key(b): b for b in boxes}
    plan = SharedPlan(alone=[b for b in boxes if _key(b) not in common], rank=g.rank)
    pieces = [p for k in sorted(common) for p in _pieces(by_key[k])]
    # Largest first to the least loaded rank: the same answer on every rank.
    order = sorted(range(len(pieces)), key=lambda i: (-_nbytes(pieces[i]), i))
    owner = [0] * len(pieces)
    for i in order:
        r = min(range(g.world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += _nbytes(pieces[i])
    plan.pieces = [(owner[i], p) for i, p in enumerate(pieces)]
    if all(x[3] for x in gathered) and len({x[0] for x in gathered}) == 1:
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
    _settle(g, err)
    _broadcast(g, plan)


def _settle(g: Group, err: BaseException | None, why: tuple[bool, str] | None = None) -> None:
    """Every rank learns every rank's outcome; raise here if any failed.

    ``why``: this rank's copies out of ``/dev/shm`` stopped (``shm_stream.copy_out``); its
    own failure counts as an outcome, a peer's is explained by that peer's outcome.
    """
    own = why is not None and why[0] and err is None
    outcome = _outcome(err) or (("DistributedError", why[1], []) if own and why else None)
    outcomes = g.all_gather(outcome)
    if err is not None:
        raise err
    for r, out in enumerate(outcomes):
        if out is not None:
            _raise_remote(r, *out)
    if why is not None:
        fix = "load again (fallback=True moves all ranks on), or set shared_read.SHM_READS = False"
        raise DistributedError(f"sharing loaded tensors through {SHM_DIR} failed: {why[1]}; {fix}")


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


def read_shared(
    storage: Storage,
    boxes: list[Box],
    g: Group,
    *,
    pool: ThreadPoolExecutor,
    where: str,
    verify_pool: ThreadPoolExecutor | None = None,
) -> ReadStats:
    """``read_boxes`` for the group: boxes every rank wants read once and shared.

    Collective (every rank of ``g`` calls it, or ``withdraw``). Returns this rank's reads.
    """
    plan = plan_shared(g, boxes, storage)
    if plan is None:  # alone: a rank withdrew (it raises), no gain, nothing in common
        return read_boxes(storage, boxes, pool=pool, where=where, verify_pool=verify_pool)
    if plan.shm is not None:
        return _read_streamed(storage, g, plan, pool, where, verify_pool)
    stats, err = ReadStats(), None
    try:
        stats = read_boxes(storage, plan.mine, pool=pool, where=where, verify_pool=verify_pool)
    except Exception as e:  # carried to every rank by share_pieces
        err = e
    share_pieces(g, plan, err)
    return stats


def _read_streamed(
    storage: Storage,
    g: Group,
    plan: SharedPlan,
    pool: ThreadPoolExecutor,
    where: str,
    verify_pool: ThreadPoolExecutor | None,
) -> ReadStats:
    """One host: each reader lands its pieces in its ``/dev/shm`` segment and every rank
    copies each out as it turns ready (``shm_stream``); a segment that cannot be made (no
    room) sends every rank back to reading alone."""
    sizes: list[list[int]] = [[] for _ in range(g.world)]
    wanted: list[tuple[int, int, torch.Tensor]] = []
    for r, p in plan.pieces:
        if r != g.rank:  # its own pieces land in place, as in a load alone
            wanted.append((r, len(sizes[r]), p.dest))
        sizes[r].append(_nbytes(p))
    segs: dict[int, Segment] = {}
    problem = None
    try:
        sweep(SHM_DIR, "stalwart-load-")  # what loads killed on this host left behind
        if sizes[g.rank]:
            segs[g.rank] = Segment.create(f"{plan.shm}-{g.rank}", sizes[g.rank])
    except OSError as e:
        problem = f"{type(e).__name__}: {e}"
    problems = [m for m in g.all_gather(problem) if m is not None]
    if problems:
        _close(segs, g.rank)
        log.warning("no room to share loaded pieces in %s (%s): each rank reads alone",
                    SHM_DIR, problems[0])  # fmt: skip
        every = [*plan.alone, *(p for _, p in plan.pieces)]
        return read_boxes(storage, every, pool=pool, where=where, verify_pool=verify_pool)
    stats, err, why = ReadStats(), None, None
    stop = threading.Event()
    try:
        for r in range(g.world):
            if r != g.rank and sizes[r]:
                segs[r] = Segment.open(f"{plan.shm}-{r}", sizes[r])
        with ThreadPoolExecutor(1, thread_name_prefix="stalwart-shm") as copier:
            copies = copier.submit(copy_out, segs, wanted, stop)
            try:
                stats = _read_into_segment(storage, plan, segs.get(g.rank), pool, where,
                                           verify_pool)  # fmt: skip
            except Exception as e:  # carried to every rank by _settle
                err = e
                stop.set()
                if g.rank in segs:
                    segs[g.rank].abort()
            why = copies.result()
    except OSError as e:
        err = err or e
        if g.rank in segs:
            segs[g.rank].abort()
    try:
        _settle(g, err, why)
    finally:
        _close(segs, g.rank)  # after every rank met: nobody maps them any more
    return stats


def _read_into_segment(
    storage: Storage,
    plan: SharedPlan,
    seg: Segment | None,
    pool: ThreadPoolExecutor,
    where: str,
    verify_pool: ThreadPoolExecutor | None,
) -> ReadStats:
    """Read this rank's boxes and pieces into place, putting each piece in its segment as
    its last chunk lands."""
    mine = [p for r, p in plan.pieces if r == plan.rank]
    n = len(mine)

    def landed(i: int) -> None:
        if i < n and seg is not None:
            seg.put(i, mine[i].dest)

    return read_boxes(storage, [*mine, *plan.alone], pool=pool, where=where,
                      verify_pool=verify_pool, landed=landed)  # fmt: skip


def _close(segs: dict[int, Segment], rank: int) -> None:
    for r, seg in segs.items():
        seg.close(unlink=r == rank)
