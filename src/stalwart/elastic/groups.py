"""Process groups by device, and a worker's place in the 2-D layout replicate x shard.

**Replica groups.** ``stalwart run --nproc N --group-size G`` starts ``N / G`` replica groups
of ``G`` ranks. The launcher writes each worker's :class:`Layout` on the store
(``coord/layout/{wid}``) before starting it: its group's id (fresh for a replacement group),
its rank in the group, the group size and its device slot on the node. A worker's job has
two dimensions:

* **shard**: the ``G`` ranks of its own group, an ordinary process group that lives as long
  as the group (the default process group of these ``G`` processes, on
  ``PrefixStore(f"group{id}", store)``), for FSDP2 or tensor parallel inside the group
  (:func:`build_shard_group`, :func:`shard_mesh`). A rank's death takes its whole group out
  (the launcher kills the others), so this group never needs rebuilding.
* **replicate**: rank ``i`` of every live group: the fault-tolerant dimension, rebuilt at
  every membership epoch on ``PrefixStore(f"epoch{n}/shard{i}", store)`` (``G = 1``: the
  epoch's one group on ``PrefixStore(f"epoch{n}", store)``, as always).

**The backend follows the device.** gloo for CPU tensors (tested); NCCL for CUDA. gloo fails
a collective at once when a peer's sockets close; a NCCL collective stuck on a dead peer
does not fail by itself, so a NCCL group is a :class:`WatchedGroup`: each wait polls the
work, and aborts the communicator (``ProcessGroup.abort()``, as torchft's
``ProcessGroupNCCL`` does) when the coordinator published a newer epoch while the work was
still pending after one heartbeat period (the launcher saw a death), or after the
collective timeout. The abort fails the collective on this member, the step is discarded
and a new group is built for the next epoch. The NCCL path is unmeasured on this project's
machines (``bench/gpu_elastic.py`` is the check to run on a GPU machine).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store

from stalwart.elastic.protocol import decode, encode, keys
from stalwart.errors import ConfigError, StalwartError

__all__ = [
    "Layout",
    "WatchedGroup",
    "abort_group",
    "agree",
    "all_or_none",
    "backend_for",
    "build_group",
    "build_shard_group",
    "build_solo_group",
    "device_of",
    "forget_frames",
    "read_layout",
    "shard_mesh",
    "write_layout",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

_POLL_S = 0.0005  # first polls of a pending NCCL work: most complete within a millisecond
_POLL_MAX_S = 0.02


@dataclass(frozen=True)
class Layout:
    """A worker's place in its replica group.

    Attributes:
        group: the replica group's id (unique in the job; a replacement group gets a new one).
        group_rank: this worker's rank in its group (its shard index), ``0 .. group_size-1``.
        group_size: ranks per replica group (1: plain data parallelism).
        local_rank: the worker's device slot on its node (CUDA device ``local_rank % count``).
    """

    group: int
    group_rank: int = 0
    group_size: int = 1
    local_rank: int = 0

    def __post_init__(self) -> None:
        if self.group_size < 1 or not 0 <= self.group_rank < self.group_size:
            raise ConfigError(f"{self}: need group_size >= 1 and 0 <= group_rank < group_size")


def write_layout(store: Store, wid: int, layout: Layout) -> None:
    """Record worker ``wid``'s layout on the coordinator's store (the launcher, before spawning)."""
    record = {"group": layout.group, "group_rank": layout.group_rank,
              "group_size": layout.group_size, "local_rank": layout.local_rank}  # fmt: skip
    store.set(keys.layout(wid), encode(record))  # type: ignore[arg-type]  # bytes are accepted


def read_layout(store: Store, wid: int) -> Layout:
    """Worker ``wid``'s layout; a worker the launcher gave none (several nodes) is its own group."""
    if not store.check([keys.layout(wid)]):
        return Layout(group=wid)
    return Layout(**decode(store.get(keys.layout(wid))))


def backend_for(device: torch.device) -> str:
    """``"nccl"`` for a CUDA device, ``"gloo"`` for anything else."""
    return "nccl" if device.type == "cuda" else "gloo"


