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
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from stalwart.elastic.catchup import MAX_BYTES, MAX_STEPS, receive_copy
from stalwart.elastic.dtensors import as_like, local_part
from stalwart.elastic.feed import FRAME, set_hyper_parameters
from stalwart.elastic.heal import (
    IDLE_TIMEOUT_S,
    flat_bytes,
    gather_addresses,
    open_listener,
    recv_into,
)
from stalwart.elastic.state import live_targets, load_leaves
from stalwart.errors import ConfigError, DistributedError
from stalwart.tree import dtype_from_name, dtype_name

__all__ = ["Follower"]


class Follower:
    """A newcomer's side: take the lent copy and the pushed steps, apply them in order.

    Collective at construction on ``group`` (the copy's address, with every
    :class:`~stalwart.elastic.catchup.Lender`, then the feed's, with :meth:`Feed.connect`);
    it needs no model yet: the copy and the steps are received from then on, in threads, and
    :meth:`follow` applies them once the caller has its state, optimizer and parameters.

    Args:
        holders: how many survivors lend the copy.
        group: the epoch's process group (this member in it).
        max_steps, max_bytes: received steps not applied yet, at most (then :attr:`over`).
        idle_timeout_s: a pushed step must arrive within this long of the previous one.

    Attributes:
        step: the last step applied (None before the copy is loaded).
        over: a bound was passed or the feed broke: :meth:`follow` raises, heal in full.
    """

    def __init__(self, holders: int, group: Any, *, max_steps: int = MAX_STEPS,
                 max_bytes: int = MAX_BYTES, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 **copy_options: Any) -> None:  # fmt: skip
        self.max_steps, self.max_bytes = max_steps, max_bytes
        self.step: int | None = None
        self.over: str | None = None
        self.copy = receive_copy(holders, group, **copy_options)
        self._steps: collections.deque[tuple[dict[str, Any], list[torch.Tensor]]] = (
            collections.deque()
        )
        self._cv = threading.Condition()
        self._held = 0
        self._idle_s = idle_timeout_s
        self._layout: dict[str, Any] | None = None
        listener = open_listener()
        try:
            gather_addresses(listener, group)
            self._sock, _ = listener.accept()
        finally:
            listener.close()
        self._sock.settimeout(idle_timeout_s)
        threading.Thread(target=self._receive_loop, name="stalwart-follow", daemon=True).start()

    def _message(self) -> dict[str, Any]:
        head = bytearray(FRAME.size)
        recv_into(self._sock, memoryview(head))
        return json.loads(bytes(self._recv(FRAME.unpack(head)[0])))

    def _receive_loop(self) -> None:
        try:
            layout = self._message()
            with self._cv:
                self._layout = layout
                self._cv.notify_all()
            kinds = [(dtype_from_name(d), shape) for d, shape in layout["layout"]]
            while True:
                header = self._message()
                tensors = []
                for dtype, shape in [] if header.get("bare") else kinds:
                    t = torch.empty(shape, dtype=dtype)
                    recv_into(self._sock, memoryview(flat_bytes(t).numpy()))
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
        recv_into(self._sock, memoryview(buf))
        return buf

    def close(self) -> None:
        """Stop following (the caller gives the follow up): the pusher's feed breaks."""
        with self._cv:
            self._stop("withdrawn")

    def _stop(self, why: str) -> None:  # with self._cv held
        if self.over is None:
            self.over = why
        self._steps.clear()
        self._held = 0
        self._cv.notify_all()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def follow(self, state: Any, optimizer: torch.optim.Optimizer,
               params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor], *,
               abandon: Callable[[], bool] | None = None, poll_s: float = 0.2) -> int:  # fmt: skip
        """Load the copy into ``state``, then apply the pushed steps in order with
        ``optimizer`` (the survivors' class and settings, over ``params``; ``buffers``: the
        floating-point buffers, in the survivors' order), acknowledging each, until the one
        marked ``promote``; returns that step (the survivors' step).

        ``abandon``: asked every ``poll_s`` while waiting; True stops the follow (a newer
        epoch was published, say).

        Raises:
            DistributedError: the copy or the feed failed, a bound was passed, a step is
                missing, ``abandon`` said so, or nothing arrived for ``idle_timeout_s``: heal
                in full. ConfigError: the survivors' parameters or buffers differ from these.
        """
        layout = self._wait(lambda: self._layout, abandon, poll_s)
        mine = [[dtype_name(t.dtype), list(local_part(t).shape)] for t in [*params, *buffers]]
        if mine != layout["layout"] or layout["params"] != len(params):
            raise ConfigError(
                "the survivors push gradients and buffers of other dtypes or shapes than this "
                "member's parameters and buffers: build the same model and optimizer on "
                "every member"
            )
        self._wait(self.copy.done, abandon, poll_s, idle=False)  # a broken feed ends it too
        try:
            header, leaves = self.copy.result()
        except RuntimeError as e:
            raise DistributedError(f"the lent copy did not arrive ({e}): heal in full") from e
        self.step = load_leaves(state, header, leaves, live_targets(state, header))
        while True:
            header, tensors = self._wait(lambda: self._steps and self._steps[0], abandon, poll_s)
            with self._cv:
                self._steps.popleft()
                self._held -= sum(t.numel() * t.element_size() for t in tensors)
            if header.get("bare"):
                if header["step"] != self.step:
                    raise DistributedError(
                        f"promoted at step {header['step']} with step {self.step} applied: "
                        "heal in full"
                    )
            else:
                self._apply(header, tensors, optimizer, list(params), list(buffers))
            if header["promote"]:
                self._sock.close()
                return self.step

    def _wait(self, ready: Callable[[], Any], abandon: Callable[[], bool] | None,
              poll_s: float, idle: bool = True) -> Any:  # fmt: skip
        """``ready()``'s value once truthy; raises when the follow stopped, was abandoned or
        (``idle``) waited ``idle_timeout_s``."""
        waited = 0.0
        with self._cv:
            while not (got := ready()):
                if self.over is not None:
                    raise DistributedError(f"the follower stopped ({self.over}): heal in full")
                if abandon is not None and abandon():
                    self._stop("abandoned")
                    raise DistributedError("the follow was abandoned: heal in full")
                if idle and waited >= self._idle_s:
                    raise DistributedError(
                        f"nothing pushed for {self._idle_s:.0f} s after step {self.step}: "
                        "heal in full"
                    )
                self._cv.wait(poll_s)
                waited += poll_s
        return got

    def _apply(self, header: dict[str, Any], tensors: list[torch.Tensor],
               optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
               buffers: list[torch.Tensor]) -> None:  # fmt: skip
        assert self.step is not None
        if header["step"] != self.step + 1:
            raise DistributedError(
                f"pushed step {header['step']} follows step {self.step}: a step is missing "
                "or the survivors rolled back, heal in full"
            )
        n = len(params)
        set_hyper_parameters(optimizer, header["hyper"])
        for p, g in zip(params, tensors[:n], strict=True):
            p.grad = as_like(g, p)
        optimizer.step()
        with torch.no_grad():
            for b, reduced in zip(buffers, tensors[n:], strict=True):
                local_part(b).copy_(reduced)
        for p in params:
            p.grad = None
        self.step = header["step"]
        try:
            self._sock.sendall(FRAME.pack(self.step))
        except OSError as e:
            raise DistributedError(f"the pusher is gone ({e}): heal in full") from e
