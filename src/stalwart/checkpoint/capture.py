"""One capture path for every tier: copy this rank's tensor boxes into one reused host buffer.

    stage(items, buffer, defer) ──► layout (every box at an aligned offset of one buffer)
                                 ──► copy now: every box the caller may change next
                                 ──► finish(): copy the deferred boxes (a background thread)

A :class:`Capture` is what every tier consumes: the memory tier keeps it as a snapshot (and
erasure coding protects its bytes), the durable engine hashes and writes its boxes. A step is
copied to host once, however many tiers are due.

**What may be deferred.** Only boxes whose storage a guarded optimizer owns (its parameters
and its state) are deferred: they change only inside ``optimizer.step()``, and the guard makes
that step wait for :meth:`Capture.finish`. Everything else (BatchNorm buffers changed by the
next forward, EMA weights changed by hooks, RNG state, user tensors) is copied before
:func:`stage` returns, so the capture's content is fixed at the call whatever the model does.

**CUDA.** Copies run on a side stream that first waits for the producer stream (the stream
current at the call), so they never read a tensor before the kernels writing it finish;
sources are ``record_stream``-ed so that their memory is not reused while the copy runs; the
producer stream then waits for the eager copies (so the training's next kernels cannot
overwrite a box being read), and readers of the host bytes call :meth:`Capture.ready`, which
synchronises with the copies' event. Host buffers are pinned and reused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from stalwart.errors import CorruptCheckpointError

__all__ = [
    "ALIGN_BYTES",
    "BoxRecord",
    "Capture",
    "HostBuffer",
    "box_view",
    "optimizer_storages",
    "stage",
    "storage_key",
]

ALIGN_BYTES = 64
"""Every box starts at a multiple of this offset in the buffer (cache line; any dtype)."""


def _align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


class HostBuffer:
    """A grow-only ``uint8`` host buffer reused across captures (the only host buffer type).

    Args:
        nbytes: initial capacity (0 allocates on first use).
        pin_memory: page-locked memory (asynchronous device-to-host copies); only where CUDA
            is available.

    Attributes:
        generation: bumped every time the contents are about to be overwritten.
        allocations: how many times memory was (re)allocated; a steady state has 1.
        reused_bytes: bytes acquired without allocating (fresh pages cost several times more).
    """

    can_pin = True
    """False for buffers whose memory is mapped from elsewhere (a tmpfs file)."""

    def __init__(self, nbytes: int = 0, *, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self._data = torch.empty(0, dtype=torch.uint8)
        self.generation = 0
        self.allocations = 0
        self.reused_bytes = 0
        self.allocated_bytes = 0
        if nbytes > 0:
            self._grow(nbytes)

    @property
    def capacity(self) -> int:
        """Bytes available without reallocating."""
        return int(self._data.numel())

    def _grow(self, nbytes: int) -> None:
        self._data = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        self.allocations += 1
        self.allocated_bytes += nbytes

    def acquire(self, nbytes: int, *, pin_memory: bool = False) -> torch.Tensor:
        """The first ``nbytes`` bytes, reallocating only if the capacity is too small.

        Any capture that lived in this buffer becomes stale.
        """
        if pin_memory and self.can_pin and not self.pin_memory and torch.cuda.is_available():
            self.pin_memory = True
            self._data = torch.empty(0, dtype=torch.uint8)
        if nbytes > self.capacity:
            self._grow(nbytes)
        else:
            self.reused_bytes += nbytes
        self.generation += 1
        return self._data[:nbytes]


@dataclass(frozen=True)
class BoxRecord:
    """Where one tensor box lives in a capture's buffer.

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
    def from_json(cls, v: Any) -> BoxRecord:
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
        except (TypeError, ValueError, OverflowError) as e:
            raise CorruptCheckpointError(f"malformed snapshot tensor entry {v!r:.200}") from e


def box_view(data: torch.Tensor, rec: BoxRecord) -> torch.Tensor:
    """The box ``rec`` as a tensor of its dtype and local shape, sharing ``data``'s memory."""
    from stalwart.tree import dtype_from_name

    dtype = dtype_from_name(rec.dtype)
    if rec.nbytes == 0:
        return torch.empty(rec.sizes, dtype=dtype)
    return data[rec.byte_offset : rec.byte_offset + rec.nbytes].view(dtype).view(rec.sizes)


