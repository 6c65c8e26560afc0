"""A rank's state captured in host memory: one contiguous byte buffer plus a JSON index.

A :class:`Snapshot` is what the in-memory tier keeps and what erasure coding protects: the
local box of every tensor leaf (the whole tensor for a plain tensor, the local shard of a
DTensor) copied back to back into one ``uint8`` host buffer, each box starting at a multiple
of :data:`ALIGN_BYTES` so that it can be viewed in place with its own dtype. The index (plain
JSON, never pickle) holds the state tree's skeleton, each box's place in the buffer, and the
digest (XXH3-128) of the buffer's first ``nbytes`` bytes, which is the blob erasure coding ships.

Buffers are expensive to allocate (fresh pages fault in at a fraction of the copy rate), so a
:class:`HostBuffer` is allocated once and reused; it grows only when a state no longer
fits. Reusing a buffer overwrites the snapshot it held: every capture bumps the buffer's
generation and a snapshot whose generation is stale refuses to be read. Keep two buffers
(double-buffering) when the previous snapshot must survive until the next one is protected.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from stalwart.checkpoint.capture import BoxRecord, Capture, HostBuffer, box_view, stage
from stalwart.checkpoint.durable.chunk_ref import chunk_hash
from stalwart.checkpoint.durable.plan import local_box, local_items
from stalwart.checkpoint.fresh_optimizers import prime_fresh_optimizers
from stalwart.errors import CorruptCheckpointError
from stalwart.tree import dtype_from_name, dtype_name, flatten, unflatten

__all__ = ["INDEX_FORMAT", "Snapshot"]

INDEX_FORMAT = 2
"""Version of the index JSON written by :meth:`Snapshot.to_bytes` (2: XXH3-128 digests)."""


@dataclass
class Snapshot:
    """One rank's state at one step, in host memory.

    Build one with :meth:`capture`; put it back with :meth:`restore_into`. The blob that
    redundancy protects is ``data`` (``nbytes`` bytes) plus the index from :meth:`to_bytes`.

    Attributes:
        step: the training step captured.
        skeleton: the state tree's JSON skeleton (``stalwart.tree.flatten(state).skeleton``).
        tensors: every tensor box, in buffer order.
        data: ``uint8`` tensor of exactly ``nbytes`` bytes (a view of the buffer).
        digest: digest of ``data``: ``xxh3-128:<hex>`` (index format 2), or a bare BLAKE3
            hex digest (format 1). XXH3 detects memory corruption at ~10x BLAKE3's speed,
            which matters when a snapshot is taken every step on a busy host.
        buffer: the reusable buffer ``data`` lives in (None when ``data`` is standalone).
        generation: the buffer's generation when this snapshot was written.
    """

    step: int
    skeleton: dict[str, Any]
    tensors: list[BoxRecord]
    data: torch.Tensor
    digest: str
    buffer: HostBuffer | None = field(default=None, repr=False)
    generation: int = 0

    @property
    def nbytes(self) -> int:
        """Length of the blob (the buffer's used part)."""
        return int(self.data.numel())

    # -- capture ---------------------------------------------------------------------------

    @classmethod
    def capture(cls, state: Any, step: int, buffer: HostBuffer | None = None) -> Snapshot:
        """Copy this rank's part of ``state`` into ``buffer`` (a new one when None).

        Plain tensors are captured whole, DTensors as their local shard; device tensors are
        copied to the host. Python values and stateful objects' ``state_dict()`` go to the
        skeleton (small values only; tensors inside ``state_dict()`` go to the buffer).

        Raises:
            UnsupportedValueError: the state holds something the format cannot store.
        """
        flat = flatten(state)
        cap, _ = stage(local_items(flat), buffer if buffer is not None else HostBuffer())
        return cls.from_capture(cap, step, flat.skeleton)

    @classmethod
    def from_capture(cls, cap: Capture, step: int, skeleton: dict[str, Any]) -> Snapshot:
        """The snapshot of a finished :class:`Capture` (every copy landed): digest it."""
        cap.ready()
        cap.check_fresh(f"capture of step {step}")
        return cls(
            step=int(step),
            skeleton=skeleton,
            tensors=cap.records,
            data=cap.data,
            digest=_digest(cap.data),
            buffer=cap.buffer,
            generation=cap.generation,
        )

    # -- checks ----------------------------------------------------------------------------

    def _check_fresh(self) -> None:
        if self.buffer is not None and self.buffer.generation != self.generation:
            raise CorruptCheckpointError(
                f"the snapshot of step {self.step} was overwritten: its HostBuffer was "
                "reused by a later capture; keep one buffer per snapshot you still need"
            )

    def verify(self) -> None:
        """Check the buffer against its digest.

        Raises:
            CorruptCheckpointError: the bytes changed since capture, or the buffer was reused.
        """
        self._check_fresh()
        found = _digest(self.data, like=self.digest)
        if found != self.digest:
            raise CorruptCheckpointError(
                f"in-memory snapshot of step {self.step} ({self.nbytes} bytes) fails its "
                f"digest (expected …{self.digest[-16:]}, found …{found[-16:]}); "
                "do not restore from it, fall back to a stored checkpoint",
                damaged=[f"snapshot step {self.step}"],
            )

    # -- restore ---------------------------------------------------------------------------

    def tensor(self, fqn: str) -> torch.Tensor:
        """A view of one box's bytes in the buffer, with its dtype and local shape."""
        self._check_fresh()
        for rec in self.tensors:
            if rec.fqn == fqn:
                return box_view(self.data, rec)
        raise KeyError(fqn)

    def restore_into(self, state: Any, *, strict: bool = True) -> Any:
        """Copy the snapshot back into ``state``'s tensors in place; return the rebuilt tree.

        The same routine as a load from disk checks the state (strictness, the mismatch
        report) and hands stateful objects their sub-tree, translating their refusals.
        ``state`` must hold the boxes it held at capture (same names, dtypes, global
        shapes and local boxes): memory snapshots are not resharded. Tensors the state lacks
        (a fresh optimizer of plain parameters has no moments yet; one of DTensors is first
        given them, ``fresh_optimizers``) are handed to their stateful owner as new tensors (the
        local box, so a DTensor absent from ``state`` comes back as its shard).

        Raises:
            StateMismatchError: a tensor's dtype, shape or local box differs (``strict``).
            CorruptCheckpointError: the buffer was reused since capture.
        """
        from stalwart.checkpoint.durable.restore import (
            fill_plain_values,
            match_targets,
            restore_statefuls,
        )

        self._check_fresh()
        where = f"the memory snapshot of step {self.step}"
        prime_fresh_optimizers(state, sharded_only=True)  # moments then sharded too
        flat = flatten(state)
        by_fqn = {rec.fqn: rec for rec in self.tensors}
        out, problems = match_targets(flat, by_fqn, _box_problem, strict=strict, where=where)
        with torch.no_grad():
            for fqn, t in out.items():
                rec = by_fqn[fqn]
                if rec.nbytes:
                    local_box(t)[2].copy_(box_view(self.data, rec))
                flat.leaves[fqn].write_back()
        for rec in self.tensors:
            if rec.fqn not in out:
                out[rec.fqn] = box_view(self.data, rec).clone()
        tree = unflatten(self.skeleton, out.__getitem__)
        restore_statefuls(flat, tree, strict=strict, where=where, problems=problems)
        fill_plain_values(state, tree)
        return tree

    # -- index -----------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """The index as UTF-8 JSON (step, digest, length, skeleton, boxes); no tensor data."""
        index = {
            "format": INDEX_FORMAT,
            "step": self.step,
            "nbytes": self.nbytes,
            "digest": self.digest,
            "skeleton": self.skeleton,
            "tensors": [rec.to_json() for rec in self.tensors],
        }
        return json.dumps(index, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(
        cls,
        index: bytes,
        data: torch.Tensor,
        *,
        buffer: HostBuffer | None = None,
        verify: bool = True,
    ) -> Snapshot:
        """Rebuild a snapshot from its index and its blob (``data``: ``uint8``, ``nbytes``).

        Raises:
            CorruptCheckpointError: malformed index, wrong length, or (``verify``) digest
                mismatch.
        """
        try:
            d = json.loads(bytes(index).decode())
            fmt = int(d["format"])
            step, nbytes, digest = int(d["step"]), int(d["nbytes"]), str(d["digest"])
            skeleton = d["skeleton"]
            tensors = [BoxRecord.from_json(v) for v in d["tensors"]]
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptCheckpointError(f"malformed snapshot index: {e}") from e
        if fmt > INDEX_FORMAT:
            raise CorruptCheckpointError(
                f"snapshot index format {fmt} is newer than this stalwart reads "
                f"({INDEX_FORMAT}); upgrade stalwart"
            )
        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != nbytes:
            raise CorruptCheckpointError(
                f"snapshot of step {step} needs a 1-D uint8 blob of {nbytes} bytes, got "
                f"{data.dtype} of shape {list(data.shape)}"
            )
        for rec in tensors:
            dtype_from_name(rec.dtype)
            if rec.byte_offset < 0 or rec.byte_offset + rec.nbytes > nbytes:
                raise CorruptCheckpointError(f"{rec.fqn}: box lies outside the snapshot blob")
        snap = cls(
            step=step,
            skeleton=skeleton,
            tensors=tensors,
            data=data,
            digest=digest,
            buffer=buffer,
            generation=buffer.generation if buffer is not None else 0,
        )
        if verify:
            snap.verify()
        return snap


def _digest(data: torch.Tensor, like: str | None = None) -> str:
    """XXH3-128 of ``data`` (or BLAKE3 when ``like`` is a format-1 digest)."""
    if like is not None and not like.startswith("xxh3-128:"):
        return chunk_hash(_bytes_of(data))
    return "xxh3-128:" + xxhash.xxh3_128_hexdigest(_bytes_of(data))


def _bytes_of(data: torch.Tensor) -> memoryview:
    if data.numel() == 0:
        return memoryview(b"")
    return data.numpy().data.cast("B")


def _box_problem(fqn: str, t: torch.Tensor, rec: BoxRecord) -> str | None:
    offsets, sizes, _ = local_box(t)
    found = (dtype_name(t.dtype), tuple(t.shape), offsets, sizes)
    if found == (rec.dtype, rec.shape, rec.offsets, rec.sizes):
        return None
    return (
        f"{fqn}: {found[0]}{list(found[1])} box {list(offsets)}+{list(sizes)} in the state, "
        f"{rec.dtype}{list(rec.shape)} box {list(rec.offsets)}+{list(rec.sizes)} in the snapshot"
    )
