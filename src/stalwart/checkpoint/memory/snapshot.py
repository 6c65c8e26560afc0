"""A rank's state captured in host memory: one contiguous byte buffer plus a JSON index.

A :class:`Snapshot` is what the in-memory tier keeps and what erasure coding protects: the
local box of every tensor leaf (the whole tensor for a plain tensor, the local shard of a
DTensor) copied back to back into one ``uint8`` host buffer, each box starting at a multiple
of :data:`ALIGN_BYTES` so that it can be viewed in place with its own dtype. The index (plain
JSON, never pickle) holds the state tree's skeleton, each box's place in the buffer, and the
BLAKE3 digest of the buffer's first ``nbytes`` bytes, which is the blob erasure coding ships.

Buffers are expensive to allocate (fresh pages fault in at a fraction of the copy rate), so a
:class:`SnapshotBuffer` is allocated once and reused; it grows only when a state no longer
fits. Reusing a buffer overwrites the snapshot it held: every capture bumps the buffer's
generation and a snapshot whose generation is stale refuses to be read. Keep two buffers
(double-buffering) when the previous snapshot must survive until the next one is protected.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from stalwart.checkpoint.durable.persist import chunk_hash
from stalwart.checkpoint.durable.plan import is_dtensor, local_box
from stalwart.errors import CorruptCheckpointError, StateMismatchError
from stalwart.tree import dtype_from_name, dtype_name, flatten, get_path, unflatten

__all__ = ["ALIGN_BYTES", "INDEX_FORMAT", "Snapshot", "SnapshotBuffer", "SnapshotTensor"]

ALIGN_BYTES = 64
"""Every box starts at a multiple of this offset in the buffer (cache line; any dtype)."""

INDEX_FORMAT = 1
"""Version of the index JSON written by :meth:`Snapshot.to_bytes`."""


def _align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


class SnapshotBuffer:
    """A grow-only ``uint8`` host buffer reused across snapshots.

    Args:
        nbytes: initial capacity (0 allocates on first use).
        pin_memory: allocate page-locked memory (faster, asynchronous device-to-host copies);
            only meaningful when CUDA is available.

    Attributes:
        generation: bumped every time the contents are about to be overwritten.
        allocations: how many times memory was (re)allocated; a steady state has 1.
    """

    def __init__(self, nbytes: int = 0, *, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self._data = torch.empty(0, dtype=torch.uint8)
        self.generation = 0
        self.allocations = 0
        if nbytes > 0:
            self._grow(nbytes)

    @property
    def capacity(self) -> int:
        """Bytes available without reallocating."""
        return int(self._data.numel())

    def _grow(self, nbytes: int) -> None:
        self._data = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        self.allocations += 1

    def acquire(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` bytes, reallocating only if the capacity is too small.

        Any snapshot that lived in this buffer becomes stale.
        """
        if nbytes > self.capacity:
            self._grow(nbytes)
        self.generation += 1
        return self._data[:nbytes]


