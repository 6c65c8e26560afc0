"""The replicated state of a data-parallel member: its digest, and sending it to peers.

The state is the object handed to :class:`~stalwart.elastic.Job` (normally a
:class:`stalwart.TrainingState`): its ``state_dict()`` is flattened with
:func:`stalwart.tree.flatten` into a JSON skeleton (every non-tensor value, including
optimizer hyper-parameters) and named tensor leaves. In data parallelism every member holds
the same state, RNG included: :class:`~stalwart.TrainingState` files the RNG under
``rank<r>``, so the canonical tree renames that entry to ``replica`` and a receiver files it
back under its own rank.

* :func:`digest` is xxh3-128 over the skeleton (JSON, sorted keys), then every leaf in FQN
  order (name, dtype, shape, bytes), then the committed step. A ``DTensor`` leaf (FSDP2,
  tensor parallel inside a replica group) contributes its global shape and the bytes of its
  *local* shard: the digest of rank ``i`` of a replica group covers shard ``i``, and equals
  the digest of rank ``i`` of every other group holding the same state.
* :func:`state_header` describes the state to a receiver (skeleton, leaf names, dtypes,
  shapes, step, and a DTensor's global shape, stride and placements) and
  :func:`load_leaves` loads received leaves, rebuilding each DTensor on the receiver's mesh.
  A heal sends them peer to peer (:mod:`stalwart.elastic.heal`); :func:`send_state` /
  :func:`receive_state` move them from one member to all others of a process group, the
  header and then one flat byte buffer each in one ``broadcast`` on the group's device (CPU
  for gloo, CUDA for NCCL; the recovery ladder's path). Nothing touches disk or the
  coordinator.
* :class:`BoundarySnapshot` is what a discarded step puts back (RNGs, the model's buffers);
  :class:`AgreedState` the copy of the state at the last parity point every member agreed
  on, to roll back to when two members disagree with no majority.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import xxhash

from stalwart.elastic.dtensors import dtensor_spec, is_dtensor, local_part, rebuild_dtensor
from stalwart.elastic.groups import device_of
from stalwart.errors import DistributedError
from stalwart.tree import dtype_from_name, dtype_name, flatten, unflatten

__all__ = [
    "AgreedState",
    "BoundarySnapshot",
    "canonical_tree",
    "digest",
    "leaf_nbytes",
    "load_leaves",
    "receive_state",
    "send_state",
    "state_header",
]

_REPLICA = "replica"


def _local_rank_key() -> str:
    if dist.is_available() and dist.is_initialized():
        return f"rank{dist.get_rank()}"
    return "rank0"


def canonical_tree(state: Any) -> Any:
    """``state.state_dict()`` with a per-rank RNG entry renamed to ``replica``."""
    sd = state.state_dict()
    rng = sd.get("rng") if isinstance(sd, Mapping) else None
    if isinstance(rng, Mapping) and len(rng) == 1:
        sd = dict(sd)
        sd["rng"] = {_REPLICA: next(iter(rng.values()))}
    return sd


def _localize(tree: Any) -> Any:
    rng = tree.get("rng") if isinstance(tree, Mapping) else None
    if isinstance(rng, Mapping) and set(rng) == {_REPLICA}:
        tree = dict(tree)
        tree["rng"] = {_local_rank_key(): rng[_REPLICA]}
    return tree


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor's (local) bytes as a flat uint8 CPU tensor (a view when contiguous on CPU)."""
    return local_part(t).detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def digest(state: Any, step: int) -> str:
    """Hex xxh3-128 digest of ``state``'s canonical tree and the committed ``step``."""
    flat = flatten(canonical_tree(state))
    h = xxhash.xxh3_128()
    h.update(json.dumps(flat.skeleton, sort_keys=True).encode())
    for fqn in sorted(flat.leaves):
        t = flat.leaves[fqn].tensor
        h.update(f"|{fqn}|{dtype_name(t.dtype)}|{list(t.shape)}|".encode())
        h.update(_bytes_of(t).numpy().data)  # the buffer itself: no copy of the bytes
    h.update(f"|step={step}".encode())
    return h.hexdigest()


