"""Several nodes, one job: a launcher per node meets the others at a rendezvous endpoint.

``stalwart run --rdzv HOST:PORT --nnodes MIN:MAX --nproc N script.py`` on every node. The first
launcher that binds ``HOST:PORT`` hosts the coordinator's store there and supervises the job
(:mod:`stalwart.elastic.launcher`): it alone publishes membership epochs. Every other launcher is
an *agent*: it starts its node's workers, replaces the ones that die (its own
``--max-restarts``), and tells the host through the store what it cannot see from afar:

    coord/next_wid        counter: worker ids are allocated here, unique across nodes
    coord/nodes           counter: live nodes, joined minus left (an agent past MAX is refused)
    coord/agents          counter: agent records handed out (one per agent launcher)
    coord/agent/{a}/wids  JSON list: the workers agent ``a`` started
    coord/agent/{a}/left  set once (``compare_set``) by whoever counts agent ``a`` out
    coord/exit/{wid}      exit status of a worker, written by the launcher that reaped it
    coord/kill/{wid}      the host asks the worker's launcher to SIGKILL it (hung, absent)
    coord/final           JSON list: the members of the final epoch (agents stop the others)

Workers of every node connect to the same store and join the same epochs; gloo groups connect
them directly. A node *leaves* when its launcher has no workers left (they died and its restarts
ran out) or when it dies with them: the survivors' collectives fail on the closed connections
at once, and the host takes the silent workers for dead after the hang timeout (no heartbeat)
and publishes the next epoch without them. A node *joins* by starting a launcher with the same
``--rdzv``: its workers announce themselves and the host adds them at the next step boundary,
where they heal from a live member.

**Counting nodes.** ``--nnodes MIN:MAX`` caps the nodes *at once*: an agent that leaves counts
itself out of ``coord/nodes`` when its loop ends. One that dies cannot, so a launcher about to
join first counts out every agent whose workers the host has all written off (each reaped with
an exit status, or asked to be killed: the host took it for hung, as it does for the silent
workers of a dead node). ``compare_set`` on ``.../left`` makes each agent count out once.

The first epoch waits for ``MIN`` nodes' workers (``MIN * N``, nodes being alike) or the start
grace. The host's death ends the job for everyone (no other launcher re-hosts the store; see
``docs/elastic.md``).
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from torch.distributed import Store, TCPStore

from stalwart.elastic.coordinator import Coordinator
from stalwart.elastic.events import EventKind, EventLog
from stalwart.elastic.protocol import ENV_STORE, ENV_STORE_FILE, ENV_WORKER, decode, encode, keys
from stalwart.elastic.recovery import LAUNCHER_LOG
from stalwart.elastic.stopping import drain
from stalwart.errors import ConfigError, DistributedError

__all__ = ["RdzvCoordinator", "parse_nnodes", "rendezvous", "run_agent", "worker_views"]

log = logging.getLogger(__name__)

_POLL_S = 0.02
_TERM_GRACE_S = 5.0


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"MIN:MAX"`` or ``"N"`` as ``(min, max)``.

    Raises:
        ConfigError: not numbers, or not 1 <= MIN <= MAX.
    """
    lo, _, hi = text.partition(":")
    try:
        bounds = (int(lo), int(hi or lo))
    except ValueError:
        bounds = (0, 0)
    if not 1 <= bounds[0] <= bounds[1]:
        raise ConfigError(f"--nnodes {text!r}: write MIN:MAX (or N) with 1 <= MIN <= MAX")
    return bounds


