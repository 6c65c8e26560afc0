"""Healing off the survivors' critical path: the committed updates pushed to a follower.

The first design for healing while the survivors commit (:mod:`stalwart.elastic.catchup`)
put the newcomer in the synchronous all-reduce as a *listener*: measured at 2 GiB on 2 shared
cores, every second of its work (receiving, a thrown-away forward and backward, zero-filled
gradients, the replay) became the survivors' wait in the all-reduce (docs/elastic.md, "What
the measurement says about the design"). Here the newcomer is a **follower**, outside the
survivors' group until it is promoted:

* one survivor, the *pusher*, holds a :class:`Feed`: after each step's all-reduce it hands
  the reduced gradients, the reduced float buffers and the optimizer's per-group
  hyper-parameters (learning rate, betas, weight decay: whatever a scheduler changed) to a
  thread that sends them over one socket. :meth:`Feed.push` never waits for the follower: a
  follower too far behind (more than ``max_queue`` steps in flight) or gone breaks the feed,
  and the survivors train on (the newcomer then heals in full);
* the :class:`Follower` receives the lent copy of the boundary's step ``s``
  (:class:`~stalwart.elastic.catchup.Lender`, :func:`~stalwart.elastic.catchup.receive_copy`)
  and the pushed steps ``s+1, s+2, ...`` in threads, and :meth:`Follower.follow` applies them
  in order with its own optimizer at its own pace (the optimizer only: no forward, no
  backward), acknowledging each on the same socket;
* when the follower has applied every step before ``t`` (:meth:`Feed.ready`), the survivors
  agree, inside step ``t``'s all-reduce, that ``t`` is the promotion boundary; the pusher
  pushes ``t`` marked ``promote`` right after the all-reduce, so the follower applies it while
  the survivors apply their own; then everyone meets on the epoch's group for the rest a
  replay does not rebuild (:func:`~stalwart.elastic.catchup.send_rest`) and the digests.

**Bit parity.** The follower applies the bytes every survivor applied, with the same optimizer
class and settings and the hyper-parameters each step used, so its parameters and moments are
the survivors' bit for bit; the rest (RNG states, integer buffers, the optimizer's step
counts) comes with the promotion. The caller checks the digests (a mismatch: a full heal).

**Who may touch the pushed tensors.** The gradients are sent from the tensors themselves (no
copy) until the next push: a caller must not change them in place meanwhile. PyTorch's
``zero_grad()`` sets them to ``None`` (new tensors each step), which is safe; a caller whose
gradients are the same tensors every step (``zero_grad(set_to_none=False)``) gets a clear
error at its second push, or passes ``copy=True``. Buffers are copied at the push (a forward
updates them in place), as are the hyper-parameters.

**What it costs.** On the pusher: one send of the parameters' bytes per step, from a thread
(a loopback copy on one host, the NIC across hosts) and at most ``max_queue`` steps of
gradients held alive. On the follower: the received steps it has not applied yet, bounded by
``max_steps`` and ``max_bytes`` (past them it stops and :attr:`Follower.over` is set).
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

from stalwart.elastic.catchup import MAX_BYTES, MAX_STEPS, receive_copy
from stalwart.elastic.dtensors import is_dtensor
from stalwart.elastic.heal import IDLE_TIMEOUT_S, gather_addresses, open_listener
from stalwart.elastic.state import live_targets, load_leaves
from stalwart.errors import ConfigError, DistributedError

__all__ = ["MAX_QUEUE", "Feed", "Follower", "hyper_parameters"]

MAX_QUEUE = 2  # steps a feed holds in flight at most (then: it gives up, the survivors go on)
_INT = struct.Struct("<q")


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


def _set_hyper_parameters(optimizer: torch.optim.Optimizer, rows: list[dict[str, Any]]) -> None:
    for group, row in zip(optimizer.param_groups, rows, strict=True):
        for k, v in row.items():
            old = group.get(k)
            if isinstance(old, torch.Tensor):
                old.fill_(v)
            elif isinstance(old, tuple):
                group[k] = tuple(v)
            else:
                group[k] = v


def _bytes(t: torch.Tensor) -> memoryview:
    """A CPU tensor's own memory, flat bytes (no copy for a contiguous tensor)."""
    return memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    while len(view):
        got = sock.recv_into(view, min(len(view), 64 << 20))
        if got == 0:
            raise ConnectionError("the feed's peer closed its connection")
        view = view[got:]


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
    def connect(cls, follower: int, pusher: bool, group: Any, **kwargs: Any) -> Feed:
        """Collective on ``group`` with the :class:`Follower` at rank ``follower``: the
        follower's address, then (``pusher``) a connection to it. Every other rank of the
        group gets a feed that pushes nothing."""
        addresses = gather_addresses(None, group)
        if not pusher:
            return cls(None, **kwargs)
        sock = socket.create_connection(addresses[follower], timeout=IDLE_TIMEOUT_S)
        sock.settimeout(None)  # the ack reader waits as long as the follower applies
        return cls(sock, **kwargs)

    def ready(self, step: int, lag: int = 1) -> bool:
        """Whether step ``step`` may be the promotion boundary: the follower applied every
        step before it but ``lag`` at most (those it applies while the survivors apply
        ``step``). Put it in the step's all-reduce so that every survivor agrees."""
        return self.broken is None and self.acked >= step - 1 - lag

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
        if any(is_dtensor(g) for g in grads):
            raise ConfigError("a follow carries replicated state only; a sharded state "
                              "(DTensor leaves) heals at the epoch change")  # fmt: skip
        ptrs = {g.data_ptr() for g in grads if g is not None and g.numel()}
        if not self.copy and ptrs & self._last_ptrs:
            raise ConfigError(
                "the gradients are the same tensors as at the previous push (zeroed in place: "
                "zero_grad(set_to_none=False)?); the feed reads them from a thread until sent. "
                "Use zero_grad() (set_to_none=True) or Feed(copy=True)"
            )
        self._last_ptrs = ptrs
        tensors = [g.detach().clone() if self.copy else g.detach() for g in grads if g is not None]
        tensors += [b.detach().clone() for b in buffers]
        header = json.dumps({"step": step, "promote": promote,
                             "hyper": hyper_parameters(optimizer)}).encode()  # fmt: skip
        with self._cv:
            if len(self._queue) >= self.max_queue:
                self._break(f"the follower fell more than {self.max_queue} steps behind")
                return False
            self._queue.append((header, tensors))
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
                self._sock.sendall(_INT.pack(len(header)) + header)
                for t in tensors:
                    self._sock.sendall(_bytes(t))
                with self._cv:
                    if self._queue:
                        self._queue.popleft()  # the references go: the memory is freed
        except OSError as e:
            self._break(f"the follower's connection failed: {e}")
        finally:
            self._sock.close()

    def _ack_loop(self) -> None:
        assert self._sock is not None
        buf = bytearray(_INT.size)
        try:
            while self.broken is None:
                _recv_into(self._sock, memoryview(buf))
                self.acked = _INT.unpack(buf)[0]
                with self._cv:
                    self._cv.notify_all()
        except OSError as e:
            self._break(f"the follower stopped: {e}")