def device_of(group: Any) -> torch.device:
    """The device a collective's tensors must be on for ``group`` (CPU for gloo and None)."""
    if isinstance(group, WatchedGroup):
        return group.device
    if group is not None and group.name() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _WatchedWork:
    """A NCCL work whose ``wait()`` gives up (aborting the communicator) instead of hanging."""

    def __init__(self, work: Any, group: WatchedGroup) -> None:
        self.work, self.group = work, group

    def wait(self) -> bool:
        """Block until the work completed; abort the group and raise when it must be abandoned.

        Raises:
            RuntimeError: a newer epoch was published while the work was pending, or the
                collective timeout passed; the communicator was aborted.
        """
        group = self.group
        t0 = time.monotonic()
        poll = _POLL_S
        while not self.work.is_completed():
            waited = time.monotonic() - t0
            if waited > group.timeout_s or (waited > group.patience_s and group.abandon()):
                why = "timeout" if waited > group.timeout_s else "a newer epoch was published"
                group.abort()
                raise RuntimeError(f"NCCL collective abandoned after {waited:.2f} s ({why})")
            time.sleep(poll)
            poll = min(2 * poll, _POLL_MAX_S)
        self.work.wait()  # raises the backend's own error, if any
        return True


class WatchedGroup:
    """A NCCL process group whose waits are watched (module docstring).

    Args:
        group: the NCCL :class:`torch.distributed.ProcessGroup`.
        device: its CUDA device.
        timeout_s: the collective timeout.
        patience_s: how long a work may be pending before ``abandon`` is asked.
        abandon: True when the collective should be given up (a newer epoch is published).
    """

    def __init__(self, group: Any, device: torch.device, timeout_s: float, patience_s: float,
                 abandon: Callable[[], bool]) -> None:  # fmt: skip
        self.group, self.device = group, device
        self.timeout_s, self.patience_s, self.abandon = timeout_s, patience_s, abandon
        self.aborted = False

    def abort(self) -> None:
        """Abort the communicator: pending and future collectives on it fail at once."""
        if not self.aborted:
            self.aborted = True
            self.group.abort()

    def size(self) -> int:
        """Ranks in the group."""
        return int(self.group.size())

    def rank(self) -> int:
        """This member's rank in the group."""
        return int(self.group.rank())

    def name(self) -> str:
        """The backend's name."""
        return "nccl"

    def allreduce(self, tensors: list[torch.Tensor], *opts: Any) -> _WatchedWork:
        """``ProcessGroup.allreduce``, watched."""
        return _WatchedWork(self.group.allreduce(tensors, *opts), self)

    def allgather(self, out: list[list[torch.Tensor]], inp: list[torch.Tensor]) -> _WatchedWork:
        """``ProcessGroup.allgather``, watched."""
        return _WatchedWork(self.group.allgather(out, inp), self)

    def broadcast(self, tensors: Any, *opts: Any) -> _WatchedWork:
        """``ProcessGroup.broadcast``, watched."""
        return _WatchedWork(self.group.broadcast(tensors, *opts), self)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _WatchedWork:
        """``ProcessGroup.send``, watched."""
        return _WatchedWork(self.group.send(tensors, dst, tag), self)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _WatchedWork:
        """``ProcessGroup.recv``, watched."""
        return _WatchedWork(self.group.recv(tensors, src, tag), self)


def _nccl_group(store: Store, rank: int, size: int, device: torch.device,
                timeout: timedelta) -> Any:  # fmt: skip
    """A ProcessGroup with one NCCL backend, non-blocking so that ``abort()`` can end a wait."""
    pg = dist.ProcessGroup(store, rank, size)
    pg._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
    opts = dist.ProcessGroupNCCL.Options()  # CUDA builds only
    opts.config.blocking = False
    opts._timeout = timeout
    backend = dist.ProcessGroupNCCL(store, rank, size, opts)
    backend._set_sequence_number_for_group()
    backend.eager_connect_single_device(device)
    pg._register_backend(device, dist.ProcessGroup.BackendType.NCCL, backend)
    return pg


def build_group(store: Store, rank: int, size: int, *, device: torch.device,
                timeout: timedelta, patience_s: float = 0.0,
                abandon: Callable[[], bool] = lambda: False) -> Any:  # fmt: skip
    """The replicate group of one epoch on ``store`` (a fresh ``PrefixStore``); None for one.

    gloo (CPU): a plain ``ProcessGroupGloo``; NCCL (CUDA): a :class:`WatchedGroup`.
    """
    if size == 1:
        return None
    if backend_for(device) == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    pg = _nccl_group(store, rank, size, device, timeout)
    return WatchedGroup(pg, device, timeout.total_seconds(), patience_s, abandon)