class RdzvCoordinator(Coordinator):
    """The coordinator's store bound to the rendezvous ``host:port`` (the host node)."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.store = TCPStore(host, port, is_master=True, wait_for_workers=False)
        self.epoch = 0
        self.members: tuple[int, ...] = ()

    @property
    def address(self) -> str:
        """``host:port`` of the rendezvous endpoint."""
        return f"{self.host}:{self.store.port}"


def rendezvous(address: str, max_nodes: int) -> tuple[RdzvCoordinator | None, Store, int]:
    """Meet at ``address``: host the store if the port is free, else join as an agent.

    Returns:
        ``(coordinator, store, node)``: the coordinator when this launcher hosts the job (None
        for an agent), a store client, and this node's number (0 for the first).

    Raises:
        ConfigError: ``address`` is not ``HOST:PORT`` (a port from 1 to 65535), or the job
            already has ``max_nodes`` live nodes.
    """
    host, _, port_text = address.rpartition(":")
    if not host or not port_text.isdigit():
        raise ConfigError(f"--rdzv {address!r}: write HOST:PORT (e.g. 10.0.0.1:29400)")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ConfigError(
            f"--rdzv {address!r}: port {port} is out of range; give a TCP port from 1 to 65535 "
            "(e.g. 10.0.0.1:29400)"
        )
    coord: RdzvCoordinator | None = None
    try:
        coord = RdzvCoordinator(host, port)
        store: Store = coord.store
    except RuntimeError:  # the port is taken: another launcher hosts the job
        store = TCPStore(host, port, is_master=False, wait_for_workers=False)
    if coord is None:
        _count_out_departed(store)
    node = int(store.add(keys.NODES, 1)) - 1
    if node >= max_nodes:
        store.add(keys.NODES, -1)
        raise ConfigError(
            f"the job at {address} already has {max_nodes} nodes running (--nnodes "
            f"MIN:{max_nodes}); wait for a node to leave, or raise MAX on every launcher"
        )
    return coord, store, node


def _count_out(store: Store, agent: int) -> None:
    """Take agent ``agent`` off the live nodes, exactly once whoever calls it."""
    mine = uuid.uuid4().hex
    if bytes(store.compare_set(keys.agent(agent, "left"), "", mine)).decode() == mine:
        store.add(keys.NODES, -1)


def _count_out_departed(store: Store) -> None:
    """Count out the agents whose workers the host has all written off (exited or asked to be
    killed): a launcher that died leaves its count behind, and nobody else reaps its workers."""
    for agent in range(int(store.add(keys.AGENTS, 0))):
        wids_key = keys.agent(agent, "wids")
        if store.check([keys.agent(agent, "left")]) or not store.check([wids_key]):
            continue
        wids = decode(store.get(wids_key))
        if all(store.check([keys.exit(w)]) or store.check([keys.kill(w)]) for w in wids):
            _count_out(store, agent)


def new_wid(store: Store) -> int:
    """A worker id no launcher of the job has given out."""
    return int(store.add(keys.NEXT_WID, 1)) - 1


def worker_views(store: Store, local: set[int], known: set[int]) -> tuple[set[int], dict[int, int]]:
    """The host's view of other nodes' workers: all their ids, and the exits reported so far.

    Args:
        store: the coordinator's store.
        local: ids of the host's own workers.
        known: ids whose exit the host already knows (not read again).
    """
    remote = set(range(int(store.add(keys.NEXT_WID, 0)))) - local
    exits = {
        w: int(store.get(keys.exit(w)))
        for w in remote - known
        if store.check([keys.exit(w)])
    }  # fmt: skip
    return remote, exits


def run_agent(
    cmd: list[str], nproc: int, max_restarts: int, env: dict[str, str], store: Store,
    stdout: int | None, rdzv: str, folder: Path, stop_signals: list[int] | None = None,
) -> tuple[int, int]:  # fmt: skip
    """An agent node: start, reap, replace and stop its workers; report to the host.

    Its ``spawned``/``exited`` lines go to ``folder``'s launcher log (appended: the nodes may
    share one folder).

    A signal appended to ``stop_signals`` (:func:`.stopping.run_with_signals`) stops the
    node as it stops the host: its workers get it, and time to save (:func:`.stopping.drain`).

    Returns:
        ``(exit code, restarts)``: 0 when each of its workers in the final epoch exited
        cleanly; 1 when the node left the job (no workers left) or lost the host; ``128 + N``
        when signal N stopped it.
    """
    env = dict(env, **{ENV_STORE: rdzv})
    env.pop(ENV_STORE_FILE, None)
    events = EventLog(folder, -1, name=LAUNCHER_LOG)
    agent = int(store.add(keys.AGENTS, 1)) - 1
    try:
        return _agent_loop(
            cmd,
            nproc,
            max_restarts,
            env,
            store,
            stdout,
            events,
            agent,
            [] if stop_signals is None else stop_signals,
        )
    finally:
        events.close()
        with contextlib.suppress(RuntimeError):  # the host is gone, and its count with it
            _count_out(store, agent)  # the node left: a replacement node may join


def _agent_loop(
    cmd: list[str], nproc: int, max_restarts: int, env: dict[str, str], store: Store,
    stdout: int | None, events: EventLog, agent: int, stop_signals: list[int],
) -> tuple[int, int]:  # fmt: skip
    procs: dict[int, subprocess.Popen[bytes]] = {}
    codes: dict[int, int] = {}
    restarts = stopped = 0
    final: list[int] | None = None

    def spawn(replaces: int | None = None) -> None:
        wid = new_wid(store)
        store.set(keys.agent(agent, "wids"), encode(sorted([*procs, wid])))  # type: ignore[arg-type]  # the stub says str; bytes are accepted
        events.write(EventKind.SPAWNED, wid=wid, replaces=replaces)
        procs[wid] = subprocess.Popen(cmd, env=dict(env, **{ENV_WORKER: str(wid)}), stdout=stdout)

    for _ in range(nproc):
        spawn()
    try:
        while any(w not in codes for w in procs):
            if stop_signals:
                stopped = drain(procs.values(), stop_signals)
                break
            for wid, p in list(procs.items()):
                if wid in codes:
                    continue
                if p.poll() is None and store.check([keys.kill(wid)]):
                    p.kill()  # the host took it for hung
                if p.poll() is None:
                    continue
                p.wait()
                codes[wid] = p.returncode
                store.set(keys.exit(wid), str(p.returncode))
                events.write(EventKind.EXITED, wid=wid, rc=p.returncode,
                             stopped=final is not None and wid not in final)  # fmt: skip
                if p.returncode != 0 and final is None and restarts < max_restarts:
                    restarts += 1
                    spawn(replaces=wid)
            if final is None and store.check([keys.FINAL]):
                final = decode(store.get(keys.FINAL))
                for wid in set(procs) - set(final) - set(codes):
                    procs[wid].terminate()  # a joiner the job no longer needs
            time.sleep(_POLL_S)
    except RuntimeError as e:  # DistNetworkError: the host launcher is gone
        log.error("the job's host launcher is gone (%s); stopping this node's workers", e)
        final = None
    finally:
        _stop(procs)
    if stopped:
        _report_stopped(store, events, procs, codes)
        return stopped, restarts
    ok = final is not None and all(codes.get(w) == 0 for w in procs if w in final)
    return (0 if ok else 1), restarts


def _report_stopped(
    store: Store, events: EventLog, procs: dict[int, subprocess.Popen[bytes]],
    codes: dict[int, int],
) -> None:  # fmt: skip
    """Tell the host (and the launcher log) how the workers a signal stopped exited."""
    for wid, p in procs.items():
        if wid in codes:
            continue
        events.write(EventKind.EXITED, wid=wid, rc=p.returncode, stopped=True)
        with contextlib.suppress(RuntimeError):  # the host is gone
            store.set(keys.exit(wid), str(p.returncode))


def _stop(procs: dict[int, subprocess.Popen[bytes]]) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.terminate()
    for p in procs.values():
        try:
            p.wait(_TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def publish_final(store: Store, members: Any) -> None:
    """Tell the agents which workers make up the final epoch."""
    store.set(keys.FINAL, encode(list(members)))  # type: ignore[arg-type]  # the stub says str; bytes are accepted


def ask_kill(store: Store, wid: int) -> None:
    """Ask worker ``wid``'s launcher to SIGKILL it; nobody may be left to (a dead node)."""
    try:
        store.set(keys.kill(wid), "1")
    except RuntimeError as e:
        raise DistributedError(f"cannot reach the store to stop worker {wid}: {e}") from e
