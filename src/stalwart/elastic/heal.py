"""A heal: the committed state sent peer to peer over TCP sockets, in chunks, by every holder.

When a parity check (:mod:`stalwart.elastic.parity`) leaves members that must receive the
state (a newcomer, a member behind, a minority), every member holding the chosen (step,
digest) sends a *slice* of it, and each receiver takes all slices at once:

* the state's byte stream is its leaves' local bytes in the order of
  :func:`~stalwart.elastic.state.state_header`, the same on every holder (same digest);
  holder ``j`` of ``S`` sends bytes ``[j*T//S, (j+1)*T//S)`` of the ``T`` to every receiver,
  cut again into :data:`STREAMS` parts, each on its own connection, in chunks of at most
  :data:`CHUNK_BYTES`, straight from the tensors' memory: a CPU tensor is sent without a
  copy, a CUDA tensor is staged to the host one chunk at a time;
* the first holder (the source the policy chose) first sends the header; the receiver
  allocates every leaf and each holder's bytes land in place (``recv_into``), one thread per
  connection (``sendall``/``recv_into`` release the GIL), then loads the leaves
  (:func:`~stalwart.elastic.state.load_leaves`) and acknowledges each holder;
* the receivers' listening addresses travel in one small all-gather on the epoch's group.

With replica groups this runs on each shard's replicate group at once: rank ``i`` of every
live group sends its slice of shard ``i`` to rank ``i`` of each new group, all ranks in
parallel.

**Why sockets, not the group's collectives.** A gloo ``broadcast`` sends the whole state
from one member to *every* member of the group, survivors included (who discard it), after
concatenating it into one more buffer; a point-to-point send on the training's group would
share it with the gradient all-reduce. Plain sockets are independent of the training's
group (a heal neither waits behind nor fails a training collective), fill the destination
tensors with no intermediate copy, and give one stream per holder. A peer that dies closes
its sockets (the heal fails at once, as a collective would: the caller moves to the next
epoch); a peer that hangs fails it after :data:`IDLE_TIMEOUT_S` without progress.
"""

from __future__ import annotations

import functools
import json
import logging
import socket
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from stalwart.elastic.dtensors import local_part
from stalwart.elastic.groups import device_of
from stalwart.elastic.protocol import from_env
from stalwart.elastic.state import leaf_nbytes, live_targets, load_leaves, state_header
from stalwart.tree import dtype_from_name

