"""The launcher's supervisor loop: spawn workers, reap and replace them, publish epochs.

Survivors are never restarted: a dead worker (non-zero exit, signal) is replaced by a fresh
process with a new worker id, which joins the running job at the next epoch and heals from a
live member. With ``--group-size G`` the unit is a replica group of ``G`` workers: one death
takes its whole group out (the supervisor kills the others, logged ``group-down``) and a
whole new group replaces it (:mod:`stalwart.elastic.roster`). A worker whose heartbeats
stopped for the hang timeout is SIGKILLed (:mod:`stalwart.elastic.heartbeat`) and replaced the
same way; a member persistently slower than the others is reported as a straggler
(:mod:`stalwart.elastic.stats`), not removed. A worker that reports a fatal error through
the store (:meth:`~stalwart.elastic.membership.Membership.report_fatal`: the job had committed
steps and nothing can resume them) stops the job at once with :data:`EXIT_FATAL`, instead of
respawning doomed workers until ``--max-restarts``. A worker that leaves with
:data:`~stalwart.elastic.sdc.EXIT_EXCLUDED` (``--exclude-suspect-after``: named by that many
SDC verdicts) is not replaced: the job goes on with fewer members, or, below ``min_size``,
stops with :data:`EXIT_FATAL` and says why. The job ends when the members of one epoch have
agreed on their final step (:meth:`stalwart.elastic.Job.close`); workers still joining then
are stopped.

**Coordinator loss.** The store's address is also written to ``<events>/coordinator.addr``
(``STALWART_ELASTIC_STORE_FILE``). When the store fails, or on SIGUSR1 (a fail-over drill;
:class:`~stalwart.testing.chaos.LoseCoordinator`), the supervisor re-hosts it
(:meth:`Supervisor.rehost`) and the workers follow the file (:mod:`.membership`): no restart,
no disk. If the launcher itself dies, its workers stop with a ``DistributedError`` saying so.

**Stopping.** SIGTERM or SIGINT to the launcher (a container runtime signals only PID 1) is
forwarded to the live workers, so that their :class:`~stalwart.PreemptionGuard` saves; the
launcher waits up to :data:`~stalwart.elastic.stopping.STOP_GRACE_S` for them to exit,
replacing none, then stops the rest and exits with ``128 + signal`` (:mod:`.stopping`). A
second signal during the wait kills them at once.
"""

from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path
from typing import Any

import stalwart.elastic.protocol as protocol
from stalwart.elastic.coordinator import Coordinator
from stalwart.elastic.events import EventKind, EventLog
from stalwart.elastic.groups import Layout, write_layout
from stalwart.elastic.heartbeat import HeartbeatWatch
from stalwart.elastic.nodes import RdzvCoordinator, ask_kill, new_wid, publish_final, worker_views
from stalwart.elastic.recovery import LAUNCHER_LOG
from stalwart.elastic.roster import Roster
from stalwart.elastic.sdc import EXIT_EXCLUDED, exclusion_threshold
from stalwart.elastic.stats import StragglerWatch
from stalwart.elastic.stopping import drain

__all__ = ["EXIT_FATAL", "STORE_FILE", "Supervisor"]

log = logging.getLogger(__name__)

_POLL_S = 0.02
_TERM_GRACE_S = 5.0
_STATS_POLL_S = 0.05  # well under a window of short steps: windows are not missed
STORE_FILE = "coordinator.addr"
EXIT_FATAL = 3
"""The launcher's exit code when a worker reported an error no replacement can fix."""


