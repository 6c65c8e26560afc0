"""Healing while the survivors commit (issue 24, item 4, increment B): the pieces, not the protocol.

A newcomer that must receive a gigabyte state need not stop the survivors for the transfer.
The design (docs/elastic.md, "Still a stop"): the survivors lend the copy of step ``s`` the
parity check already made to a background sender and train on; the newcomer *listens*
(contributes zeros, keeps the reduced gradients of ``s+1 .. t``), replays them with its own
optimizer once the copy landed, takes the small rest a replay cannot rebuild (RNG states,
integer buffers, the skeleton's hyper-parameters and schedulers), and the digests must then
agree. This module holds those mechanisms, each usable and tested on its own process group:

* :class:`Lender`: a survivor's side. :meth:`~stalwart.elastic.state.AgreedState.lend` gives
  the copy's header and tensors (the next ``record`` allocates instead of refilling
  them); one all-gather of addresses on the group, then every holder's slice goes to every
  listener from a thread (:func:`~stalwart.elastic.heal.send_slices`: the heal's sockets,
  streams and chunks), while the caller trains on;
* :class:`Catchup`: a listener's side. It receives the slices in a thread
  (:func:`~stalwart.elastic.heal.receive_leaves`); each step it takes part in the members'
  mean with zeros (:func:`~stalwart.elastic.reduce.average_` with ``contributors``: the sum is
  the contributors', divided by their count, the same bytes on every rank) and keeps what
  came back: one reduced gradient per parameter per step, the last reduced float buffers;
  once the copy landed, :meth:`Catchup.replay` loads it and applies the kept gradients in
  order with the member's own optimizer, a bounded number per call (between its steps);
* :func:`send_rest` / :func:`take_rest`: the leaves a replay cannot rebuild, and the skeleton,
  from one survivor to everyone in one broadcast (kilobytes).

**Bit parity.** The replayed state equals the survivors' bit for bit when the optimizer is the
same, its inputs are the same bytes (the reduced gradients every member applied) and its
hyper-parameters did not change while it listened (an LR scheduler breaks this; the feed of
:mod:`stalwart.elastic.follow` sends them per step). Check the digests after :func:`take_rest`.

**What it costs.** The listener keeps one gradient per parameter per listened step, at most
``max_steps`` steps or ``max_bytes`` bytes (:attr:`Catchup.over`: then a full heal). The
survivors send from a copy they already hold, from threads that share their cores. The
listener sits in the survivors' all-reduce, which measured badly (docs/elastic.md);
:mod:`stalwart.elastic.follow` takes it out. A lent copy may hold DTensor leaves (a replica
group's shard: sent as local parts, rebuilt on the receiver's mesh); the listener itself
(:class:`Catchup`) is tested on replicated state only.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from stalwart.elastic.dtensors import dtensor_spec, local_part
from stalwart.elastic.groups import device_of
from stalwart.elastic.heal import gather_addresses, open_listener, receive_leaves, send_slices
from stalwart.elastic.reduce import average_
from stalwart.elastic.state import AgreedState, canonical_tree, live_targets, load_leaves
from stalwart.errors import ConfigError, DistributedError
from stalwart.tree import dtype_from_name, dtype_name, flatten

__all__ = [
    "MAX_BYTES",
    "MAX_STEPS",
    "Catchup",
    "Lender",
    "Transfer",
    "receive_copy",
    "send_rest",
    "take_rest",
]

MAX_STEPS = 64  # listened steps a catch-up keeps at most (then: a full heal)
MAX_BYTES = 8 << 30  # kept reduced gradients at most, bytes (then: a full heal)


class Transfer:
    """A call running in a background thread: :meth:`done`, :meth:`wait`, :meth:`result`."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as e:  # re-raised in the caller's thread by result()
            self._error = e

    def done(self) -> bool:
        """Whether the call ended (returned or raised)."""
        return not self._thread.is_alive()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` (None: until it ends); whether it ended."""
        self._thread.join(timeout_s)
        return self.done()

    def result(self) -> Any:
        """The call's value, once ended (waits for it).

        Raises:
            RuntimeError: the transfer failed (a peer died or hung): fall back to a full heal.
        """
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"the background transfer failed: {self._error}") from self._error
        return self._value


def _ranks(group: Any, listeners: Sequence[int]) -> list[int]:
    listening = set(listeners)
    if not listening or not listening < set(range(group.size())):
        raise ConfigError(
            f"listeners {sorted(listening)} must be some, not all, of the group's "
            f"{group.size()} ranks"
        )
    return [r for r in range(group.size()) if r not in listening]


class Lender:
    """A survivor's side: send the agreed copy to the listeners while training on.

    Collective at construction (one all-gather of addresses on ``group``, with every
    listener's :class:`Catchup`); the bytes then move from threads.

    Args:
        agreed: this member's agreed copy, of the step every member held at the boundary.
        rank: this member's rank in ``group`` (a contributor).
        listeners: the listeners' ranks in ``group``.
        group: the epoch's process group.
        streams, chunk_bytes: as :func:`~stalwart.elastic.heal.heal`'s.
        rate_bytes_s: this holder's sending rate at most (0: unpaced); see
            :func:`~stalwart.elastic.heal.send_slices`.
    """

    def __init__(self, agreed: AgreedState, rank: int, listeners: Sequence[int], group: Any, *,
                 streams: int | None = None, chunk_bytes: int | None = None,
                 rate_bytes_s: float = 0.0) -> None:  # fmt: skip
        holders = _ranks(group, listeners)
        header, tensors = _lent(agreed)
        addresses = gather_addresses(None, group)
        to = [addresses[r] for r in sorted(listeners)]
        opts: dict[str, Any] = {**_options(streams, chunk_bytes), "rate_bytes_s": rate_bytes_s}
        self.step = int(header["step"])
        self.transfer = Transfer(
            lambda: send_slices(header, tensors, holders.index(rank), len(holders), to, **opts),
            name="stalwart-lend",
        )

    def done(self) -> bool:
        """Whether every listener acknowledged the copy (or the send failed)."""
        return self.transfer.done()

    def wait(self) -> None:
        """Wait for the listeners' acknowledgements.

        Raises:
            RuntimeError: a listener died or hung.
        """
        self.transfer.result()


def _lent(agreed: AgreedState) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The agreed copy as a heal's header and leaves: a DTensor leaf (a replica group's
    shard) is sent as its local part with its spec, and rebuilt on the receiver's mesh."""
    skeleton, step, leaves = agreed.lend()
    meta = [[n, dtype_name(t.dtype), list(local_part(t).shape), dtensor_spec(t)]
            for n, t in leaves.items()]  # fmt: skip
    tensors = [local_part(t) for t in leaves.values()]
    return {"skeleton": skeleton, "step": step, "leaves": meta}, tensors


def _options(streams: int | None, chunk_bytes: int | None) -> dict[str, int]:
    opts = {}
    if streams is not None:
        opts["streams"] = streams
    if chunk_bytes is not None:
        opts["chunk_bytes"] = chunk_bytes
    return opts


def receive_copy(holders: int, group: Any, *, streams: int | None = None,
                 chunk_bytes: int | None = None) -> Transfer:  # fmt: skip
    """Collective on ``group`` with every :class:`Lender`: this member's address; then the
    ``holders``' slices of the lent copy arrive in a thread (``result()``: header, leaves)."""
    sock = open_listener()
    try:
        gather_addresses(sock, group)
    except BaseException:
        sock.close()
        raise
    opts = _options(streams, chunk_bytes)

    def receive() -> tuple[dict[str, Any], list[torch.Tensor]]:
        try:
            return receive_leaves(sock, holders, **opts)
        finally:
            sock.close()

    return Transfer(receive, name="stalwart-catchup")


class Catchup:
    """A listener's side: receive the copy in the background, listen, replay.

    Collective at construction (the all-gather of addresses, with every :class:`Lender`).

    Args:
        state: this member's state (``state_dict`` / ``load_state_dict``), overwritten by the
            copy at the first :meth:`replay`.
        optimizer: the optimizer the replay steps (the same class and settings as the
            survivors'), over ``params``.
        params: the optimizer's parameters, in the order every member reduces them.
        buffers: the model's floating-point buffers, in the members' order.
        listeners: the listeners' ranks in ``group`` (this member among them).
        group: the epoch's process group.
        max_steps, max_bytes: the most listened steps, and kept bytes, before :attr:`over`.
        streams, chunk_bytes: as the :class:`Lender`'s.

    Attributes:
        over: a bound was passed: nothing more is kept; fall back to a full heal.
        step: the committed step the state holds once :meth:`replay` caught up (None before).
    """

    def __init__(self, state: Any, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                 buffers: Sequence[torch.Tensor], listeners: Sequence[int], group: Any, *,
                 max_steps: int = MAX_STEPS, max_bytes: int = MAX_BYTES,
                 streams: int | None = None, chunk_bytes: int | None = None) -> None:  # fmt: skip
        holders = _ranks(group, listeners)
        self.state, self.optimizer = state, optimizer
        self.params, self.buffers = list(params), list(buffers)
        self.max_steps, self.max_bytes = max_steps, max_bytes
        self.contributors = len(holders)
        self.over = False
        self.step: int | None = None
        self._kept: list[list[torch.Tensor]] = []  # reduced gradients, step by step
        self._last_buffers: list[torch.Tensor] | None = None
        self._replayed = 0
        self._copy_step: int | None = None
        self.transfer = receive_copy(len(holders), group, streams=streams,
                                     chunk_bytes=chunk_bytes)  # fmt: skip

    @property
    def kept_bytes(self) -> int:
        """Bytes of the reduced gradients kept and not replayed yet."""
        return sum(g.numel() * g.element_size() for step in self._kept for g in step)

    def reduce(self, control: torch.Tensor, group: Any) -> torch.Tensor:
        """Take part in one step's mean with zeros; keep the reduced gradients and buffers.

        Collective on ``group``, where every contributor runs
        ``average_(..., contributors=...)`` with the same count. This member's gradients and
        buffers are left as they were; returns the summed ``control``.

        Raises:
            RuntimeError: the all-reduce failed (a member died).
        """
        zeros = [torch.zeros_like(p) for p in self.params]  # the reduction writes into them
        scratch = [torch.zeros_like(b) for b in self.buffers]
        own = [p.grad for p in self.params]
        try:
            for p, z in zip(self.params, zeros, strict=True):
                p.grad = z
            control = average_(self.params, scratch, control, group,
                               contributors=self.contributors)  # fmt: skip
        finally:
            for p, g in zip(self.params, own, strict=True):
                p.grad = g
        step_bytes = sum(z.numel() * z.element_size() for z in zeros)
        if (
            self.over
            or len(self._kept) >= self.max_steps
            or (self.kept_bytes + step_bytes > self.max_bytes)
        ):
            self.over, self._kept = True, []  # a full heal follows: free the memory now
            return control
        self._kept.append(zeros)
        self._last_buffers = scratch
        return control

    def landed(self) -> bool:
        """Whether the copy's bytes all arrived (or their transfer failed)."""
        return self.transfer.done()

    def replay(self, limit: int | None = None) -> bool:
        """Load the copy (first call) and apply up to ``limit`` kept steps; True when every
        kept step is applied (:attr:`step` is then the step the survivors hold).

        Call between this member's steps, never during a forward/backward. Waits for the
        copy if it has not landed.

        Raises:
            RuntimeError: the copy's transfer failed; DistributedError: a bound was passed.
        """
        if self.over:
            raise DistributedError(
                f"the catch-up passed its bound ({self.max_steps} steps, {self.max_bytes} "
                "bytes): fall back to a full heal"
            )
        if self._copy_step is None:
            header, leaves = self.transfer.result()
            self._copy_step = load_leaves(self.state, header, leaves,
                                          live_targets(self.state, header))  # fmt: skip
        todo = self._kept if limit is None else self._kept[:limit]
        for grads in todo:
            for p, g in zip(self.params, grads, strict=True):
                p.grad = g
            self.optimizer.step()
            self._replayed += 1
        del self._kept[: len(todo)]
        if self._kept:
            return False
        if self._last_buffers is not None:
            with torch.no_grad():
                for b, reduced in zip(self.buffers, self._last_buffers, strict=True):
                    b.copy_(reduced)
        for p in self.params:
            p.grad = None
        self.step = self._copy_step + self._replayed
        return True


def _rest(state: Any, skip: Sequence[torch.Tensor]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The header and leaves of ``state`` that are none of ``skip``'s tensors (what a replay
    does not rebuild: RNG states, integer buffers), with the whole skeleton."""
    flat = flatten(canonical_tree(state))
    rebuilt = {local_part(t).data_ptr() for t in skip if t.numel()}
    names = [n for n, leaf in flat.leaves.items()
             if leaf.tensor.numel() == 0
             or local_part(leaf.tensor).data_ptr() not in rebuilt]  # fmt: skip
    leaves = [flat.leaves[n].tensor.detach().cpu().contiguous() for n in names]
    meta = [[n, dtype_name(t.dtype), list(t.shape)] for n, t in zip(names, leaves, strict=True)]
    return {"skeleton": flat.skeleton, "leaves": meta}, leaves


def _rebuilt(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
             buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:  # fmt: skip
    moments = [t for s in optimizer.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0]  # fmt: skip
    return [*params, *buffers, *moments]


def send_rest(state: Any, step: int, optimizer: torch.optim.Optimizer,
              params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor],
              src: int, group: Any) -> None:  # fmt: skip
    """Broadcast from rank ``src`` (this member) what a replay does not rebuild (collective
    with :func:`take_rest` on the listeners and ``take_rest(..., load=False)`` elsewhere)."""
    header, leaves = _rest(state, _rebuilt(optimizer, params, buffers))
    header["step"] = step
    payload = [t.reshape(-1).view(torch.uint8) for t in leaves]
    blob = json.dumps(header).encode()
    _broadcast(torch.frombuffer(bytearray(blob), dtype=torch.uint8), src, group)
    _broadcast(torch.cat(payload) if payload else torch.empty(0, dtype=torch.uint8), src, group)


def take_rest(state: Any, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
              buffers: Sequence[torch.Tensor], src: int, group: Any, *,
              load: bool = True) -> int:  # fmt: skip
    """Receive :func:`send_rest` from ``src``; load it over the replayed state if ``load``.

    The replayed leaves (parameters, float buffers, the optimizer's moments) stay this
    member's; every other leaf, and the skeleton, are the sender's. Returns its step.
    """
    header = json.loads(bytes(_broadcast(None, src, group).numpy()).decode())
    data = _broadcast(None, src, group)
    if not load:
        return int(header["step"])
    rest, offset = {}, 0
    for name, dtype, shape in header["leaves"]:
        n = torch.empty(0, dtype=dtype_from_name(dtype)).element_size()
        count = int(torch.Size(shape).numel()) * n
        rest[name] = data[offset : offset + count].clone().view(dtype_from_name(dtype))
        rest[name] = rest[name].reshape(shape)
        offset += count
    own = flatten(canonical_tree(state)).leaves
    names = list(dict.fromkeys([*own, *rest]))
    leaves = [rest[n] if n in rest else own[n].tensor for n in names]
    full = {"skeleton": header["skeleton"], "step": header["step"],
            "leaves": [[n, dtype_name(t.dtype), list(t.shape), None]
                       for n, t in zip(names, leaves, strict=True)]}  # fmt: skip
    return load_leaves(state, full, leaves)


def _broadcast(payload: torch.Tensor | None, src: int, group: Any) -> torch.Tensor:
    """A uint8 tensor of any length from ``src`` to every rank (None on the others)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    device = device_of(group)
    length = torch.tensor([0 if payload is None else payload.numel()], device=device)
    group.broadcast([length], opts).wait()
    if payload is None:
        buf = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    else:
        buf = payload.to(device)
    if buf.numel():
        group.broadcast([buf], opts).wait()
    return buf.cpu()
