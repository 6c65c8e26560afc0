"""``launch``: start the coordinator and N workers, replace the ones that die, report.

Survivors are never restarted: a dead worker (non-zero exit, signal) is replaced by a fresh
process with a new worker id, which joins the running job at the next epoch and heals from a
live member. A worker whose heartbeats stopped for the hang timeout is SIGKILLed (see
:mod:`stalwart.elastic.heartbeat`) and replaced the same way; a member persistently slower
than the others is reported as a straggler (:mod:`stalwart.elastic.stats`), not removed.
The job ends when the members of one epoch have agreed on their final step
(:meth:`stalwart.elastic.Job.close`); workers that were still joining then are stopped.

**Coordinator loss.** The store's address is also written to ``<events>/coordinator.addr``
(``STALWART_ELASTIC_STORE_FILE``). When the store fails, or on SIGUSR1 (a fail-over drill;
:class:`~stalwart.testing.chaos.LoseCoordinator`), the launcher re-hosts it (:meth:`rehost`)
and the workers follow the file (:mod:`.membership`): no restart, no disk. If the launcher
itself dies, its workers stop with a ``DistributedError`` saying so (docs/elastic.md).

Exit code: 0 when every member of the final epoch exited cleanly; 1 otherwise (all workers
died, restarts ran out with fewer than ``min_size`` workers left, or a member of the final
epoch failed).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalwart.elastic.coordinator import Coordinator
from stalwart.elastic.events import EventKind, EventLog, JobSummary, summarize
from stalwart.elastic.heartbeat import HeartbeatWatch
from stalwart.elastic.nodes import (
    RdzvCoordinator,
    ask_kill,
    new_wid,
    parse_nnodes,
    publish_final,
    rendezvous,
    run_agent,
    worker_views,
)
from stalwart.elastic.protocol import (
    ENV_EVENTS,
    ENV_HANG,
    ENV_STORE,
    ENV_STORE_FILE,
    ENV_TIMEOUT,
    ENV_WORKER,
    keys,
    write_address,
)
from stalwart.elastic.recovery import LAUNCHER_LOG, Recovery, recoveries
from stalwart.elastic.stats import StragglerWatch
from stalwart.errors import ConfigError

__all__ = ["LaunchResult", "launch"]

log = logging.getLogger(__name__)

_POLL_S = 0.02
_TERM_GRACE_S = 5.0
_STATS_POLL_S = 0.05  # well under a window of short steps: windows are not missed
STORE_FILE = "coordinator.addr"


@dataclass
class LaunchResult:
    """The outcome of :func:`launch`.

    Attributes:
        exit_code: 0 on success (see the module docstring).
        restarts: replacement workers started.
        wall_s: seconds from the start to the last worker's exit.
        events_dir: the folder of the workers' event files.
        summary: what the event files say.
        recoveries: each abnormal worker exit and how the job recovered from it.
        hung: the workers killed for silent heartbeats, with the silence in seconds.
        stragglers: the members reported as persistent stragglers (wid, medians, ratio).
        rehosts: times the coordinator's store was re-hosted (see the module docstring).
    """

    exit_code: int
    restarts: int
    wall_s: float
    events_dir: Path
    summary: JobSummary
    recoveries: list[Recovery]
    hung: dict[int, float]
    stragglers: list[dict[str, Any]]
    rehosts: int = 0


class _Supervisor:
    """The launcher's loop: spawn, reap, replace, publish epochs."""

    def __init__(self, cmd: list[str], nproc: int, min_size: int, max_restarts: int,
                 env: dict[str, str], start_grace_s: float,
                 straggler_factor: float, stdout: int | None = None,
                 coord: Coordinator | None = None, min_nodes: int = 1) -> None:  # fmt: skip
        self.cmd, self.nproc, self.min_size = cmd, nproc, min_size
        self.max_restarts, self.env, self.start_grace_s = max_restarts, env, start_grace_s
        self.stdout, self.min_nodes = stdout, min_nodes
        self.coord = coord or Coordinator()
        self.remote: set[int] = set()  # other nodes' workers (see nodes.py)
        self.beats = HeartbeatWatch(self.coord.store, float(env[ENV_HANG]))
        self.hung: dict[int, float] = {}
        self.stragglers = StragglerWatch(straggler_factor)
        self._stats_at = 0.0
        self.env[ENV_STORE] = self.coord.address
        self.store_file = Path(env[ENV_EVENTS]) / STORE_FILE
        self.env[ENV_STORE_FILE] = str(self.store_file)
        write_address(self.store_file, self.coord.address)
        self.rehost_requested = False
        self.rehosts = 0
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.codes: dict[int, int] = {}
        self.restarts = 0
        self.final_members: tuple[int, ...] | None = None
        self.t0 = time.monotonic()
        events = Path(env[ENV_EVENTS])
        self.log = EventLog(events, -1, name=LAUNCHER_LOG)

    def spawn(self, replaces: int | None = None) -> None:
        wid = new_wid(self.coord.store)
        self.log.write(EventKind.SPAWNED, wid=wid, replaces=replaces)
        env = dict(self.env, **{ENV_WORKER: str(wid)})
        self.procs[wid] = subprocess.Popen(self.cmd, env=env, stdout=self.stdout)

    def live(self) -> set[int]:
        return {w for w in set(self.procs) | self.remote if w not in self.codes}

    def kill(self, wid: int) -> None:
        """SIGKILL worker ``wid``: here, or through its node's launcher (taken for dead)."""
        if wid in self.procs:
            self.procs[wid].kill()
            self.procs[wid].wait()  # so that this loop's reap replaces it
            return
        ask_kill(self.coord.store, wid)
        self.codes[wid] = -9  # its node may be gone with it: nobody else would report it

    def reap(self) -> None:
        for wid, p in list(self.procs.items()):
            if wid in self.codes or p.poll() is None:
                continue
            self.codes[wid] = p.returncode
            stopped = self.final_members is not None and wid not in self.final_members
            self.log.write(EventKind.EXITED, wid=wid, rc=p.returncode, stopped=stopped)
            if p.returncode != 0 and self.final_members is None:
                log.warning("worker %d exited with %d", wid, p.returncode)
                if self.restarts < self.max_restarts:
                    self.restarts += 1
                    self.spawn(replaces=wid)
        self.remote, exits = worker_views(self.coord.store, set(self.procs), set(self.codes))
        self.codes.update(exits)  # other nodes' launchers reap and replace their own

    def check_finish(self) -> None:
        if self.final_members is not None:
            return
        done = self.coord.done(set(self.procs) | self.remote)
        if done:
            epoch = max(int(d["epoch"]) for d in done.values())
            self.final_members = self.coord.members_of(epoch)
            publish_final(self.coord.store, self.final_members)
            for wid in self.live() - set(self.final_members):
                if wid in self.procs:
                    self.procs[wid].terminate()  # a joiner the job no longer needs

    def exclude_hung(self) -> None:
        """Kill members that never came to an abandoned epoch; reaping then replaces them."""
        if not self.coord.faulted():
            return
        for wid in self.coord.absent() & self.live():
            log.warning("worker %d never joined epoch %d: taken for hung, killed", wid,
                        self.coord.epoch)  # fmt: skip
            self.kill(wid)

    def kill_silent(self) -> None:
        """SIGKILL workers whose heartbeats stopped; reaping then replaces them.

        The kill closes their sockets, which fails the survivors' pending collective at once.
        A worker that finished (it only has to exit) is not judged any more.
        """
        live = self.live()
        for wid, silent in self.beats.hung(live - set(self.coord.done(live))).items():
            log.warning("worker %d sent no heartbeat for %.1f s: taken for hung, killed", wid,
                        silent)  # fmt: skip
            self.log.write(EventKind.HUNG, wid=wid, silent_s=silent)
            self.hung[wid] = silent
            self.kill(wid)
            self.beats.forget(wid)

    def watch_stragglers(self) -> None:
        """Compare the members' latest step-time windows; log each new persistent straggler."""
        now = time.monotonic()
        if now - self._stats_at < _STATS_POLL_S or self.coord.epoch == 0:
            return
        self._stats_at = now
        members = set(self.coord.members) & self.live()
        for report in self.stragglers.update(self.coord.stats(members)):
            log.warning("worker %d is a straggler: own step time %.1f ms, others %.1f ms",
                        report["wid"], report["own_median"] * 1e3,
                        report["others_median"] * 1e3)  # fmt: skip
            self.log.write(EventKind.STRAGGLER, **report)

    def publish_if_due(self) -> None:
        live = self.live()
        ready = self.coord.ready(live)
        candidates = set(ready)
        if self.final_members is not None:
            candidates &= set(self.final_members)
        needed = max([self.min_size] + [int(r.get("min_size", 1)) for r in ready.values()])
        if self.final_members is not None:
            needed = 1
        if self.coord.epoch == 0:
            waited = time.monotonic() - self.t0
            expected = self.nproc * self.min_nodes  # nodes are alike
            due = len(candidates) >= expected or waited > self.start_grace_s
        else:
            died = {w for w in self.coord.members if self.codes.get(w, 0) != 0}
            due = bool(died) or self.coord.faulted() or bool(candidates - set(self.coord.members))
        if due and candidates and len(candidates) >= needed:
            n = self.coord.publish(candidates)
            log.info("epoch %d: members %s", n, sorted(candidates))

    def rehost(self, why: str) -> None:
        """Host the coordinator anew: drop the old store (workers' calls on it fail), publish the
        next epoch with the live members on a fresh one, then write its address to the file."""
        if isinstance(self.coord, RdzvCoordinator):  # other nodes could not follow a new port
            log.warning("coordinator re-hosting (%s) is not done for --rdzv jobs", why)
            return
        old_epoch, old_members = self.coord.epoch, self.coord.members
        self.coord = self.beats = None  # type: ignore[assignment]  # drop the old store's server
        self.coord = Coordinator()
        self.coord.epoch = old_epoch
        self.coord.store.add(keys.NEXT_WID, max(self.procs, default=-1) + 1)  # ids stay unique
        self.beats = HeartbeatWatch(self.coord.store, float(self.env[ENV_HANG]))
        self.env[ENV_STORE] = self.coord.address
        members = set(old_members) & self.live()
        if members:
            self.coord.publish(members)
        write_address(self.store_file, self.coord.address)
        self.rehosts += 1
        log.warning("coordinator re-hosted at %s (%s); epoch %d: members %s",
                    self.coord.address, why, self.coord.epoch, sorted(members))  # fmt: skip
        self.log.write(EventKind.COORDINATOR_REHOSTED, address=self.coord.address, why=why,
                       epoch=self.coord.epoch, members=sorted(members))  # fmt: skip

    def failed(self) -> bool:
        """True when the job cannot go on: nobody alive, or too few and no restarts left."""
        live = self.live()
        if self.final_members is not None:
            return False
        return not live or (len(live) < self.min_size and self.restarts >= self.max_restarts)

    def run(self) -> int:
        for _ in range(self.nproc):
            self.spawn()
        try:
            while self.live():
                if self.rehost_requested:
                    self.rehost_requested = False
                    self.rehost("SIGUSR1")
                try:
                    self.kill_silent()
                    self.exclude_hung()
                    self.reap()
                    self.check_finish()
                    if self.failed():
                        return 1
                    self.publish_if_due()
                    self.watch_stragglers()
                except RuntimeError as e:  # DistNetworkError: the store failed
                    self.rehost(f"store failed: {e}")
                time.sleep(_POLL_S)
        finally:
            self.stop_all()
        final = self.final_members or ()
        return 0 if final and all(self.codes.get(w) == 0 for w in final) else 1

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for wid, p in self.procs.items():
            try:
                p.wait(_TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if wid not in self.codes:
                self.codes[wid] = p.returncode
                self.log.write(EventKind.EXITED, wid=wid, rc=p.returncode, stopped=True)
        self.log.close()


def _run_with_drill(sup: _Supervisor) -> int:
    """``sup.run()``, with SIGUSR1 asking for a re-hosted coordinator (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return sup.run()

    def request(*_: object) -> None:
        sup.rehost_requested = True

    previous = signal.signal(signal.SIGUSR1, request)
    try:
        return sup.run()
    finally:
        signal.signal(signal.SIGUSR1, previous)


def _agent(cmd: list[str], nproc: int, max_restarts: int, env: dict[str, str], store: Any,
           stdout: int | None, rdzv: str, folder: Path) -> LaunchResult:  # fmt: skip
    t0 = time.monotonic()
    code, n = run_agent(cmd, nproc, max_restarts, env, store, stdout, rdzv, folder)
    return LaunchResult(code, n, time.monotonic() - t0, folder, summarize(folder),
                        recoveries(folder), hung={}, stragglers=[])  # fmt: skip


def _prepare(events_dir: str | os.PathLike[str] | None, env: Mapping[str, str] | None,
             timeout_s: float, hang_s: float) -> tuple[Path, dict[str, str]]:  # fmt: skip
    """The events folder (made) and the workers' environment."""
    folder = Path(events_dir) if events_dir else Path(tempfile.mkdtemp(prefix="stalwart-run-"))
    folder.mkdir(parents=True, exist_ok=True)
    worker_env = dict(os.environ if env is None else env)
    worker_env.update(
        {ENV_EVENTS: str(folder), ENV_TIMEOUT: str(timeout_s), ENV_HANG: str(max(hang_s, 0.0))}
    )
    return folder, worker_env


def launch(
    script: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    nproc: int,
    min_size: int = 1,
    max_restarts: int = 3,
    events_dir: str | os.PathLike[str] | None = None,
    timeout_s: float = 10.0,
    hang_s: float = 5.0,
    straggler_factor: float = 2.0,
    start_grace_s: float = 60.0,
    env: Mapping[str, str] | None = None,
    stdout: int | None = None,
    rdzv: str | None = None,
    nnodes: str = "1",
) -> LaunchResult:
    """Run ``python script args...`` as an elastic job of ``nproc`` workers.

    Args:
        script: the worker script (it builds a :class:`stalwart.elastic.Job`).
        args: the script's arguments.
        nproc: workers to start.
        min_size: the fewest members to train with.
        max_restarts: replacement workers to start at most, over the whole job.
        events_dir: folder for the event files (default: a new temporary folder).
        timeout_s: timeout of each epoch's gloo group, seconds.
        hang_s: kill a worker whose heartbeats stopped this long, seconds (0: never).
        straggler_factor: report a member this many times slower than the others (<= 1: off).
        start_grace_s: how long the first epoch waits for all ``nproc`` workers.
        env: environment of the workers (default: this process's).
        stdout: where the workers' stdout goes (a file descriptor, e.g. 2 for this process's
            stderr, or ``subprocess.DEVNULL``); None: this process's stdout.
        rdzv: ``HOST:PORT`` where several nodes' launchers meet (:mod:`.nodes`; per node nproc).
        nnodes: ``MIN:MAX`` nodes (``--rdzv`` only): the first epoch waits for MIN.

    Raises:
        ConfigError: an argument is out of range, or the job already has MAX nodes.
    """
    min_nodes, max_nodes = parse_nnodes(nnodes)
    if nproc < 1 or not 1 <= min_size <= nproc * max_nodes or max_restarts < 0:
        raise ConfigError(
            f"launch(nproc={nproc}, min_size={min_size}, max_restarts={max_restarts}): need "
            "nproc >= 1, 1 <= min_size <= nproc and max_restarts >= 0"
        )
    folder, worker_env = _prepare(events_dir, env, timeout_s, hang_s)
    cmd = [sys.executable, str(script), *args]
    coord = None
    if rdzv is not None:
        coord, store, _ = rendezvous(rdzv, max_nodes)
        if coord is None:  # an agent node: run its workers; the host supervises
            return _agent(cmd, nproc, max_restarts, worker_env, store, stdout, rdzv, folder)
    sup = _Supervisor(cmd, nproc, min_size, max_restarts, worker_env, start_grace_s,
                      straggler_factor, stdout, coord, min_nodes)  # fmt: skip
    code = _run_with_drill(sup)
    wall = time.monotonic() - sup.t0
    return LaunchResult(
        code, sup.restarts, wall, folder, summarize(folder), recoveries(folder),
        hung=sup.hung, stragglers=list(sup.stragglers.reported.values()), rehosts=sup.rehosts,
    )  # fmt: skip