class Follower:
    """A newcomer's side: take the lent copy and the pushed steps, apply them in order.

    Collective at construction on ``group`` (the copy's address, with every
    :class:`~stalwart.elastic.catchup.Lender`, then the feed's, with :meth:`Feed.connect`).

    Args:
        state: this member's state, overwritten by the copy.
        optimizer: the optimizer the pushed steps are applied with (the survivors' class and
            settings), over ``params``.
        params, buffers: the parameters and floating-point buffers, in the survivors' order.
        holders: how many survivors lend the copy.
        group: the epoch's process group (this member in it).
        max_steps, max_bytes: received steps not applied yet, at most (then :attr:`over`).

    Attributes:
        step: the last step applied (None before the copy is loaded).
        over: a bound was passed or the feed broke: :meth:`follow` raises, heal in full.
    """

    def __init__(self, state: Any, optimizer: torch.optim.Optimizer,
                 params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor], holders: int,
                 group: Any, *, max_steps: int = MAX_STEPS, max_bytes: int = MAX_BYTES,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, **copy_options: Any) -> None:  # fmt: skip
        self.state, self.optimizer = state, optimizer
        self.params, self.buffers = list(params), list(buffers)
        self.max_steps, self.max_bytes = max_steps, max_bytes
        self.step: int | None = None
        self.over: str | None = None
        self.copy = receive_copy(holders, group, **copy_options)
        self._steps: collections.deque[tuple[dict[str, Any], list[torch.Tensor]]] = (
            collections.deque()
        )
        self._cv = threading.Condition()
        self._held = 0
        self._timeout = idle_timeout_s
        listener = open_listener()
        try:
            gather_addresses(listener, group)
            self._sock, _ = listener.accept()
        finally:
            listener.close()
        self._sock.settimeout(idle_timeout_s)
        threading.Thread(target=self._receive_loop, name="stalwart-follow", daemon=True).start()

    def _receive_loop(self) -> None:
        try:
            while True:
                head = bytearray(_INT.size)
                _recv_into(self._sock, memoryview(head))
                header = json.loads(bytes(self._recv(_INT.unpack(head)[0])))
                tensors = []
                for like in [*self.params, *self.buffers]:
                    t = torch.empty(like.shape, dtype=like.dtype)
                    _recv_into(self._sock, _bytes(t))
                    tensors.append(t)
                size = sum(t.numel() * t.element_size() for t in tensors)
                with self._cv:
                    if len(self._steps) >= self.max_steps or self._held + size > self.max_bytes:
                        self._stop(f"more than {self.max_steps} steps or {self.max_bytes} "
                                   "bytes received and not applied")  # fmt: skip
                        return
                    self._steps.append((header, tensors))
                    self._held += size
                    self._cv.notify_all()
                if header["promote"]:
                    return
        except (OSError, ValueError) as e:
            with self._cv:
                self._stop(f"the feed failed: {e}")

    def _recv(self, n: int) -> bytearray:
        buf = bytearray(n)
        _recv_into(self._sock, memoryview(buf))
        return buf

    def _stop(self, why: str) -> None:  # with self._cv held
        if self.over is None:
            self.over = why
        self._steps.clear()
        self._held = 0
        self._cv.notify_all()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def follow(self) -> int:
        """Load the copy, then apply the pushed steps in order, acknowledging each, until the
        one marked ``promote`` is applied; returns that step (the survivors' step).

        Raises:
            DistributedError: the copy or the feed failed, a bound was passed, a step is
                missing, or nothing arrived for ``idle_timeout_s``: heal in full.
        """
        try:
            header, leaves = self.copy.result()
        except RuntimeError as e:
            raise DistributedError(f"the lent copy did not arrive ({e}): heal in full") from e
        self.step = load_leaves(self.state, header, leaves, live_targets(self.state, header))
        while True:
            with self._cv:
                if not self._steps and self.over is None:
                    self._cv.wait(self._timeout)
                if self.over is not None:
                    raise DistributedError(f"the follower stopped ({self.over}): heal in full")
                if not self._steps:
                    raise DistributedError(
                        f"no pushed step for {self._timeout:.0f} s after step {self.step}: "
                        "heal in full"
                    )
                header, tensors = self._steps.popleft()
                self._held -= sum(t.numel() * t.element_size() for t in tensors)
            self._apply(header, tensors)
            if header["promote"]:
                self._sock.close()
                return self.step

    def _apply(self, header: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        assert self.step is not None
        if header["step"] <= self.step:
            return  # pushed before the copy's step: the copy already holds it
        if header["step"] != self.step + 1:
            raise DistributedError(
                f"pushed step {header['step']} follows step {self.step}: a step is missing, "
                "heal in full"
            )
        n = len(self.params)
        _set_hyper_parameters(self.optimizer, header["hyper"])
        for p, g in zip(self.params, tensors[:n], strict=True):
            p.grad = g
        self.optimizer.step()
        with torch.no_grad():
            for b, reduced in zip(self.buffers, tensors[n:], strict=True):
                b.copy_(reduced)
        for p in self.params:
            p.grad = None
        self.step = header["step"]
        try:
            self._sock.sendall(_INT.pack(self.step))
        except OSError as e:
            raise DistributedError(f"the pusher is gone ({e}): heal in full") from e