__all__ = [
    "CHUNK_BYTES",
    "IDLE_TIMEOUT_S",
    "STREAMS",
    "flat_bytes",
    "gather_addresses",
    "heal",
    "open_listener",
    "receive_leaves",
    "recv_into",
    "send_slices",
    "slice_bounds",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

CHUNK_BYTES = 64 << 20  # one sendall / recv_into at most: bounds a CUDA leaf's host staging
STREAMS = 4  # connections per holder and receiver: one stream leaves loopback copies idle
IDLE_TIMEOUT_S = 60.0  # a socket operation without progress for this long fails the heal
_INT = struct.Struct("<q")


def slice_bounds(total: int, index: int, count: int) -> tuple[int, int]:
    """Holder ``index`` of ``count``'s byte range ``[lo, hi)`` of a ``total``-byte stream."""
    return total * index // count, total * (index + 1) // count


@functools.cache
def _advertised_host() -> str:
    """The address peers reach this process at: the interface that routes to the coordinator
    (under ``stalwart run`` on several nodes), else the host name's, else loopback."""
    env = from_env()
    if env is not None and env.host not in ("127.0.0.1", "localhost", "::1"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((env.host, 9))  # sends nothing: only picks the route's interface
                return str(probe.getsockname()[0])
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def heal(
    state: Any, step: int, rank: int, holders: Sequence[int], group: Any, *,
    chunk_bytes: int = CHUNK_BYTES, streams: int = STREAMS,
    spare: dict[str, torch.Tensor] | None = None,
) -> int:  # fmt: skip
    """Send ``state`` from ``holders`` to every other rank of ``group``; collective.

    Args:
        state: this member's state (``state_dict`` / ``load_state_dict``).
        step: this member's committed step.
        rank: this member's rank in ``group``.
        holders: the ranks holding the state to send, ascending (the first sends the header).
        group: the epoch's (replicate) process group: one all-gather of addresses.
        chunk_bytes: the most bytes one ``sendall`` / ``recv_into`` moves.
        streams: connections per (holder, receiver) pair, each a part of the holder's slice.
        spare: on a receiver, filled with a tensor per received leaf that holds its bytes
            and that the state does not reference: the received leaf itself where it was
            copied into a tensor this member held (:func:`~stalwart.elastic.state.load_leaves`),
            else a twin the receiving threads filled as the bytes arrived. The agreed copy
            adopts them instead of copying the state once more after the heal.

    Returns:
        The committed step this member holds afterwards.

    Raises:
        RuntimeError: a peer died or hung during the heal (the caller moves to a new epoch).
    """
    receivers = [r for r in range(group.size()) if r not in holders]
    if not receivers:
        return step
    listener = _listen() if rank in receivers else None
    started = time.perf_counter()
    try:
        addresses = _gather_addresses(listener, group)
        if listener is None:
            header, tensors = state_header(state, step)
            first, count = list(holders).index(rank) * streams, len(holders) * streams
            sends = [functools.partial(_send, header, tensors, (first + j, count), addresses[r],
                                       chunk_bytes)
                     for r in receivers for j in range(streams)]  # fmt: skip
            _all(sends)
            return step
        got, nbytes = _receive(state, listener, len(holders) * streams, chunk_bytes, spare)
    except OSError as e:
        raise RuntimeError(f"the heal from ranks {list(holders)} failed: {e}") from e
    finally:
        if listener is not None:
            listener.close()
    dt = time.perf_counter() - started
    log.info("healed %d bytes from %d holders in %.3f s (%.0f MB/s)", nbytes, len(holders), dt,
             nbytes / max(dt, 1e-9) / 1e6)  # fmt: skip
    return got


def _listen() -> socket.socket:
    sock = socket.create_server(("", 0), backlog=64)
    sock.settimeout(IDLE_TIMEOUT_S)
    return sock


def _gather_addresses(listener: socket.socket | None, group: Any) -> list[tuple[str, int]]:
    """Every rank's listening (host, port), in rank order (port 0: a holder, not listening)."""
    mine = torch.zeros(2, dtype=torch.int64)
    if listener is not None:
        mine[0] = int.from_bytes(socket.inet_aton(_advertised_host()), "big")
        mine[1] = listener.getsockname()[1]
    device = device_of(group)
    rows = [torch.empty_like(mine, device=device) for _ in range(group.size())]
    group.allgather([rows], [mine.to(device)]).wait()
    return [(socket.inet_ntoa(int(r[0]).to_bytes(4, "big")), int(r[1])) for r in rows]


def _all(calls: Sequence[Callable[[], T]]) -> list[T]:
    """Run ``calls`` in parallel threads; the first failure is raised once all ended."""
    with ThreadPoolExecutor(max_workers=max(1, len(calls))) as pool:
        futures = [pool.submit(c) for c in calls]
        return [f.result() for f in futures]


def _pieces(sizes: Sequence[int], lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
    """``(leaf, start, end)`` byte ranges of the leaves covering stream bytes ``[lo, hi)``."""
    offset = 0
    for i, n in enumerate(sizes):
        a, b = max(lo, offset), min(hi, offset + n)
        if a < b:
            yield i, a - offset, b - offset
        offset += n


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A leaf's local bytes, flat uint8 (a view of a contiguous tensor, on its device)."""
    return local_part(t).detach().contiguous().reshape(-1).view(torch.uint8)


def _send(header: dict[str, Any], tensors: Sequence[torch.Tensor], place: tuple[int, int],
          address: tuple[str, int], chunk_bytes: int, rate: float = 0.0) -> None:  # fmt: skip
    """Holder ``place = (index, count)``: send one receiver the header (index 0) and a slice;
    ``rate``: at most this many bytes a second on this connection (0: as fast as it goes)."""
    index, count = place
    started, sent = time.perf_counter(), 0
    flats = [flat_bytes(t) for t in tensors]
    lo, hi = slice_bounds(sum(f.numel() for f in flats), index, count)
    with socket.create_connection(address, timeout=IDLE_TIMEOUT_S) as sock:
        sock.sendall(_INT.pack(index))
        if index == 0:
            blob = json.dumps(header).encode()
            sock.sendall(_INT.pack(len(blob)) + blob)
        for leaf, a, b in _pieces([f.numel() for f in flats], lo, hi):
            for c in range(a, b, chunk_bytes):
                chunk = flats[leaf][c : min(b, c + chunk_bytes)]
                sock.sendall(chunk.cpu().numpy().data)  # CPU: the tensor's own memory, no copy
                sent += chunk.numel()
                if rate > 0:  # paced: sleep until the bytes sent fit the rate
                    time.sleep(max(0.0, sent / rate - (time.perf_counter() - started)))
        if _recv_exact(sock, 1) != b"k":  # the receiver loaded the state
            raise ConnectionError(f"receiver {address} did not acknowledge the heal")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def recv_into(sock: socket.socket, view: memoryview, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Fill ``view`` from ``sock``, at most ``chunk_bytes`` a call (a closed peer raises)."""
    while len(view):
        got = sock.recv_into(view, min(len(view), chunk_bytes))
        if got == 0:
            raise ConnectionError("the peer closed its connection in the middle of a transfer")
        view = view[got:]


def _twins(header: dict[str, Any], leaves: Sequence[torch.Tensor],
           into: dict[str, torch.Tensor] | None) -> dict[int, torch.Tensor]:  # fmt: skip
    """A second tensor for each plain leaf handed to the state as received (no tensor of
    this member to copy it into, e.g. a fresh optimizer's moments): the agreed copy's."""
    if into is None or len(into) == 0:
        return {}  # no spare wanted, or a state off the CPU (its leaves move at the load)
    return {i: torch.empty_like(leaves[i]) for i, (name, _, _, *rest) in enumerate(header["leaves"])
            if name not in into and (not rest or rest[0] is None)}  # fmt: skip


def _accept(listener: socket.socket, count: int) -> dict[int, socket.socket]:
    """Accept ``count`` connections, each keyed by the stream index its first word names."""
    conns: dict[int, socket.socket] = {}
    try:
        while len(conns) < count:
            conn, _ = listener.accept()
            conn.settimeout(IDLE_TIMEOUT_S)
            conns[_INT.unpack(_recv_exact(conn, _INT.size))[0]] = conn
    except BaseException:
        for conn in conns.values():
            conn.close()
        raise
    return conns


def _take(conns: dict[int, socket.socket], chunk_bytes: int,
          twins_for: Callable[[dict[str, Any], list[torch.Tensor]], dict[int, torch.Tensor]],
          ) -> tuple[dict[str, Any], list[torch.Tensor], dict[int, torch.Tensor]]:  # fmt: skip
    """The header and every leaf, each connection's slice in its own thread, in place; the
    twins ``twins_for(header, leaves)`` asked for are filled as the bytes arrive."""
    count = len(conns)
    (length,) = _INT.unpack(_recv_exact(conns[0], _INT.size))
    header = json.loads(_recv_exact(conns[0], length))
    leaves = [torch.empty(shape, dtype=dtype_from_name(dtype))
              for _, dtype, shape, *_ in header["leaves"]]  # fmt: skip
    sizes = [leaf_nbytes(dtype, shape) for _, dtype, shape, *_ in header["leaves"]]
    flats = [flat_bytes(t) for t in leaves]
    views = [f.numpy().data for f in flats]  # the leaves' own memory
    twins = twins_for(header, leaves)

    def take(index: int) -> None:
        lo, hi = slice_bounds(sum(sizes), index, count)
        for leaf, a, b in _pieces(sizes, lo, hi):
            recv_into(conns[index], views[leaf][a:b], chunk_bytes)
            if leaf in twins:  # while the other connections' bytes are in flight
                flat_bytes(twins[leaf])[a:b].copy_(flats[leaf][a:b])

    _all([functools.partial(take, i) for i in range(count)])
    return header, leaves, twins


def _receive(state: Any, listener: socket.socket, count: int, chunk_bytes: int,
             spare: dict[str, torch.Tensor] | None = None) -> tuple[int, int]:  # fmt: skip
    """Accept ``count`` holders, take their slices in parallel, load; (step, bytes received)."""
    conns = _accept(listener, count)
    try:
        into: dict[str, torch.Tensor] | None = None

        def twins_for(header: dict[str, Any], leaves: list[torch.Tensor]) -> dict[int, Any]:
            nonlocal into
            into = live_targets(state, header) if spare is not None else None
            return _twins(header, leaves, into)

        header, leaves, twins = _take(conns, chunk_bytes, twins_for)
        step = load_leaves(state, header, leaves, into)
        if spare is not None and into is not None:
            for i, (name, *_) in enumerate(header["leaves"]):
                if name in into or i in twins:
                    spare[name] = leaves[i] if name in into else twins[i]
        for conn in conns.values():
            conn.sendall(b"k")
        return step, sum(t.numel() * t.element_size() for t in leaves)
    finally:
        for conn in conns.values():
            conn.close()


# -- the same transfer for a heal in the background (:mod:`stalwart.elastic.catchup`) -----


def open_listener() -> socket.socket:
    """A listening socket for :func:`receive_leaves` (close it after)."""
    return _listen()


def gather_addresses(listener: socket.socket | None, group: Any) -> list[tuple[str, int]]:
    """Collective on ``group``: every rank's listening (host, port), port 0 for a sender."""
    return _gather_addresses(listener, group)


def send_slices(header: dict[str, Any], tensors: Sequence[torch.Tensor], holder: int,
                holders: int, addresses: Sequence[tuple[str, int]], *,
                streams: int = STREAMS, chunk_bytes: int = CHUNK_BYTES,
                rate_bytes_s: float = 0.0) -> None:  # fmt: skip
    """Holder ``holder`` of ``holders``: send its slice of ``tensors`` (in ``header``'s order,
    the same on every holder) to each receiver at ``addresses``, ``streams`` connections
    each; holder 0 sends the header. Returns once every receiver acknowledged.

    ``rate_bytes_s``: this holder's bytes a second at most, all connections together (0:
    unpaced); a paced send spreads its copies over time, next to the holder's training.

    Raises:
        OSError: a receiver died, hung or closed its connection.
    """
    first, count = holder * streams, holders * streams
    rate = rate_bytes_s / max(1, streams * len(addresses))
    _all([functools.partial(_send, header, tensors, (first + j, count), address, chunk_bytes,
                            rate)
          for address in addresses for j in range(streams)])  # fmt: skip


def receive_leaves(listener: socket.socket, holders: int, *, streams: int = STREAMS,
                   chunk_bytes: int = CHUNK_BYTES,
                   ) -> tuple[dict[str, Any], list[torch.Tensor]]:  # fmt: skip
    """Take every holder's slice (:func:`send_slices`) into fresh leaves; the header and the
    leaves, in its order, loaded into nothing (acknowledged once all bytes arrived).

    Raises:
        OSError: a holder died, hung or closed its connection.
    """
    conns = _accept(listener, holders * streams)
    try:
        header, leaves, _ = _take(conns, chunk_bytes, lambda h, leaves: {})
        for conn in conns.values():
            conn.sendall(b"k")
        return header, leaves
    finally:
        for conn in conns.values():
            conn.close()