class Supervisor:
    """The launcher's loop: spawn, reap, replace, publish epochs (module docstring).

    Args:
        cmd: the worker command line.
        nproc: workers to run; min_size: fewest replica groups to train with.
        max_restarts: replacements (of a worker or a group) to start at most.
        env: the workers' environment (``STALWART_ELASTIC_*`` set, see ``launcher._prepare``).
        start_grace_s: how long the first epoch waits for every worker.
        straggler_factor: report a member this many times slower than the others.
        stdout: where the workers' stdout goes; coord: the coordinator (default: a new one).
        min_nodes: nodes the first epoch waits for; group_size: workers per replica group.
    """

    def __init__(self, cmd: list[str], nproc: int, min_size: int, max_restarts: int,
                 env: dict[str, str], start_grace_s: float,
                 straggler_factor: float, stdout: int | None = None,
                 coord: Coordinator | None = None, min_nodes: int = 1,
                 group_size: int = 1) -> None:  # fmt: skip
        self.cmd, self.nproc, self.min_size = cmd, nproc, min_size
        self.roster = Roster(nproc, group_size)
        self.max_restarts, self.env, self.start_grace_s = max_restarts, env, start_grace_s
        self.stdout, self.min_nodes = stdout, min_nodes
        self.coord = coord or Coordinator()
        self.remote: set[int] = set()  # other nodes' workers (see nodes.py)
        self.beats = HeartbeatWatch(self.coord.store, float(env[protocol.ENV_HANG]))
        self.hung: dict[int, float] = {}
        self.stragglers = StragglerWatch(straggler_factor)
        self._stats_at = 0.0
        self.env[protocol.ENV_STORE] = self.coord.address
        self.store_file = Path(env[protocol.ENV_EVENTS]) / STORE_FILE
        self.env[protocol.ENV_STORE_FILE] = str(self.store_file)
        protocol.write_address(self.store_file, self.coord.address)
        self.rehost_requested = False
        self.stop_signals: list[int] = []  # SIGTERM, SIGINT the launcher got (drain)
        self.fatal: dict[str, Any] | None = None  # a worker's fatal report (check_fatal)
        self.excluded: list[int] = []  # workers the exclusion policy removed, not replaced
        self.rehosts = 0
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.codes: dict[int, int] = {}
        self.restarts = 0
        self.final_members: tuple[int, ...] | None = None
        self.t0 = time.monotonic()
        events = Path(env[protocol.ENV_EVENTS])
        self.log = EventLog(events, -1, name=LAUNCHER_LOG)

    def spawn(self, replaces: list[int] | None = None) -> None:
        """Start one replica group (one worker when G = 1); ``replaces``: the old group's wids."""
        roster = self.roster
        gid = roster.new_group()
        for rank in range(roster.group_size):
            old = replaces[rank] if replaces else None
            wid = new_wid(self.coord.store)
            slot = roster.free_slot(old)
            roster.add(gid, wid, slot)
            write_layout(self.coord.store, wid, Layout(gid, rank, roster.group_size, slot))
            extra = {"group": gid, "group_rank": rank} if roster.group_size > 1 else {}
            self.log.write(EventKind.SPAWNED, wid=wid, replaces=old, **extra)
            env = dict(self.env, **{protocol.ENV_WORKER: str(wid)})
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
            by = self.roster.taken_down.get(wid)
            extra: dict[str, Any] = {} if by is None else {"taken_down_by": by}
            excluded = p.returncode == EXIT_EXCLUDED and self.final_members is None
            if excluded:
                extra["excluded"] = True  # the exclusion policy: not replaced
                self.excluded.append(wid)
            self.log.write(EventKind.EXITED, wid=wid, rc=p.returncode, stopped=stopped, **extra)
            if p.returncode != 0 and self.final_members is None:
                log.warning(
                    "worker %d exited with %d%s",
                    wid,
                    p.returncode,
                    " (excluded: SDC verdicts), not replaced" if excluded else "",
                )
                self.replace_group(wid, respawn=not excluded)
        self.remote, exits = worker_views(self.coord.store, set(self.procs), set(self.codes))
        self.codes.update(exits)  # other nodes' launchers reap and replace their own

    def replace_group(self, wid: int, *, respawn: bool = True) -> None:
        """Worker ``wid`` died: kill the rest of its group, then start a new group for it
        (not when ``respawn`` is False: an excluded worker's group is not replaced)."""
        partners = self.roster.take_down(wid)
        if partners is None:
            return  # killed with its group: the group is replaced once
        if partners:
            log.warning("worker %d died: taking down its group (workers %s)", wid, partners)
            self.log.write(EventKind.GROUP_DOWN, wid=wid, killed=partners,
                           group=self.roster.group_of[wid])  # fmt: skip
        for w in partners:
            if w in self.live():
                self.kill(w)
        if respawn and self.restarts < self.max_restarts:
            self.restarts += 1
            self.spawn(replaces=self.roster.group_members(wid))

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
            self.log.write(EventKind.HUNG, wid=wid, silent_s=0.0)
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
        groups = None
        if self.roster.group_size > 1:  # only complete groups, ranks in order
            groups = self.roster.complete(candidates)
            candidates = {w for g in groups for w in g}
        replicas = len(groups) if groups is not None else len(candidates)
        if self.coord.epoch == 0:
            waited = time.monotonic() - self.t0
            expected = self.nproc * self.min_nodes  # nodes are alike
            due = len(candidates) >= expected or waited > self.start_grace_s
        else:
            died = {w for w in self.coord.members if self.codes.get(w, 0) != 0}
            due = bool(died) or self.coord.faulted() or bool(candidates - set(self.coord.members))
        if due and candidates and replicas >= needed:
            n = self.coord.publish(candidates, groups)
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
        # Worker ids stay unique across the restart.
        self.coord.store.add(protocol.keys.NEXT_WID, max(self.procs, default=-1) + 1)
        self.beats = HeartbeatWatch(self.coord.store, float(self.env[protocol.ENV_HANG]))
        self.env[protocol.ENV_STORE] = self.coord.address
        members = set(old_members) & self.live()
        groups = self.roster.complete(members) if self.roster.group_size > 1 else None
        if groups is not None:
            members = {w for g in groups for w in g}
        if members:
            self.coord.publish(members, groups)
        protocol.write_address(self.store_file, self.coord.address)
        self.rehosts += 1
        log.warning("coordinator re-hosted at %s (%s); epoch %d: members %s",
                    self.coord.address, why, self.coord.epoch, sorted(members))  # fmt: skip
        self.log.write(EventKind.COORDINATOR_REHOSTED, address=self.coord.address, why=why,
                       epoch=self.coord.epoch, members=sorted(members))  # fmt: skip

    def check_fatal(self) -> bool:
        """True when a worker reported an error no replacement can fix (logged, printed)."""
        if self.fatal is None:
            self.fatal = self.coord.fatal()
            if self.fatal is not None:
                log.error("worker %s: %s", self.fatal["wid"], self.fatal["error"])
                self.log.write(EventKind.FATAL, wid=self.fatal["wid"], error=self.fatal["error"])
        return self.fatal is not None

    def check_excluded(self) -> bool:
        """True when exclusions left fewer than ``min_size`` replicas (fatal: logged, printed)."""
        live = self.live()
        replicas = self.roster.live_groups(live) if self.roster.group_size > 1 else len(live)
        if not self.excluded or self.final_members is not None or replicas >= self.min_size:
            return False
        after = exclusion_threshold(Path(self.env[protocol.ENV_EVENTS]))
        error = (
            f"worker(s) {self.excluded} excluded after {after} SDC verdict(s) each "
            f"(--exclude-suspect-after {after}) and not replaced: {replicas} replica(s) left, "
            f"fewer than --min-size {self.min_size}; check those hosts (their start lines and "
            "the fleet log name them), or lower --min-size to train on"
        )
        self.fatal = {"wid": self.excluded[-1], "error": error}
        log.error("%s", error)
        self.log.write(EventKind.FATAL, wid=self.excluded[-1], error=error)
        return True

    def failed(self) -> bool:
        """True when the job cannot go on: nobody alive, or too few and no restarts left."""
        live = self.live()
        if self.final_members is not None:
            return False
        replicas = self.roster.live_groups(live) if self.roster.group_size > 1 else len(live)
        return not live or (replicas < self.min_size and self.restarts >= self.max_restarts)

    def run(self) -> int:
        for _ in range(self.roster.groups):
            self.spawn()
        try:
            while self.live():
                if self.stop_signals:
                    return self.drain()
                if self.rehost_requested:
                    self.rehost_requested = False
                    self.rehost("SIGUSR1")
                try:
                    self.kill_silent()
                    self.exclude_hung()
                    self.reap()
                    self.check_finish()
                    if self.check_fatal() or self.check_excluded():
                        return EXIT_FATAL
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

    def request_rehost(self) -> None:
        """Re-host the coordinator between two rounds of :meth:`run` (SIGUSR1's handler)."""
        self.rehost_requested = True

    def drain(self) -> int:
        """Stop the job on the launcher's signal (:func:`.stopping.drain`): this node's live
        workers get it and up to :data:`.STOP_GRACE_S` to save and exit; returns ``128 +
        signal``. :meth:`stop_all` (:meth:`run`) stops the rest."""
        return drain(self.procs.values(), self.stop_signals)

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
