"""The pusher's side of a follow (:mod:`stalwart.elastic.follow`): each committed step's
reduced gradients, buffers and hyper-parameters, sent to the follower from a thread.

:meth:`Feed.push` hands the tensors over and returns: it never waits for the follower. One
in-flight bound (``max_queue`` steps) keeps what the survivors hold alive; past it, or when the
follower is gone, the feed breaks and the survivors train on. The frames on the socket: first
the layout (each tensor's dtype and shape), then per step a JSON header (step, promote,
hyper-parameters) and the tensors' bytes; the follower acknowledges each applied step with
its number. Gradients are sent from their own memory until sent: see
:mod:`stalwart.elastic.follow` on who may touch them.
"""

from __future__ import annotations

import collections
import contextlib
import json
import socket
import struct
import threading
from collections.abc import Sequence
from typing import Any

import torch

from stalwart.elastic.dtensors import local_part
from stalwart.elastic.heal import IDLE_TIMEOUT_S, flat_bytes, gather_addresses, recv_into
from stalwart.errors import ConfigError
from stalwart.tree import dtype_name

__all__ = ["FRAME", "MAX_QUEUE", "Feed", "hyper_parameters", "set_hyper_parameters"]

MAX_QUEUE = 2  # steps a feed holds in flight at most (then: it gives up, the survivors go on)
FRAME = struct.Struct("<q")  # a header's length; an acknowledged step


def hyper_parameters(optimizer: torch.optim.Optimizer) -> list[dict[str, float]]:
    """Each param group's numeric settings (``lr``, ``betas``, ``weight_decay``, ...), as
    JSON-able numbers: what a scheduler may change from one step to the next."""
    out = []
    for group in optimizer.param_groups:
        row: dict[str, Any] = {}
        for k, v in group.items():
            if k == "params":
                continue
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                row[k] = v.item()
            elif isinstance(v, bool | int | float):
                row[k] = v
            elif isinstance(v, tuple | list) and all(isinstance(x, int | float) for x in v):
                row[k] = list(v)
        out.append(row)
    return out


def set_hyper_parameters(optimizer: torch.optim.Optimizer, rows: list[dict[str, Any]]) -> None:
    """Set each param group's settings from :func:`hyper_parameters`'s rows."""
    for group, row in zip(optimizer.param_groups, rows, strict=True):
        for k, v in row.items():
            old = group.get(k)
            if isinstance(old, torch.Tensor):
                old.fill_(v)
            elif isinstance(old, tuple):
                group[k] = tuple(v)
            else:
                group[k] = v