@dataclass(frozen=True)
class SnapshotTensor:
    """Where one tensor box lives in a snapshot's buffer.

    Attributes:
        fqn: the tensor's fully qualified name in the state tree.
        dtype: format dtype name (``float32``, ``bfloat16``, ...).
        shape: the tensor's global shape.
        offsets: start of this rank's box in the global tensor.
        sizes: extent of the box (the local tensor's shape).
        byte_offset: where the box's row-major bytes start in the buffer.
        nbytes: length of those bytes.
        dtensor: the state held a DTensor (the box is its local shard).
    """

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    byte_offset: int
    nbytes: int
    dtensor: bool = False

    def to_json(self) -> list[Any]:
        return [
            self.fqn,
            self.dtype,
            list(self.shape),
            list(self.offsets),
            list(self.sizes),
            self.byte_offset,
            self.nbytes,
            self.dtensor,
        ]

    @classmethod
    def from_json(cls, v: Any) -> SnapshotTensor:
        try:
            fqn, dtype, shape, offsets, sizes, byte_offset, nbytes, dt = v
            return cls(
                str(fqn),
                str(dtype),
                tuple(int(x) for x in shape),
                tuple(int(x) for x in offsets),
                tuple(int(x) for x in sizes),
                int(byte_offset),
                int(nbytes),
                bool(dt),
            )
        except (TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"malformed snapshot tensor entry {v!r}") from e


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
        digest: BLAKE3 hex digest of ``data``.
        buffer: the reusable buffer ``data`` lives in (None when ``data`` is standalone).
        generation: the buffer's generation when this snapshot was written.
    """

    step: int
    skeleton: dict[str, Any]
    tensors: list[SnapshotTensor]
    data: torch.Tensor
    digest: str
    buffer: SnapshotBuffer | None = field(default=None, repr=False)
    generation: int = 0

    @property
    def nbytes(self) -> int:
        """Length of the blob (the buffer's used part)."""
        return int(self.data.numel())

    # -- capture ---------------------------------------------------------------------------

    @classmethod
    def capture(cls, state: Any, step: int, buffer: SnapshotBuffer | None = None) -> Snapshot:
        """Copy this rank's part of ``state`` into ``buffer`` (a new one when None).

        Plain tensors are captured whole, DTensors as their local shard; device tensors are
        copied to the host. Python values and stateful objects' ``state_dict()`` go to the
        skeleton (small values only; tensors inside ``state_dict()`` go to the buffer).

        Raises:
            UnsupportedValueError: the state holds something the format cannot store.
        """
        flat = flatten(state)
        records: list[SnapshotTensor] = []
        locals_: list[torch.Tensor] = []
        end = 0
        for leaf in flat.leaves.values():
            t = leaf.tensor
            offsets, sizes, local = local_box(t)
            n = local.numel() * local.element_size()
            start = _align(end)
            records.append(
                SnapshotTensor(
                    leaf.fqn,
                    dtype_name(t.dtype),
                    tuple(int(s) for s in t.shape),
                    offsets,
                    sizes,
                    start,
                    n,
                    is_dtensor(t),
                )
            )
            locals_.append(local)
            end = start + n
        buf = buffer if buffer is not None else SnapshotBuffer()
        data = buf.acquire(end)
        prev = 0
        with torch.no_grad():
            for rec, local in zip(records, locals_, strict=True):
                # Alignment gaps are zeroed: a reused buffer holds stale bytes there, and
                # the digest (and erasure parity) must depend on the state alone.
                if rec.byte_offset > prev:
                    data[prev : rec.byte_offset].zero_()
                if rec.nbytes:
                    _view(data, rec).copy_(local)
                prev = rec.byte_offset + rec.nbytes
        return cls(
            step=int(step),
            skeleton=flat.skeleton,
            tensors=records,
            data=data,
            digest=chunk_hash(_bytes_of(data)),
            buffer=buf,
            generation=buf.generation,
        )

    # -- checks ----------------------------------------------------------------------------

    def _check_fresh(self) -> None:
        if self.buffer is not None and self.buffer.generation != self.generation:
            raise CorruptCheckpointError(
                f"the snapshot of step {self.step} was overwritten: its SnapshotBuffer was "
                "reused by a later capture; keep one buffer per snapshot you still need"
            )

    def verify(self) -> None:
        """Check the buffer against its digest.

        Raises:
            CorruptCheckpointError: the bytes changed since capture, or the buffer was reused.
        """
        self._check_fresh()
        found = chunk_hash(_bytes_of(self.data))
        if found != self.digest:
            raise CorruptCheckpointError(
                f"in-memory snapshot of step {self.step} ({self.nbytes} bytes) fails its "
                f"BLAKE3 digest (expected {self.digest[:16]}…, found {found[:16]}…); "
                "do not restore from it, fall back to a stored checkpoint",
                damaged=[f"snapshot step {self.step}"],
            )

    # -- restore ---------------------------------------------------------------------------

    def tensor(self, fqn: str) -> torch.Tensor:
        """A view of one box's bytes in the buffer, with its dtype and local shape."""
        self._check_fresh()
        for rec in self.tensors:
            if rec.fqn == fqn:
                return _view(self.data, rec)
        raise KeyError(fqn)

    def restore_into(self, state: Any) -> Any:
        """Copy the snapshot back into ``state``'s tensors in place; return the rebuilt tree.

        ``state`` must have the layout it had at capture (same names, dtypes, global shapes
        and local boxes). Tensors the state lacks (a fresh optimizer has no moments yet) are
        handed to their stateful owner as new tensors: the local box, so a DTensor that is
        absent from ``state`` comes back as its local shard. Stateful objects then get their
        sub-tree through ``load_state_dict``.

        Raises:
            StateMismatchError: a tensor's dtype, shape or local box differs.
            CorruptCheckpointError: the buffer was reused since capture.
        """
        self._check_fresh()
        flat = flatten(state)
        by_fqn = {rec.fqn: rec for rec in self.tensors}
        out: dict[str, torch.Tensor] = {}
        problems = []
        for fqn, leaf in flat.leaves.items():
            rec = by_fqn.get(fqn)
            if rec is None:
                continue
            t = leaf.tensor
            offsets, sizes, _ = local_box(t)
            found = (dtype_name(t.dtype), tuple(t.shape), offsets, sizes)
            if found != (rec.dtype, rec.shape, rec.offsets, rec.sizes):
                problems.append(
                    f"{fqn}: {found[0]}{list(found[1])} box {list(offsets)}+{list(sizes)} in "
                    f"the state, {rec.dtype}{list(rec.shape)} box {list(rec.offsets)}+"
                    f"{list(rec.sizes)} in the snapshot"
                )
                continue
            out[fqn] = t
        if problems:
            raise StateMismatchError(
                f"the state does not match the snapshot of step {self.step} "
                f"({len(problems)} problem(s)):\n  " + "\n  ".join(problems[:20])
            )
        with torch.no_grad():
            for fqn, t in out.items():
                rec = by_fqn[fqn]
                if rec.nbytes:
                    local_box(t)[2].copy_(_view(self.data, rec))
        for rec in self.tensors:
            if rec.fqn not in out:
                out[rec.fqn] = _view(self.data, rec).clone()
        tree = unflatten(self.skeleton, out.__getitem__)
        for path, obj in reversed(flat.statefuls):
            obj.load_state_dict(get_path(tree, path))
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
        buffer: SnapshotBuffer | None = None,
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
            tensors = [SnapshotTensor.from_json(v) for v in d["tensors"]]
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


def _view(data: torch.Tensor, rec: SnapshotTensor) -> torch.Tensor:
    """The box ``rec`` as a tensor of its dtype and local shape, sharing ``data``'s memory."""
    raw = data[rec.byte_offset : rec.byte_offset + rec.nbytes]
    dtype = dtype_from_name(rec.dtype)
    if rec.nbytes == 0:
        return torch.empty(rec.sizes, dtype=dtype)
    return raw.view(dtype).view(rec.sizes)


def _bytes_of(data: torch.Tensor) -> memoryview:
    if data.numel() == 0:
        return memoryview(b"")
    return data.numpy().data.cast("B")