def abort_group(group: Any) -> None:
    """Give up ``group`` after a fault: abort a NCCL communicator; gloo closes its sockets when
    the last reference goes (the peers' pending collectives fail on them)."""
    if isinstance(group, WatchedGroup):
        try:
            group.abort()
        except RuntimeError as e:  # already torn down by the backend: nothing left to abort
            log.warning("aborting the NCCL group failed: %s", e)


def build_shard_group(store: Store, layout: Layout, device: torch.device,
                      timeout: timedelta) -> dist.ProcessGroup:  # fmt: skip
    """The ``G`` ranks of this worker's replica group, as the default process group.

    Built once per group (a group never changes: a death replaces the whole group), on
    ``PrefixStore(f"group{id}", store)``, so FSDP2, ``DeviceMesh`` and functional collectives
    use it as any process group. ``G = 1``: a group of one on a private store.

    Raises:
        ConfigError: a default process group already exists in this process.
    """
    if dist.is_initialized():
        raise ConfigError(
            "a default process group already exists in this process; under `stalwart run` "
            "the Job builds the replica group's own (job.shard_group): do not call "
            "init_process_group yourself, and build the Job before ShardedState"
        )
    if layout.group_size > 1:
        prefixed: Store = PrefixStore(f"group{layout.group}", store)
    else:
        prefixed = dist.HashStore()
    dist.init_process_group(backend_for(device), store=prefixed, rank=layout.group_rank,
                            world_size=layout.group_size, timeout=timeout)  # fmt: skip
    assert dist.group.WORLD is not None
    return dist.group.WORLD


def build_solo_group(device: torch.device) -> dist.ProcessGroup:
    """A process group of this process alone (the shard group when groups have one rank)."""
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device), store=dist.HashStore(), rank=0,
                                world_size=1)  # fmt: skip
        assert dist.group.WORLD is not None
        return dist.group.WORLD
    group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    assert group is not None
    return group


def shard_mesh(group: dist.ProcessGroup, device: torch.device) -> Any:
    """A 1-D ``DeviceMesh`` over ``group`` (for ``fully_shard(model, mesh=...)``)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device.type, mesh_dim_names=("shard",))


def agree(shard_group: Any, values: list[float]) -> list[float]:
    """Sum ``values`` over the replica group (collective on every rank of it); None: unchanged.

    Raises:
        RuntimeError: the group's collective failed (a rank of this group died: the launcher
            takes the whole group out).
    """
    if shard_group is None:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device_of(shard_group))
    shard_group.allreduce([t]).wait()
    return [float(v) for v in t.cpu()]


def all_or_none(shard_group: Any, fn: Callable[[], T]) -> T:
    """Run ``fn`` (a collective on the replicate dimension) on every rank of a replica group;
    when it fails on any of them, raise on all of them.

    The ``G`` ranks of a group run their replicate collectives on ``G`` different groups, and
    one may fail (a peer of shard 0 died) while another completes. Each rank then tells the
    others over the shard group, so that the whole group takes the same path (the next epoch)
    instead of one rank waiting for a partner that left. Without groups: ``fn()``.

    Raises:
        RuntimeError: ``fn`` failed on this rank or on another rank of the group.
    """
    if shard_group is None:
        return fn()
    err: RuntimeError | None = None
    result: Any = None
    try:
        result = fn()
    except RuntimeError as e:
        if isinstance(e, StalwartError):
            raise  # a decision (DistributedError), the same on every rank: not a fault
        err = e
    (ok,) = agree(shard_group, [0.0 if err else 1.0])
    if err is not None:
        raise err
    if ok < shard_group.size():
        raise RuntimeError("a collective failed on another rank of this replica group")
    return result


def forget_frames(err: BaseException | None) -> None:
    """Drop the tracebacks of ``err`` and the exceptions chained to it (the message stays):
    a failed collective's traceback holds its group alive through the frames (a gloo group
    closes its connections only when freed: :func:`abort_group`)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        err.__traceback__ = None
        err = err.__cause__ or err.__context__
