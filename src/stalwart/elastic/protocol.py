"""The coordinator's key space on the store, and the environment a launched worker reads.

The coordinator is torch.distributed's ``TCPStore``, hosted by ``stalwart run``; no other
service is involved. Every key lives under ``coord/``; each membership epoch's process group
uses its own ``PrefixStore(f"epoch{n}", store)``, so the two never collide.

    coord/epoch                    latest published membership epoch (decimal string)
    coord/epoch{n}/members         JSON list of the worker ids in epoch n, ascending
    coord/epoch{n}/groups          JSON list of replica groups, each its worker ids by rank in
                                   the group (only with --group-size > 1; see groups.py)
    coord/epoch{n}/arrived         counter: members that came to build epoch n's group
    coord/epoch{n}/arrived/{wid}   set by each member that came (who never came: hung)
    coord/epoch{n}/fate            "go" or "abandon", decided once with compare_set
    coord/epoch{n}/faults          counter: members that saw a collective of epoch n fail
    coord/ready/{wid}              JSON {"pid", "min_size", "group", "group_rank"}: worker
                                   wid is ready to join
    coord/layout/{wid}             JSON {"group", "group_rank", "group_size", "local_rank"}:
                                   written by the launcher before it starts worker wid
    coord/done/{wid}               JSON {"step", "epoch"}: worker wid finished and agreed
    coord/beat/{wid}               counter: worker wid's heartbeats (a daemon thread adds 1)
    coord/stats/{wid}              JSON: worker wid's latest step-time window (see stats.py)
    coord/next_wid, coord/nodes, coord/exit/{wid}, coord/kill/{wid}, coord/final,
    coord/agents, coord/agent/{a}/wids, coord/agent/{a}/left
                                   several nodes' launchers (see nodes.py)

Environment of a worker started by ``stalwart run`` (parsed in one place, :func:`from_env`,
from the values :func:`stalwart.environment.elastic_worker` read):

    STALWART_ELASTIC_STORE     host:port of the coordinator's TCPStore
    STALWART_ELASTIC_WORKER    this worker's id (a replacement gets a fresh id)
    STALWART_ELASTIC_EVENTS    folder for the per-worker JSON-lines event files
    STALWART_ELASTIC_TIMEOUT_S the job's one timeout (seconds, default 10): each epoch's group
                               timeout; the others derive from it (timeouts.py)
    STALWART_ELASTIC_HANG_S    hang timeout: heartbeats are sent 5 times per it (default 5)
    STALWART_ELASTIC_STORE_FILE file holding the coordinator's current ``host:port``: after the
                               store is lost, a worker reconnects to the address written
                               there (a re-hosted coordinator), see :mod:`membership`
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from stalwart.elastic.timeouts import DEFAULT_TIMEOUT_S
from stalwart.environment import elastic_worker
from stalwart.errors import ConfigError

__all__ = [
    "ENV_EVENTS",
    "ENV_HANG",
    "ENV_STORE",
    "ENV_STORE_FILE",
    "ENV_TIMEOUT",
    "ENV_WORKER",
    "WorkerEnv",
    "from_env",
    "keys",
    "read_address",
    "write_address",
]

ENV_STORE = "STALWART_ELASTIC_STORE"
ENV_WORKER = "STALWART_ELASTIC_WORKER"
ENV_EVENTS = "STALWART_ELASTIC_EVENTS"
ENV_TIMEOUT = "STALWART_ELASTIC_TIMEOUT_S"
ENV_HANG = "STALWART_ELASTIC_HANG_S"
ENV_STORE_FILE = "STALWART_ELASTIC_STORE_FILE"

DEFAULT_HANG_S = 5.0


class keys:  # a namespace of key builders, read like ``keys.members(n)``
    """Names of the coordinator's keys (see the module docstring)."""

    EPOCH = "coord/epoch"
    NEXT_WID = "coord/next_wid"
    NODES = "coord/nodes"
    AGENTS = "coord/agents"  # agent records handed out, one per agent launcher (nodes.py)
    FINAL = "coord/final"
    PROGRESS = "job/progress"  # the newest committed step, written by the lowest rank
    FATAL = "job/fatal"  # a worker's error no replacement can fix: the launcher stops

    @staticmethod
    def exit(wid: int) -> str:
        """Worker ``wid``'s exit status, written by the launcher that reaped it."""
        return f"coord/exit/{wid}"

    @staticmethod
    def kill(wid: int) -> str:
        """Set by the host to have worker ``wid``'s launcher SIGKILL it."""
        return f"coord/kill/{wid}"

    @staticmethod
    def agent(a: int, what: str) -> str:
        """Agent launcher ``a``'s record ``what``: ``wids`` (its workers), ``left`` (set once
        by whoever counts it out of :attr:`NODES`)."""
        return f"coord/agent/{a}/{what}"

    @staticmethod
    def follow(shard_rank: int) -> str:
        """A replacement's token asking to follow the survivors' rank ``shard_rank`` of their
        first replica group (0 without groups; :mod:`stalwart.elastic.follow_job`)."""
        return f"job/follow/{shard_rank}"

    @staticmethod
    def members(epoch: int) -> str:
        """Key of epoch ``epoch``'s member list."""
        return f"coord/epoch{epoch}/members"

    @staticmethod
    def groups(epoch: int) -> str:
        """Key of epoch ``epoch``'s replica groups (worker ids by rank in the group)."""
        return f"coord/epoch{epoch}/groups"

    @staticmethod
    def layout(wid: int) -> str:
        """Worker ``wid``'s place: its replica group, rank in it, group size, device slot."""
        return f"coord/layout/{wid}"

    @staticmethod
    def arrived(epoch: int) -> str:
        """Counter of members that came to build epoch ``epoch``'s group."""
        return f"coord/epoch{epoch}/arrived"

    @staticmethod
    def arrival(epoch: int, wid: int) -> str:
        """Set by worker ``wid`` when it came to build epoch ``epoch``'s group."""
        return f"coord/epoch{epoch}/arrived/{wid}"

    @staticmethod
    def fate(epoch: int) -> str:
        """The one decision, go or abandon, about epoch ``epoch``'s group."""
        return f"coord/epoch{epoch}/fate"

    @staticmethod
    def faults(epoch: int) -> str:
        """Counter of fault reports about epoch ``epoch``."""
        return f"coord/epoch{epoch}/faults"

    @staticmethod
    def ready(wid: int) -> str:
        """Worker ``wid``'s readiness record."""
        return f"coord/ready/{wid}"

    @staticmethod
    def done(wid: int) -> str:
        """Worker ``wid``'s completion record."""
        return f"coord/done/{wid}"

    @staticmethod
    def beat(wid: int) -> str:
        """Counter of worker ``wid``'s heartbeats."""
        return f"coord/beat/{wid}"

    @staticmethod
    def stats(wid: int) -> str:
        """Worker ``wid``'s latest step-time window."""
        return f"coord/stats/{wid}"