class Feed:
    """The pusher's side: send each committed step's reduced gradients to the follower.

    Build it with :meth:`connect` (collective with :class:`Follower` on the epoch's group).

    Attributes:
        acked: the last step the follower applied (-1 before the first).
        broken: why the feed stopped (None while it runs): the follower died, fell more than
            ``max_queue`` steps behind or refused; the survivors go on, the newcomer heals
            in full.
    """

    def __init__(self, sock: socket.socket | None, *, max_queue: int = MAX_QUEUE,
                 copy: bool = False) -> None:  # fmt: skip
        if max_queue < 1:
            raise ConfigError(f"max_queue={max_queue}: at least 1 step in flight")
        self._sock, self.max_queue, self.copy = sock, max_queue, copy
        self.acked = -1
        self.broken: str | None = None if sock is not None else "not the pusher"
        self._queue: collections.deque[tuple[bytes, list[torch.Tensor]]] = collections.deque()
        self._cv = threading.Condition()
        self._last_ptrs: set[int] = set()
        if sock is not None:
            threading.Thread(target=self._send_loop, name="stalwart-feed", daemon=True).start()
            threading.Thread(target=self._ack_loop, name="stalwart-feed-ack", daemon=True).start()

    @classmethod
    def connect(cls, follower: int, pusher: bool, group: Any,
                params: Sequence[torch.Tensor] = (), buffers: Sequence[torch.Tensor] = (),
                **kwargs: Any) -> Feed:  # fmt: skip
        """Collective on ``group`` with the :class:`Follower` at rank ``follower``: the
        follower's address, then (``pusher``) a connection to it and the layout of what each
        step carries (``params``' gradients, then ``buffers``: dtypes and shapes). Every other
        rank of the group gets a feed that pushes nothing."""
        addresses = gather_addresses(None, group)
        if not pusher:
            return cls(None, **kwargs)
        sock = socket.create_connection(addresses[follower], timeout=IDLE_TIMEOUT_S)
        layout = [[dtype_name(t.dtype), list(local_part(t).shape)] for t in [*params, *buffers]]
        blob = json.dumps({"layout": layout, "params": len(params)}).encode()
        sock.sendall(FRAME.pack(len(blob)) + blob)
        sock.settimeout(None)  # the ack reader waits as long as the follower applies
        return cls(sock, **kwargs)

    def ready(self, step: int, lag: int = 1, base: int = -1) -> bool:
        """Whether step ``step`` may be the promotion boundary: the follower applied every
        step before it but ``lag`` at most (those it applies while the survivors apply
        ``step``); ``base``: the step of a copy it received (it holds that step before any
        acknowledgement). Put it in the step's all-reduce so that every survivor agrees."""
        return self.broken is None and max(self.acked, base) >= step - 1 - lag

    def wait_ready(self, step: int, timeout_s: float, lag: int = 1) -> bool:
        """:meth:`ready`, waiting up to ``timeout_s`` for the follower's acknowledgements."""
        with self._cv:
            self._cv.wait_for(lambda: self.broken is not None or self.ready(step, lag), timeout_s)
        return self.ready(step, lag)

    def push(self, step: int, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor],
             optimizer: torch.optim.Optimizer, *, promote: bool = False) -> bool:  # fmt: skip
        """Hand step ``step``'s reduced gradients (``params``' ``.grad``), reduced float
        ``buffers`` and hyper-parameters to the sender; call after the all-reduce, before
        the update. Returns False (and sends nothing) once the feed is broken.

        Raises:
            ConfigError: the gradients are the tensors of the previous push (gradients zeroed
                in place): pass ``copy=True``.
        """
        if self.broken is not None:
            return False
        grads = [p.grad for p in params]
        if any(g is None for g in grads):
            raise ConfigError("push after the all-reduce: every parameter needs its gradient")
        grads = [local_part(g) for g in grads]  # a replica group's shard: its local part
        ptrs = {g.data_ptr() for g in grads if g is not None and g.numel()}
        if not self.copy and ptrs & self._last_ptrs:
            raise ConfigError(
                "the gradients are the same tensors as at the previous push (zeroed in place: "
                "zero_grad(set_to_none=False)?); the feed reads them from a thread until sent. "
                "Use zero_grad() (set_to_none=True) or Feed(copy=True)"
            )
        self._last_ptrs = ptrs
        tensors = [g.detach().clone() if self.copy else g.detach() for g in grads if g is not None]
        tensors += [local_part(b).detach().clone() for b in buffers]
        header = json.dumps({"step": step, "promote": promote,
                             "hyper": hyper_parameters(optimizer)}).encode()  # fmt: skip
        with self._cv:
            if len(self._queue) >= self.max_queue:
                self._break(f"the follower fell more than {self.max_queue} steps behind")
                return False
            self._queue.append((header, tensors))
            self._cv.notify()
        return True

    def promote_now(self, step: int) -> bool:
        """Promote at ``step`` with no step to push (a boundary where nothing commits); the
        follower must have applied ``step`` already (:meth:`ready` of ``step + 1`` with
        ``lag=0``). Returns False once the feed is broken."""
        if self.broken is not None:
            return False
        header = json.dumps({"step": step, "promote": True, "bare": True}).encode()
        with self._cv:
            self._queue.append((header, []))
            self._cv.notify()
        return True

    def close(self) -> None:
        """Stop sending (a promotion done or abandoned); drops every held gradient."""
        self._break("closed")

    def _break(self, why: str) -> None:
        with self._cv:
            if self.broken is None:
                self.broken = why
            self._queue.clear()
            self._cv.notify_all()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)

    def _send_loop(self) -> None:
        assert self._sock is not None
        try:
            while True:
                with self._cv:
                    while not self._queue and self.broken is None:
                        self._cv.wait()
                    if self.broken is not None:
                        return
                    header, tensors = self._queue[0]
                self._sock.sendall(FRAME.pack(len(header)) + header)
                for t in tensors:
                    self._sock.sendall(memoryview(flat_bytes(t).cpu().numpy()))
                with self._cv:
                    if self._queue:
                        self._queue.popleft()  # the references go: the memory is freed
        except OSError as e:
            self._break(f"the follower's connection failed: {e}")
        finally:
            self._sock.close()

    def _ack_loop(self) -> None:
        assert self._sock is not None
        buf = bytearray(FRAME.size)
        try:
            while self.broken is None:
                recv_into(self._sock, memoryview(buf))
                self.acked = FRAME.unpack(buf)[0]
                with self._cv:
                    self._cv.notify_all()
        except OSError as e:
            self._break(f"the follower stopped: {e}")
