"""The bytes of backup-worker steps: tensors as one raw buffer, metadata as a small pickle.

Every backup step moves each contribution through the coordinator's store and back as one
result (:mod:`stalwart.elastic.backup`), so encoding sits on the step's critical path. A
``torch.save`` round trip costs milliseconds even for a few kilobytes (zip container, one
record per tensor); here the tensors are concatenated as raw bytes (any dtype, bf16 included)
after a pickled header, and decoded against templates of the same shapes and dtypes (every
member's parameters and buffers have them). The RNG states travel as plain arrays.

Layout: ``len(header)`` (8 bytes, little-endian), ``pickle(header)``, then the tensors' bytes
in order. Trusted peers only (pickle), like the store itself.
"""

from __future__ import annotations

import contextlib
import pickle
import queue
import random
import statistics
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["Janitor", "Result", "decode", "encode", "mean", "rng_state", "set_rng_state"]

_LEN = 8


def encode(header: Any, tensors: Sequence[torch.Tensor]) -> bytes:
    """``header`` (picklable) and the tensors' raw bytes, in one buffer."""
    head = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
    parts = [len(head).to_bytes(_LEN, "little"), head]
    parts += [_raw(t) for t in tensors]
    return b"".join(parts)


def decode(data: bytes, templates: Sequence[torch.Tensor]) -> tuple[Any, list[torch.Tensor]]:
    """The header and tensors shaped like ``templates`` (fresh memory, not views of ``data``).

    Raises:
        ValueError: the byte count does not match the templates (peers with different models).
    """
    n = int.from_bytes(data[:_LEN], "little")
    sizes = [t.numel() * t.element_size() for t in templates]
    if _LEN + n + sum(sizes) != len(data):
        raise ValueError(
            f"a backup-step message has {len(data) - _LEN - n} tensor bytes, the local model "
            f"expects {sum(sizes)}: every member must build the same parameters and buffers "
            "(same shapes and dtypes)"
        )
    header = pickle.loads(data[_LEN : _LEN + n])
    offset, out = _LEN + n, []
    raw = memoryview(data)
    for t, size in zip(templates, sizes, strict=True):
        if size == 0:
            out.append(torch.empty_like(t))
            continue
        chunk = torch.frombuffer(bytearray(raw[offset : offset + size]), dtype=torch.uint8)
        out.append(chunk.view(t.dtype).view(t.shape))
        offset += size
    return header, out


def _raw(t: torch.Tensor) -> bytes:
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    return flat.view(torch.uint8).numpy().tobytes()


@dataclass(frozen=True)
class Result:
    """One committed step's reduction, the same bytes for every member."""

    grads: list[torch.Tensor]
    buffers: list[torch.Tensor]
    used: tuple[int, ...]  # ranks whose contributions were averaged, in ticket order
    next_k: int
    change: float  # 1.0: a newer epoch was published, reconfigure after this step
    rng: tuple[Any, ...]
    times: Mapping[int, Mapping[int, float]] = field(default_factory=dict)  # step -> rank -> s
    posted: float = 0.0  # the reducer's wall clock when it posted this result
    intervals: tuple[float, ...] = ()  # the last intervals between results' posts, seconds
    noise: tuple[float, ...] = ()  # the last gradient noise scale estimates (Dynamic)
    costs: tuple[float, ...] = ()  # the last commit costs: interval - slowest used time (Dynamic)
    shares: tuple[float, ...] = ()  # each used member's share of its batch (1.0: all of it)

    @property
    def pace(self) -> float:
        """The median interval between results (0.0 before two were posted)."""
        return statistics.median(self.intervals) if self.intervals else 0.0

    def encode(self) -> bytes:
        """The bytes every member decodes (see :mod:`stalwart.elastic.backup_wire`)."""
        header = (self.used, self.next_k, self.change, self.rng, dict(self.times),
                  self.posted, self.intervals, self.noise, self.costs, self.shares,
                  len(self.grads))  # fmt: skip
        return encode(header, [*self.grads, *self.buffers])

    @classmethod
    def decode(cls, data: bytes, templates: Sequence[torch.Tensor]) -> Result:
        """The result in ``data``; ``templates``: the local gradients then buffers."""
        head, tensors = decode(data, templates)
        *fields, n = head
        return cls(tensors[:n], tensors[n:], *fields)


def mean(tensors: Sequence[torch.Tensor], total: float | None = None) -> torch.Tensor:
    """Sum in ticket order, accumulated in float64, divided by ``total`` (default: the count).

    Returned in the inputs' dtype. Partial contributions pass the sum of their shares.
    """
    acc = torch.zeros_like(tensors[0], dtype=torch.float64)
    for t in tensors:
        acc += t.to(torch.float64)
    return (acc / (len(tensors) if total is None else total)).to(tensors[0].dtype)


def rng_state(generators: Sequence[torch.Generator]) -> tuple[Any, ...]:
    """The global torch, numpy and Python RNG states and the named generators', as arrays."""
    version, py_state, gauss = random.getstate()
    return (torch.get_rng_state().numpy(), np.random.get_state(),
            (version, np.asarray(py_state, dtype=np.uint64), gauss),
            [g.get_state().numpy() for g in generators])  # fmt: skip


def set_rng_state(rng: tuple[Any, ...], generators: Sequence[torch.Generator]) -> None:
    """Adopt the reducer's RNG state (global torch, numpy, Python and named generators)."""
    torch.set_rng_state(torch.from_numpy(np.array(rng[0])))
    np.random.set_state(rng[1])
    version, py_state, gauss = rng[2]
    random.setstate((version, tuple(int(v) for v in py_state), gauss))
    for g, st in zip(generators, rng[3], strict=True):
        g.set_state(torch.from_numpy(np.array(st)))


class Janitor:
    """Deletes store keys on a thread with its own connection, off the step's critical path.

    Deleting an old step's keys costs one store round trip per key; done inline it would
    delay the reducer's next step. A ``TCPStore`` gets a second client connection (a store
    connection is not shared between threads); any other store is cleaned inline.
    """

    def __init__(self, store: dist.Store) -> None:
        self._store = store
        self._queue: queue.SimpleQueue[list[str] | None] | None = None
        self._thread: threading.Thread | None = None
        if isinstance(store, dist.TCPStore):
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(
                target=self._run, name="stalwart-backup-janitor", daemon=True
            )
            self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Delete what is queued, then stop the thread and drop its connection."""
        if self._queue is not None and self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_s)
            self._thread = None

    def delete(self, keys: list[str]) -> None:
        """Delete ``keys`` soon (missing keys are fine)."""
        if self._queue is None:
            for key in keys:
                self._store.delete_key(key)
        else:
            self._queue.put(keys)

    def _run(self) -> None:
        assert self._queue is not None and isinstance(self._store, dist.TCPStore)
        try:
            own = dist.TCPStore(self._store.host, self._store.port, is_master=False,
                                timeout=self._store.timeout, wait_for_workers=False)  # fmt: skip
        except RuntimeError:  # the coordinator is gone: nothing left to clean
            return
        while True:
            batch = self._queue.get()
            if batch is None:  # close()
                return
            with contextlib.suppress(RuntimeError):  # the coordinator went away meanwhile
                for key in batch:
                    own.delete_key(key)