def encode(value: Any) -> bytes:
    """JSON bytes for a store value."""
    return json.dumps(value, separators=(",", ":")).encode()


def decode(raw: bytes) -> Any:
    """Inverse of :func:`encode`."""
    return json.loads(raw.decode())


@dataclass(frozen=True)
class WorkerEnv:
    """What ``stalwart run`` tells a worker.

    Attributes:
        host: the coordinator store's host.
        port: the coordinator store's port (chosen by the OS).
        worker_id: this worker's id, unique in the job.
        events_dir: folder for event files, or None to keep no events.
        timeout_s: timeout of each epoch's gloo group, in seconds.
        hang_s: the launcher's hang timeout (heartbeats go 5 times per it; 0: none sent).
        store_file: where a re-hosted coordinator's address appears (None: no fail-over).
    """

    host: str
    port: int
    worker_id: int
    events_dir: Path | None
    timeout_s: float
    hang_s: float = DEFAULT_HANG_S
    store_file: Path | None = None

    @property
    def timeout(self) -> timedelta:
        """:attr:`timeout_s` as a timedelta, as torch.distributed takes it."""
        return timedelta(seconds=self.timeout_s)


def from_env(environ: Mapping[str, str] | None = None) -> WorkerEnv | None:
    """This worker's settings from ``environ`` (default: the ``STALWART_ELASTIC_*`` variables,
    read by :mod:`stalwart.environment`); None outside stalwart run.

    Raises:
        ConfigError: a variable is present but malformed.
    """
    env = elastic_worker() if environ is None else environ
    address = env.get(ENV_STORE)
    if not address:
        return None
    host, _, port = address.rpartition(":")
    try:
        worker_id = int(env[ENV_WORKER])
        timeout_s = float(env.get(ENV_TIMEOUT, DEFAULT_TIMEOUT_S))
        hang_s = float(env.get(ENV_HANG, DEFAULT_HANG_S))
        port_number = int(port)
    except (KeyError, ValueError) as e:
        raise ConfigError(
            f"{ENV_STORE}={address!r} is set but {ENV_WORKER}, {ENV_TIMEOUT}, {ENV_HANG} or the "
            f"port is missing or not a number ({e}); start workers with `stalwart run`, or unset "
            f"{ENV_STORE} to run under torchrun or as a single process"
        ) from e
    events = env.get(ENV_EVENTS)
    return WorkerEnv(
        host=host or "127.0.0.1",
        port=port_number,
        worker_id=worker_id,
        events_dir=Path(events) if events else None,
        timeout_s=timeout_s,
        hang_s=hang_s,
        store_file=Path(env[ENV_STORE_FILE]) if env.get(ENV_STORE_FILE) else None,
    )


def write_address(path: Path, address: str) -> None:
    """Publish the coordinator's ``host:port`` in ``path`` atomically (write, then rename)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(address)
    os.replace(tmp, path)


def read_address(path: Path | None) -> tuple[str, int] | None:
    """The ``(host, port)`` written by :func:`write_address`; None when absent or unreadable."""
    if path is None:
        return None
    try:
        host, _, port = path.read_text().strip().rpartition(":")
        return host or "127.0.0.1", int(port)
    except (OSError, ValueError):
        return None
