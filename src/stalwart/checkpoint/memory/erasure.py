"""Erasure-coded redundancy of in-memory snapshots across ranks: protect, then rebuild.

Ranks form groups of ``n = k + m`` members. Each member's snapshot blob, padded to the
group's common length ``L`` (a multiple of ``k * 64``), is cut into ``k`` pieces of
``S = L / k`` bytes spread over ``n`` rotating stripes (:class:`StripeLayout`); per stripe the
``k`` data pieces meet at one encoder, which computes ``m`` parity pieces and hands one to each
parity holder. Each rank then keeps its own snapshot plus ``m`` parity pieces (``m * L / k``
bytes: 1.25x memory in all for 4+1, 1.5x for 4+2, against 2x and 3x for full replicas) and
every member's index, and any ``m`` lost members of a group can be rebuilt bit-exactly from
the survivors' memory.

Traffic goes point to point (``isend``/``irecv``) on the process group given — pass a
dedicated gloo group so background checkpoint traffic never queues behind training
collectives. Both calls are collective over the whole group: a tiny ``all_gather`` of ints
first (lengths, steps, who is lost), so every rank schedules the same transfers and reaches
the same verdict; a final status exchange makes any rank's failure raise on every rank.

Bytes are padded only logically: a piece past a blob's end is never sent, the receiver fills
zeros. Nothing is pickled except the short status strings of the last exchange.
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from collections.abc import Sequence
from typing import Any

import blake3
import torch
import torch.distributed as dist

from stalwart.checkpoint.capture import HostBuffer
from stalwart.checkpoint.collective import resolve_group
from stalwart.checkpoint.memory.erasure_codec import (
    PIECE_ALIGN,
    ErasureCodec,
    ReedSolomonCodec,
    StripeLayout,
    XorCodec,
    make_codec,
)
from stalwart.checkpoint.memory.erasure_records import ErasureStats, ProtectedSnapshot
from stalwart.checkpoint.memory.erasure_transfers import PeerRoute, PeerTransfers
from stalwart.checkpoint.memory.snapshot import Snapshot
from stalwart.errors import ConfigError, CorruptCheckpointError, DistributedError

__all__ = [
    "ErasureCodec",
    "ErasureGroup",
    "ErasureStats",
    "ProtectedSnapshot",
    "ReedSolomonCodec",
    "StripeLayout",
    "XorCodec",
]

log = logging.getLogger(__name__)

# Message kinds; the gloo tag is kind * TAG_STRIDE + stripe, unique per pair and call.
_INDEX, _DATA, _PARITY, _META, _REBUILT = range(5)


class ErasureGroup:
    """This rank's place in the erasure-coding groups of a process group.

    Groups are ``n = k + m`` consecutive ranks (``layout="consecutive"``: ranks
    ``[g*n, (g+1)*n)``) or every ``world/n``-th rank (``layout="strided"``: ranks
    ``g, g + world/n, …``, which puts members on different nodes when ranks are numbered
    node by node). Losing more than ``m`` members of any group is unrecoverable from memory.

    Args:
        k: data pieces per stripe (snapshot cut into ``k`` pieces).
        m: parity pieces per stripe: losses tolerated per group, and the memory overhead
            ``m / k``.
        process_group: group whose ranks take part (default: the default group); a
            dedicated gloo group is recommended.
        codec: ``"auto"`` (XOR for ``m = 1``, Reed-Solomon otherwise), ``"xor"``, ``"rs"``,
            ``"rs:<pyeclib ec_type>"`` or an :class:`ErasureCodec`.
        layout: ``"consecutive"`` or ``"strided"``.
        timeout_s: how long to wait for one transfer before raising.

    Raises:
        ConfigError: bad k/m/codec/layout, or the group's size is not a multiple of ``k + m``.

    Attributes:
        last_protect: stats of this rank's latest :meth:`protect`.
        last_rebuild: stats of this rank's latest :meth:`rebuild`.
    """

    def __init__(
        self,
        k: int,
        m: int,
        process_group: Any = None,
        codec: str | ErasureCodec = "auto",
        *,
        layout: str = "consecutive",
        timeout_s: float = 300.0,
    ) -> None:
        self.layout = StripeLayout(k, m)
        self.k, self.m, self.n = k, m, k + m
        self.codec = make_codec(codec, k, m)
        g = resolve_group(process_group)
        self.pg, self.rank, self.world = g.pg, g.rank, g.world
        if self.world % self.n:
            raise ConfigError(
                f"erasure groups of k+m = {k}+{m} = {self.n} ranks need a world size that is a "
                f"multiple of {self.n}, but the process group has {self.world} ranks; change k "
                "and m (for example k = world/2 - 1, m = 1) or the number of ranks"
            )
        if layout not in ("consecutive", "strided"):
            raise ConfigError(f"layout must be 'consecutive' or 'strided', got {layout!r}")
        self.timeout_s = float(timeout_s)
        self.num_groups = self.world // self.n
        self.groups = [self._group_members(g, layout) for g in range(self.num_groups)]
        self.group_index = next(i for i, ms in enumerate(self.groups) if self.rank in ms)
        self.members = self.groups[self.group_index]
        self.member = self.members.index(self.rank)
        ranks = [r if self.pg is None else dist.get_global_rank(self.pg, r) for r in self.members]
        self._route = PeerRoute(tuple(ranks), self.pg, self.timeout_s, self.group_index)
        self.last_protect: ErasureStats | None = None
        self.last_rebuild: ErasureStats | None = None
        self._work = HostBuffer()  # transient stripe data of protect and rebuild

    def _group_members(self, g: int, layout: str) -> tuple[int, ...]:
        if layout == "consecutive":
            return tuple(range(g * self.n, (g + 1) * self.n))
        return tuple(g + i * self.num_groups for i in range(self.n))

    def _gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every pg rank's ``values`` (same length everywhere), indexed by pg rank."""
        t = torch.tensor(list(values), dtype=torch.int64)
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t, group=self.pg)
        return [o.tolist() for o in out]

    def _agree(self, what: str, error: BaseException | None) -> None:
        """Raise on every rank if ``error`` happened on any (one small object all-gather)."""
        msg = None if error is None else f"{type(error).__name__}: {error}"
        outcomes: list[Any] = [None] * self.world
        dist.all_gather_object(outcomes, msg, group=self.pg)
        failed = [(r, s) for r, s in enumerate(outcomes) if s is not None]
        if not failed:
            return
        detail = "; ".join(f"rank {r}: {s}" for r, s in failed)
        err = CorruptCheckpointError(
            f"erasure {what} failed on {len(failed)} rank(s): {detail}; the in-memory "
            "snapshot cannot be trusted, fall back to a stored checkpoint"
        )
        if error is not None:
            raise err from error
        raise err

    def _piece_len(self, blob_len: int, p: int, size: int) -> int:
        """Real (unpadded) bytes of piece ``p`` of a blob of ``blob_len`` bytes."""
        return max(0, min(size, blob_len - p * size))

    # -- protect ---------------------------------------------------------------------------

    def protect(
        self, snapshot: Snapshot, *, parity_buffer: HostBuffer | None = None
    ) -> ProtectedSnapshot:
        """Exchange parity for ``snapshot``; collective over the whole process group.

        Every rank must pass its snapshot of the same step.

        Args:
            snapshot: this rank's snapshot (kept by reference, not copied).
            parity_buffer: where to keep this rank's ``m`` parity pieces (reused, grown only
                when needed; the previous protected snapshot's parity in it is overwritten).
                New memory when None.

        Raises:
            ConfigError: ranks passed snapshots of different steps.
            CorruptCheckpointError: the exchange or encoding failed on some rank.
            DistributedError: a transfer timed out.
        """
        t0 = time.perf_counter()
        stats = ErasureStats()
        lay, n, k, x = self.layout, self.n, self.k, self.member
        index = snapshot.to_bytes()
        rows = self._gather_ints([snapshot.step, snapshot.nbytes, len(index)])
        steps = sorted({r[0] for r in rows})
        if len(steps) > 1:
            raise ConfigError(
                f"erasure protect needs every rank's snapshot of the same step, got steps {steps}"
            )
        lengths = tuple(rows[r][1] for r in self.members)
        idx_lens = [rows[r][2] for r in self.members]
        unit = k * PIECE_ALIGN
        total = max(unit, -(-max(lengths) // unit) * unit)
        size = total // k
        error: BaseException | None = None
        try:
            tx = PeerTransfers(self._route, stats)
            idx_t = torch.frombuffer(bytearray(index), dtype=torch.uint8)
            indexes: list[torch.Tensor] = []
            for y in range(n):
                if y == x:
                    indexes.append(idx_t)
                    continue
                tx.send(idx_t, y, _INDEX)
                indexes.append(torch.empty(idx_lens[y], dtype=torch.uint8))
                tx.recv(indexes[y], y, _INDEX)
            data = snapshot.data
            for p, j in enumerate(lay.data_stripes(x)):
                real = self._piece_len(snapshot.nbytes, p, size)
                tx.send(data[p * size : p * size + real], lay.encoder(j), _DATA, j)
            # Stripe x is the one this rank encodes: receive its k data pieces.
            work = self._work.acquire(k * size)  # reused: fresh pages cost more than a copy
            for i, y in enumerate(lay.data_members(x)):
                real = self._piece_len(lengths[y], lay.data_stripes(y).index(x), size)
                tx.recv(work[i * size : i * size + real], y, _DATA, x)
                work[i * size + real : (i + 1) * size].zero_()
            tx.wait()
            later = PeerTransfers(self._route, stats)
            pbuf = parity_buffer if parity_buffer is not None else HostBuffer()
            slots = iter(pbuf.acquire(self.m * size).split(size))
            parity: dict[int, torch.Tensor] = {}
            meta: dict[int, bytes] = {}
            meta_t: dict[int, torch.Tensor] = {}
            mn = self.codec.meta_nbytes()
            for j in lay.parity_stripes(x):
                if j == x:
                    continue
                parity[j] = next(slots)
                later.recv(parity[j], lay.encoder(j), _PARITY, j)
                meta_t[j] = torch.empty(mn, dtype=torch.uint8)
                later.recv(meta_t[j], lay.encoder(j), _META, j)
            out = [next(slots)] + [torch.empty(size, dtype=torch.uint8) for _ in range(self.m - 1)]
            tc = time.perf_counter()
            meta[x] = self.codec.encode(
                [work[i * size : (i + 1) * size].numpy() for i in range(k)],
                [o.numpy() for o in out],
            )
            stats.codec_s = time.perf_counter() - tc
            parity[x] = out[0]
            mine_meta = torch.frombuffer(bytearray(meta[x]), dtype=torch.uint8) if mn else None
            for i, holder in enumerate(lay.parity_holders(x)):
                if holder == x:
                    continue
                later.send(out[i], holder, _PARITY, x)
                if mine_meta is not None:
                    later.send(mine_meta, holder, _META, x)
            later.wait()
            meta.update({j: t.numpy().tobytes() for j, t in meta_t.items()})
            index_bytes = tuple(t.numpy().tobytes() for t in indexes)
        except Exception as e:  # carried to every rank by _agree
            error = e
        self._agree("protect", error)
        digest = blake3.blake3(
            json.dumps([steps[0], k, self.m, self.codec.name, size, lengths]).encode()
            + b"".join(index_bytes)
        ).digest()
        stats.total_s = time.perf_counter() - t0
        self.last_protect = stats
        return ProtectedSnapshot(
            snapshot=snapshot,
            k=k,
            m=self.m,
            codec=self.codec.name,
            members=self.members,
            member=x,
            piece_nbytes=size,
            lengths=lengths,
            indexes=index_bytes,
            parity=parity,
            meta=meta,
            protect_id=int.from_bytes(digest[:7], "little"),
            stats=stats,
        )

    # -- rebuild ---------------------------------------------------------------------------

    def rebuild(
        self,
        lost: Sequence[int],
        survivor: ProtectedSnapshot | None,
        *,
        buffer: HostBuffer | None = None,
    ) -> Snapshot | None:
        """Rebuild the snapshots of ``lost`` ranks from their groups' survivors.

        Collective over the whole process group. Ranks in ``lost`` pass ``survivor=None``
        (their memory is gone: a restarted process, or the same one after a wipe) and get
        their snapshot back, bit-exact (digest verified), in ``buffer`` if given. Survivors
        pass their :class:`ProtectedSnapshot` and get None. Redundancy is not restored:
        protect the next snapshot (or this one) to be covered again.

        Args:
            lost: process-group ranks whose snapshot is lost; the same list on every rank.
            survivor: this rank's protected snapshot, or None on a lost rank.
            buffer: where a lost rank puts its rebuilt snapshot (a new buffer if None).

        Raises:
            CorruptCheckpointError: more than ``m`` members of a group were lost, survivors
                hold different protects, or rebuilding failed on some rank; raised on every
                rank, and the fix is to load the stored checkpoint instead.
            DistributedError: ranks disagree on ``lost``, or a transfer timed out.
        """
        t0 = time.perf_counter()
        stats = ErasureStats()
        n = self.n
        me_lost = survivor is None
        lost_crc = zlib.crc32(json.dumps(sorted(set(int(r) for r in lost))).encode())
        if survivor is None:
            row = [1, lost_crc, -1, 0, 0] + [0] * (2 * n)
        else:
            row = [0, lost_crc, survivor.step, survivor.protect_id, survivor.piece_nbytes]
            row += list(survivor.lengths) + [len(b) for b in survivor.indexes]
        rows = self._gather_ints(row)
        flagged = sorted(r for r in range(self.world) if rows[r][0])
        crcs = {r[1] for r in rows}
        expected_crc = zlib.crc32(json.dumps(flagged).encode())
        if crcs != {expected_crc}:
            raise DistributedError(
                f"erasure rebuild: ranks disagree on which ranks were lost; ranks that passed "
                f"survivor=None are {flagged}, this rank was told lost={sorted(lost)}; pass the "
                "same list everywhere, and None exactly on those ranks"
            )
        over = []
        for g, ms in enumerate(self.groups):
            gl = [r for r in ms if rows[r][0]]
            if len(gl) > self.m:
                over.append(f"group {g} (ranks {list(ms)}) lost {len(gl)}: {gl}")
        if over:
            raise CorruptCheckpointError(
                f"cannot rebuild from memory: {'; '.join(over)}, but {self.k}+{self.m} erasure "
                f"coding tolerates at most {self.m} lost per group; fall back to the last "
                "checkpoint on disk or remote storage",
                damaged=over,
            )
        for g, ms in enumerate(self.groups):
            views = {tuple(rows[r][2:]) for r in ms if not rows[r][0]}
            if len(views) > 1:
                raise CorruptCheckpointError(
                    f"cannot rebuild from memory: the survivors of group {g} (ranks {list(ms)}) "
                    "hold different protected snapshots (steps "
                    f"{sorted({rows[r][2] for r in ms if not rows[r][0]})}); fall back to a "
                    "stored checkpoint"
                )
        lost_m = [i for i, r in enumerate(self.members) if rows[r][0]]
        ref = next(rows[r] for r in self.members if not rows[r][0])
        size = ref[4]
        lengths = ref[5 : 5 + n]
        idx_lens = ref[5 + n : 5 + 2 * n]
        result: Snapshot | None = None
        error: BaseException | None = None
        try:
            if lost_m:
                result = self._rebuild_group(
                    lost_m, survivor, size, lengths, idx_lens, buffer, stats
                )
        except Exception as e:  # carried to every rank by _agree
            error = e
        self._agree("rebuild", error)
        stats.total_s = time.perf_counter() - t0
        self.last_rebuild = stats
        if me_lost and result is None:  # pragma: no cover - _agree raised already
            raise CorruptCheckpointError("erasure rebuild produced no snapshot")
        return result

    def _rebuild_group(
        self,
        lost_m: list[int],
        survivor: ProtectedSnapshot | None,
        size: int,
        lengths: list[int],
        idx_lens: list[int],
        buffer: HostBuffer | None,
        stats: ErasureStats,
    ) -> Snapshot | None:
        lay, k, x = self.layout, self.k, self.member
        lost_set = set(lost_m)
        alive = [y for y in range(self.n) if y not in lost_set]
        tx = PeerTransfers(self._route, stats)
        # Stripes with a lost data piece; each is decoded by its first surviving parity
        # holder (one exists: if all m parity holders are lost, no data member is).
        plan: dict[int, tuple[int, list[int]]] = {}
        for j in range(self.n):
            if not lost_set & set(lay.data_members(j)):
                continue
            holders = lay.members(j)
            decoder = next(h for h in lay.parity_holders(j) if h not in lost_set)
            others = [i for i, h in enumerate(holders) if h not in lost_set and h != decoder]
            plan[j] = (decoder, sorted([holders.index(decoder), *others[: k - 1]]))
        if survivor is None:
            return self._receive_rebuilt(plan, alive[0], size, lengths, idx_lens, buffer, tx)
        if x == alive[0]:
            for y in lost_m:
                tx.send(
                    torch.frombuffer(bytearray(survivor.indexes[y]), dtype=torch.uint8), y, _INDEX
                )
        blob = survivor.snapshot.data
        inbox: dict[int, dict[int, torch.Tensor]] = {}
        mine_to_decode = [j for j, (decoder, _) in plan.items() if decoder == x]
        slots = iter(self._work.acquire(max(1, len(mine_to_decode) * (k - 1) * size)).split(size))
        for j, (decoder, chosen) in plan.items():
            holders = lay.members(j)
            mine = lay.piece_index(x, j)
            if decoder != x and mine in chosen:
                if mine < k:
                    p = lay.data_stripes(x).index(j)
                    real = self._piece_len(lengths[x], p, size)
                    tx.send(blob[p * size : p * size + real], decoder, _DATA, j)
                else:
                    tx.send(survivor.parity[j], decoder, _DATA, j)
            if decoder == x:
                pieces = inbox[j] = {mine: survivor.parity[j]}
                for i in chosen:
                    if i == mine:
                        continue
                    y = holders[i]
                    pieces[i] = next(slots)
                    real = size
                    if i < k:
                        real = self._piece_len(lengths[y], lay.data_stripes(y).index(j), size)
                    tx.recv(pieces[i][:real], y, _DATA, j)
                    pieces[i][real:].zero_()
        tx.wait()
        for j, pieces in inbox.items():
            holders = lay.members(j)
            want = [i for i in range(k) if holders[i] in lost_set]
            tc = time.perf_counter()
            got = self.codec.decode(
                {i: t.numpy() for i, t in pieces.items()}, survivor.meta[j], want
            )
            stats.codec_s += time.perf_counter() - tc
            for i in want:
                y = holders[i]
                real = self._piece_len(lengths[y], lay.data_stripes(y).index(j), size)
                tx.send(torch.from_numpy(got[i][:real]), y, _REBUILT, j)
        tx.wait()
        return None

    def _receive_rebuilt(
        self,
        plan: dict[int, tuple[int, list[int]]],
        sender: int,
        size: int,
        lengths: list[int],
        idx_lens: list[int],
        buffer: HostBuffer | None,
        tx: PeerTransfers,
    ) -> Snapshot:
        """On a lost rank: receive the index and every rebuilt piece, then verify."""
        x, lay = self.member, self.layout
        index = torch.empty(idx_lens[x], dtype=torch.uint8)
        tx.recv(index, sender, _INDEX)
        buf = buffer if buffer is not None else HostBuffer()
        data = buf.acquire(lengths[x])
        for p, j in enumerate(lay.data_stripes(x)):
            real = self._piece_len(lengths[x], p, size)
            tx.recv(data[p * size : p * size + real], plan[j][0], _REBUILT, j)
        tx.wait()
        tv = time.perf_counter()
        snap = Snapshot.from_bytes(index.numpy().tobytes(), data, buffer=buf, verify=True)
        tx.stats.verify_s = time.perf_counter() - tv
        return snap