def _broadcast_bytes(
    payload: torch.Tensor | None, src: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """Broadcast a uint8 tensor of any length from ``src`` (pass None on the others)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    device = device_of(group)
    size = 0 if payload is None else payload.numel()
    length = torch.tensor([size], dtype=torch.int64, device=device)
    group.broadcast([length], opts).wait()
    if payload is not None:
        buf = payload.to(device)
    else:
        buf = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    if buf.numel():
        group.broadcast([buf], opts).wait()
    return buf.cpu()


def state_header(state: Any, step: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The header a receiver rebuilds ``state`` from, and the leaves it describes, in order.

    The header holds the skeleton, the committed ``step`` and one ``[name, dtype, local shape,
    DTensor spec or None]`` per leaf; the leaves' local bytes, concatenated in this order, are
    the state's byte stream (:func:`send_state`, :mod:`stalwart.elastic.heal`).
    """
    flat = flatten(canonical_tree(state))
    names = list(flat.leaves)
    tensors = [flat.leaves[n].tensor for n in names]
    header = {
        "skeleton": flat.skeleton,
        "step": step,
        "leaves": [
            [n, dtype_name(t.dtype), list(local_part(t).shape), dtensor_spec(t)]
            for n, t in zip(names, tensors, strict=True)
        ],
    }
    return header, tensors


def load_leaves(
    state: Any, header: dict[str, Any], leaves: Sequence[torch.Tensor],
    into: Mapping[str, torch.Tensor] | None = None,
) -> int:  # fmt: skip
    """Load received local ``leaves`` (CPU, in the header's order) into ``state``.

    A DTensor leaf is rebuilt on this member's mesh. Returns the sender's committed step.

    ``into``: this member's own tensors by leaf name (:func:`live_targets`); a received leaf
    named there is copied into that tensor, which ``load_state_dict`` is given: the received
    tensor is never handed to the state (an :class:`AgreedState` may adopt it).
    """
    tensors: dict[str, torch.Tensor] = {}
    own: dict[str, torch.Tensor] | None = None  # this member's leaves: templates for DTensors
    for (name, _, _, *rest), t in zip(header["leaves"], leaves, strict=True):
        tensors[name] = t
        if into is not None and name in into:
            with torch.no_grad():
                into[name].copy_(t)
            tensors[name] = into[name]
        if rest and rest[0] is not None:
            if own is None:
                own = {n: leaf.tensor for n, leaf in flatten(canonical_tree(state)).leaves.items()}
            mesh = next((t.device_mesh for t in own.values() if is_dtensor(t)), None)
            tensors[name] = rebuild_dtensor(t, rest[0], own.get(name), mesh)
    tree = unflatten(header["skeleton"], tensors.__getitem__)
    state.load_state_dict(_localize(tree))
    return int(header["step"])


def live_targets(state: Any, header: dict[str, Any]) -> dict[str, torch.Tensor]:
    """This member's plain CPU tensors that the header's plain leaves of the same name,
    shape and dtype can be copied into (:func:`load_leaves`): its parameters and buffers,
    its optimizer's moments once it has stepped."""
    own = {n: leaf.tensor for n, leaf in flatten(canonical_tree(state)).leaves.items()}
    out = {}
    for name, dtype, shape, *rest in header["leaves"]:
        live = own.get(name)
        if (live is not None and not is_dtensor(live) and live.device.type == "cpu"
                and (not rest or rest[0] is None) and list(live.shape) == list(shape)
                and dtype_name(live.dtype) == dtype):  # fmt: skip
            out[name] = live
    return out


def _fits(live: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``t`` can stand for this member's plain tensor ``live`` in a copy of the state."""
    same = (live.shape, live.dtype, live.device) == (t.shape, t.dtype, t.device)
    return same and not is_dtensor(live) and live is not t


def leaf_nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of a header leaf's local part (``dtype`` by :func:`stalwart.tree.dtype_name`)."""
    size = torch.empty(0, dtype=dtype_from_name(dtype)).element_size()
    return int(np.prod(shape, dtype=np.int64)) * size


def send_state(state: Any, step: int, src: int, group: dist.ProcessGroup) -> None:
    """Broadcast ``state`` and ``step`` from this member (rank ``src``) to the group."""
    header, tensors = state_header(state, step)
    raw = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
    _broadcast_bytes(raw, src, group)
    parts = [_bytes_of(t) for t in tensors]
    _broadcast_bytes(torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8), src, group)


def receive_state(state: Any, src: int, group: dist.ProcessGroup, load: bool = True) -> int:
    """Take part in :func:`send_state` from ``src``; load the result into ``state`` if ``load``.

    Returns:
        The sender's committed step.
    """
    header = json.loads(bytes(_broadcast_bytes(None, src, group).numpy()).decode())
    data = _broadcast_bytes(None, src, group)
    if not load:
        return int(header["step"])
    leaves, offset = [], 0
    for _, dtype, shape, *_ in header["leaves"]:
        nbytes = leaf_nbytes(dtype, shape)
        leaves.append(
            data[offset : offset + nbytes].clone().view(dtype_from_name(dtype)).reshape(shape)
        )
        offset += nbytes
    return load_leaves(state, header, leaves)


def copy_into(saved: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``: ``saved`` refilled when it has ``t``'s shape, dtype and device."""
    like = (t.shape, t.dtype, t.device)
    same = saved is not None and (saved.shape, saved.dtype, saved.device) == like
    if not same:
        return t.detach().clone()
    assert saved is not None
    with torch.no_grad():
        saved.copy_(t)
    return saved


class BoundarySnapshot:
    """What a discarded step puts back: the RNGs and the model's buffers at the step's start.

    The global torch, numpy and Python generators, the named generators of a
    :class:`stalwart.TrainingState` (``state.generators``), if any, and copies of ``buffers``
    (every buffer of the model given to :meth:`~stalwart.elastic.Job.data_parallel`). The
    forward pass of a step changes buffers in place (BatchNorm's running statistics and
    ``num_batches_tracked``) from the member's own share of the batch; only the commit
    averages them. A step discarded after its forward must put them back, or two survivors
    keep the statistics of their own, different shares: the same committed step, different
    digests.
    """

    def __init__(self, state: Any = None, buffers: Sequence[torch.Tensor] = (),
                 reuse: BoundarySnapshot | None = None) -> None:  # fmt: skip
        """Snapshot now; ``reuse``: the previous snapshot, whose buffer copies are refilled
        (no allocation per step) and which must not be restored afterwards."""
        self.torch_state = torch.get_rng_state()
        self.numpy_state = np.random.get_state()
        self.python_state = random.getstate()
        named = getattr(state, "generators", None)
        gens = list(named.values()) if isinstance(named, Mapping) else []
        self.named = [(g, g.get_state()) for g in gens]
        old = {id(b): saved for b, saved in reuse.buffers} if reuse is not None else {}
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (b, copy_into(old.get(id(b)), b)) for b in buffers
        ]

    def restore(self) -> None:
        """Set every generator and buffer back to the snapshot."""
        torch.set_rng_state(self.torch_state)
        np.random.set_state(self.numpy_state)
        random.setstate(self.python_state)
        for gen, st in self.named:
            gen.set_state(st)
        with torch.no_grad():
            for live, saved in self.buffers:
                live.copy_(saved)


class AgreedState:
    """A copy in memory of the state at the last parity check where every member agreed.

    With two members holding different digests there is no majority to say which is right;
    :func:`stalwart.elastic.parity.reconcile` then puts every member back on this copy and
    the training loop recomputes from its step (``job.step`` goes back). Recorded after every
    parity check of a group of two or more that ended in agreement: one more copy of the
    state per member (parameters, optimizer state, buffers, RNG).

    Attributes:
        step: the committed step of the copy (None: nothing recorded yet).
        rollbacks: rollbacks to this copy since the job last agreed on a later step.
    """

    def __init__(self) -> None:
        self.step: int | None = None
        self.rollbacks = 0
        self._skeleton: Any = None
        self._leaves: dict[str, torch.Tensor] = {}
        self._lent = False  # the copy's tensors went to a background sender (:meth:`lend`)

    def record(
        self, state: Any, step: int, spare: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        """Keep a copy of ``state`` at ``step`` (into the last copy's tensors where they fit).

        ``spare``: tensors holding a leaf's bytes that nothing else references (the leaves a
        heal received and copied into the state, :func:`load_leaves`), adopted as the copy
        of that leaf instead of copying it again.
        """
        flat = flatten(canonical_tree(state))
        if self.step is None or step > self.step:
            self.rollbacks = 0
        self.step, self._skeleton = step, flat.skeleton
        old, spare, self._lent = ({} if self._lent else self._leaves), spare or {}, False
        self._leaves = {
            n: spare[n] if n in spare and _fits(leaf.tensor, spare[n])
            else copy_into(old.get(n), leaf.tensor)
            for n, leaf in flat.leaves.items()
        }  # fmt: skip

    def lend(self) -> tuple[Any, int, dict[str, torch.Tensor]]:
        """The copy (skeleton, step, leaves) for a reader while the state trains on
        (:mod:`stalwart.elastic.catchup`): the next :meth:`record` allocates new tensors."""
        if self.step is None:
            raise DistributedError("no agreed state to lend: record one first")
        self._lent = True
        return self._skeleton, self.step, dict(self._leaves)

    def keep(self, step: int) -> bool:
        """The members agreed at ``step`` on a state this member held unchanged since its
        last copy (a heal's holders): keep that copy rather than copying the state again.

        A rollback then goes to that older, also agreed, step (or to a receiver's newer copy:
        ahead wins among the copies), and the job recomputes a few more steps; the state is
        not copied at every heal. Returns False when there is no copy yet (record one).
        """
        if self.step is None:
            return False
        if step > self.step:
            self.rollbacks = 0  # the job agreed on a later step since the last rollback
        return True

    def restore(self, state: Any) -> int:
        """Load the copy into ``state``; returns its step.

        Raises:
            DistributedError: nothing was recorded.
        """
        if self.step is None:
            raise DistributedError(
                "no agreed state to roll back to: this member never completed a parity check "
                "with its peers; restart from the durable checkpoint"
            )
        tree = unflatten(self._skeleton, lambda n: self._leaves[n].clone())  # no aliasing
        state.load_state_dict(_localize(tree))
        self.rollbacks += 1
        return self.step