def storage_key(t: torch.Tensor) -> int:
    """Identity of the memory ``t`` lives in (its storage's address; 0 for none)."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # meta, sparse, nested: never deferred
        return 0


def optimizer_storages(optimizers: Iterable[torch.optim.Optimizer]) -> frozenset[int]:
    """Storages that only ``optimizer.step()`` writes: the parameters and the optimizer state.

    A box in one of them may be copied lazily behind the optimizer guard.
    """
    keys: set[int] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                keys.add(storage_key(_local(p)))
        for st in opt.state.values():
            for v in st.values() if isinstance(st, dict) else ():
                if isinstance(v, torch.Tensor):
                    keys.add(storage_key(_local(v)))
    keys.discard(0)
    return frozenset(keys)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) and hasattr(t, "device_mesh") else t


class Capture:
    """This rank's tensor boxes copied back to back into one host buffer.

    Attributes:
        records: every box, in buffer order.
        data: ``uint8`` view of the buffer's used part.
        buffer: the reusable buffer ``data`` lives in.
        generation: the buffer's generation when this capture was laid out.
        copied_bytes: bytes copied into ``data`` so far (a test counts host copies with it).
    """

    def __init__(self, records: list[BoxRecord], data: torch.Tensor, buffer: HostBuffer) -> None:
        self.records = records
        self.data = data
        self.buffer = buffer
        self.generation = buffer.generation
        self.copied_bytes = 0
        self._events: list[Any] = []  # CUDA events of copies still running
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    def check_fresh(self, what: str = "capture") -> None:
        """Raise if a later capture reused the buffer."""
        if self.buffer.generation != self.generation:
            raise CorruptCheckpointError(
                f"the {what} was overwritten: its host buffer was reused by a later capture; "
                "keep one buffer per capture you still need"
            )

    def view(self, rec: BoxRecord) -> torch.Tensor:
        return box_view(self.data, rec)

    def copy_boxes(
        self, pairs: list[tuple[BoxRecord, torch.Tensor]], *, eager: bool, producer: Any = None
    ) -> None:
        """Copy ``(record, source)`` pairs into the buffer (see the module doc for CUDA).

        ``producer``: a CUDA event recorded on the training's stream when the capture was
        asked for; deferred copies (another thread, another current stream) wait for it.
        """
        cuda = [src for _, src in pairs if src.device.type == "cuda"]
        stream = torch.cuda.Stream(device=cuda[0].device) if cuda else None
        if stream is not None:
            if producer is not None:
                stream.wait_event(producer)
            else:
                stream.wait_stream(torch.cuda.current_stream(cuda[0].device))
        with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else _Null():
            for rec, src in pairs:
                if rec.nbytes:
                    self.view(rec).copy_(src.detach(), non_blocking=stream is not None)
                    if stream is not None and src.device.type == "cuda":
                        src.record_stream(stream)
        n = sum(rec.nbytes for rec, _ in pairs)
        with self._lock:
            self.copied_bytes += n
        if stream is not None:
            event = stream.record_event()
            if eager:  # the training's next kernels may not overwrite a box being read
                torch.cuda.current_stream(cuda[0].device).wait_event(event)
            with self._lock:
                self._events.append(event)

    def order_after_copies(self) -> None:
        """Make the current CUDA stream wait for the copies (the optimizer guard calls it)."""
        with self._lock:
            events = list(self._events)
        for e in events:
            torch.cuda.current_stream().wait_event(e)

    def ready(self) -> None:
        """Block until every copy has landed in host memory (readers call it first)."""
        with self._lock:
            events, self._events = self._events, []
        for e in events:
            e.synchronize()


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def stage(
    items: list[Any], buffer: HostBuffer, *, defer: frozenset[int] = frozenset()
) -> tuple[Capture, Callable[[], None] | None]:
    """Lay ``items`` (``LocalItem``s) out in ``buffer``; copy every box not in ``defer`` now.

    Args:
        items: this rank's boxes (``fqn``, ``dtype``, ``shape``, ``offsets``, ``sizes``,
            ``tensor``).
        buffer: the host buffer to reuse.
        defer: storages (:func:`storage_key`) whose boxes may be copied later.

    Returns:
        The capture and ``finish``, which copies the deferred boxes (None when none were).
    """
    from stalwart.tree import dtype_name

    records: list[BoxRecord] = []
    end = 0
    for it in items:
        t = it.tensor
        n = t.numel() * t.element_size()
        start = _align(end)
        records.append(
            BoxRecord(
                it.fqn,
                dtype_name(t.dtype),
                tuple(it.shape),
                tuple(it.offsets),
                tuple(it.sizes),
                start,
                n,
                bool(getattr(it, "dtensor", False)),
            )
        )
        end = start + n
    pin = any(it.tensor.device.type == "cuda" for it in items)
    data = buffer.acquire(end, pin_memory=pin)
    cap = Capture(records, data, buffer)
    # Alignment gaps are zeroed: a reused buffer holds stale bytes there, and digests (and
    # erasure parity) must depend on the state alone.
    prev = 0
    for rec in records:
        if rec.byte_offset > prev:
            data[prev : rec.byte_offset].zero_()
        prev = rec.byte_offset + rec.nbytes
    now: list[tuple[BoxRecord, torch.Tensor]] = []
    later: list[tuple[BoxRecord, torch.Tensor]] = []
    for rec, it in zip(records, items, strict=True):
        (later if defer and storage_key(it.tensor) in defer else now).append((rec, it.tensor))
    cap.copy_boxes(now, eager=True)
    if not later:
        return cap, None
    producer = torch.cuda.current_stream().record_event() if pin else None
    return cap, lambda: cap.copy_boxes(later, eager=False, producer=producer)
