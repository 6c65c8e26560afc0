"""Per-worker JSON-lines event files, and the job summary computed from them.

Every member appends one line per step attempt and one per event::

    {"t": wall time, "wid": id, "kind": "step", "step": committed steps after it,
     "committed": bool, "epoch": n, "members": [...], "dt": seconds the attempt took,
     "digest": hex (when one was computed at this step)}
    {"t": ..., "wid": ..., "kind": "fault-detected" | "reconfigured" | "state-received"
     | "first-commit-after-change" | "parity-mismatch" | "start" | "finish", ...}

Every kind is an :class:`EventKind`, the one list that writers and readers share
(``e["kind"] == EventKind.STATE_RECEIVED``); a ``StrEnum``, so the files hold plain strings
and a line read back compares equal to its kind. The job's own events are typed records
(:class:`StepCommitted`, :class:`FaultDetected`, ... written by ``EventLog.record``) whose
fields are the line's fields; strategies' and the launcher's events are written with
``EventLog.write(kind, **fields)``, their fields listed next to each kind.

:func:`summarize` reads a folder of them (``worker<id>.jsonl``) and returns a
:class:`JobSummary`: steps reached, faults seen, step attempts discarded, heals, parity
mismatches, and goodput: committed step time summed over workers divided by the workers'
lifetimes (first to last line) summed.

**Counting faults.** Every survivor of a failure writes its own ``fault-detected`` (a survivor
cannot tell who died: gloo reports a closed connection), so one SIGKILL among three members
gives two reports. A fault counts once per failed member: the launcher's abnormal exits
(``recovery.py``'s rule) and each reporting epoch's members missing from the next epoch; with
neither, the members that reported nothing (at least one). The raw count: ``fault_reports``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar, TextIO

__all__ = [
    "LAUNCHER_LOG",
    "EpochEvent",
    "Event",
    "EventKind",
    "EventLog",
    "FaultDetected",
    "Finish",
    "FirstCommitAfterChange",
    "JobSummary",
    "ParityMismatch",
    "Reconfigured",
    "Resumed",
    "SdcSuspect",
    "Start",
    "StateReceived",
    "StepAttempt",
    "StepCommitted",
    "StepDiscarded",
    "launcher_lines",
    "read_events",
    "read_lines",
    "summarize",
]

LAUNCHER_LOG = "launcher.jsonl"


class EventKind(StrEnum):
    """The kinds of event lines: a worker's (``worker<id>.jsonl``) and the launcher's."""

    # a worker's step and membership
    START = "start"  # pid
    STEP = "step"  # step, committed, epoch, members, dt, digest
    STEP_STATS = "step-stats"  # a step-time window (stats.py)
    FAULT_DETECTED = "fault-detected"  # step, epoch, members, error
    RECONFIGURED = "reconfigured"  # step, epoch, members
    STATE_RECEIVED = "state-received"  # step, epoch, source, ... (parity.py)
    PARITY_MISMATCH = "parity-mismatch"  # step, epoch, decision, ... (parity.py)
    FIRST_COMMIT_AFTER_CHANGE = "first-commit-after-change"  # step, epoch
    FINISH = "finish"  # step, epoch, digest
    RESUMED = "resumed"  # step, tier, steps_lost, last_known, source, rejected (ladder.py)
    SDC_SUSPECT = "sdc-suspect"  # step, epoch, suspect, tensor, decided_by (parity.py)
    # strategies
    BACKUP = "backup"  # step, epoch, ticket, used, next_k, shares, abandoned
    SHARD_HEALED = "shard-healed"  # step, lost, rebuilt, seconds, rebuild_s, slot
    # role (pusher | follower), outcome (started | promoted | abandoned | fell-back), step,
    # peer (the follower's worker id, on the pusher), detail (follow_job.py)
    FOLLOW = "follow"
    DILOCO_REPORT = "diloco-report"  # worker, base, buffer, ticket, h
    DILOCO_DROPPED = "diloco-dropped"  # worker, base, version, h
    DILOCO_MISSING = "diloco-missing"  # worker, buffer, ticket
    DILOCO_AGGREGATE = "diloco-aggregate"  # worker, version, used, dropped, momentum, ...
    DILOCO_TAKEOVER = "diloco-takeover"  # worker, buffer, departed (the claimer that left)
    # the launcher (launcher.jsonl)
    SPAWNED = "spawned"  # wid, replaces, group (replica groups only)
    # wid, rc, stopped, taken_down_by (killed with its replica group), excluded (true: the SDC
    # exclusion policy removed it, sdc.py; not replaced)
    EXITED = "exited"
    GROUP_DOWN = "group-down"  # wid (who died), killed (its group's others), group
    HUNG = "hung"  # wid, silent_s (0.0: it never joined an abandoned epoch)
    FATAL = "fatal"  # wid, error: nothing can resume the job; it stopped at once
    STRAGGLER = "straggler"  # stats.py's report
    COORDINATOR_REHOSTED = "coordinator-rehosted"  # address, why, ...


@dataclass(frozen=True, kw_only=True)
class Event:
    """A typed event line: the class fixes ``KIND``; the fields are the line's fields, in order."""

    KIND: ClassVar[EventKind]

    def fields(self) -> dict[str, Any]:
        """The line's fields after ``t``, ``wid`` and ``kind``."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, kw_only=True)
class EpochEvent(Event):
    """An event of a member in membership epoch ``epoch``, ``step`` steps committed."""

    step: int
    epoch: int


@dataclass(frozen=True, kw_only=True)
class Start(Event):
    """A worker process started (once per process: survivors never restart)."""

    KIND = EventKind.START
    pid: int
    host: dict[str, str] = field(default_factory=dict)  # environment.host_attributes()


@dataclass(frozen=True, kw_only=True)
class StepAttempt(Event):
    """A step attempt of the members ``members`` of ``epoch``, ``dt`` seconds long; ``step``
    counts the committed steps after it (the fields in the order of the module docstring)."""

    KIND = EventKind.STEP
    step: int
    committed: bool
    epoch: int
    members: list[int]
    dt: float


@dataclass(frozen=True, kw_only=True)
class StepCommitted(StepAttempt):
    """A step's update was applied; ``step`` counts it. ``digest`` when a check ran."""

    committed: bool = field(default=True, init=False)
    digest: str | None = None


@dataclass(frozen=True, kw_only=True)
class StepDiscarded(StepAttempt):
    """A step attempt failed and was discarded; ``step`` is still the committed count."""

    committed: bool = field(default=False, init=False)


@dataclass(frozen=True, kw_only=True)
class FaultDetected(EpochEvent):
    """A collective of ``epoch`` failed on this member (every survivor writes one)."""

    KIND = EventKind.FAULT_DETECTED
    members: list[int]
    error: str


@dataclass(frozen=True, kw_only=True)
class Reconfigured(EpochEvent):
    """This member joined ``epoch`` (its members listed) and reconciles with them."""

    KIND = EventKind.RECONFIGURED
    members: list[int]


@dataclass(frozen=True, kw_only=True)
class StateReceived(EpochEvent):
    """This member loaded the state worker ``source`` sent (a heal)."""

    KIND = EventKind.STATE_RECEIVED
    source: int | None
    why: str


@dataclass(frozen=True, kw_only=True)
class ParityMismatch(EpochEvent):
    """Members' digests differed; ``decision`` names the rule that chose (parity.py)."""

    KIND = EventKind.PARITY_MISMATCH
    table: list[list[Any]]
    why: str
    decision: str
    source: int | None
    rolled_back_from: int | None


@dataclass(frozen=True, kw_only=True)
class FirstCommitAfterChange(EpochEvent):
    """The first commit in a new epoch."""

    KIND = EventKind.FIRST_COMMIT_AFTER_CHANGE


@dataclass(frozen=True, kw_only=True)
class Resumed(Event):
    """No live member held the committed state: every member resumed from a checkpoint tier.

    ``tier`` is where the step came from (``memory``, a durable root); ``steps_lost`` is the
    last committed step known to the job minus ``step``; ``rejected`` lists the newer
    candidates that did not verify, each with why (:mod:`stalwart.elastic.ladder`).
    """

    KIND = EventKind.RESUMED
    step: int
    tier: str
    steps_lost: int | None
    last_known: int | None
    source: int | None
    rejected: list[list[Any]]


@dataclass(frozen=True, kw_only=True)
class SdcSuspect(EpochEvent):
    """Worker ``suspect``'s state differed from the agreeing members' at a parity check.

    Silent data corruption is suspected (its hardware computed or stored a wrong value):
    ``tensor`` names the first differing entry of the state, ``decided_by`` the rule
    (``majority``, ``re-execution``, ``rollback``). The suspect's host is in its ``start`` line.
    """

    KIND = EventKind.SDC_SUSPECT
    suspect: int
    tensor: str | None
    decided_by: str


@dataclass(frozen=True, kw_only=True)
class Finish(EpochEvent):
    """The worker agreed on the final step and left; ``digest`` of its final state."""

    KIND = EventKind.FINISH
    digest: str


class EventLog:
    """Appends JSON lines to ``<folder>/worker<wid>.jsonl`` (or drops them when no folder).

    Args:
        folder: where the file goes; None keeps no events.
        wid: the worker id, written on every line.
        name: the file name, if not ``worker<wid>.jsonl`` (the launcher's own log).
    """

    def __init__(self, folder: Path | None, wid: int, name: str | None = None) -> None:
        self.wid = wid
        self._file: TextIO | None = None
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / (name or f"worker{wid}.jsonl")
            self._file = open(path, "a", buffering=1)  # noqa: SIM115

    def write(self, kind: EventKind, **fields: Any) -> None:
        """Append one line (flushed: a SIGKILL loses nothing written before it)."""
        if self._file is not None:
            line = {"t": time.time(), "wid": self.wid, "kind": str(kind), **fields}
            self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def record(self, event: Event) -> None:
        """Append a typed event (the same line as ``write(event.KIND, **event.fields())``)."""
        self.write(event.KIND, **event.fields())

    def close(self) -> None:
        """Close the file."""
        if self._file is not None:
            self._file.close()
            self._file = None


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of one event file; a torn line (a killed writer) is skipped."""
    out = []
    for raw in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(raw))
        except json.JSONDecodeError:
            continue
    return out


def read_events(folder: Path) -> dict[int, list[dict[str, Any]]]:
    """Every worker's events by worker id; a torn last line (a killed writer) is skipped."""
    return {
        int(path.stem.removeprefix("worker")): read_lines(path)
        for path in sorted(folder.glob("worker*.jsonl"))
    }


def launcher_lines(folder: Path) -> list[dict[str, Any]]:
    """The launcher's own events (``launcher.jsonl``: spawned, exited, hung, group-down ...)."""
    return read_lines(folder / LAUNCHER_LOG)


@dataclass
class JobSummary:
    """What the event files say about a run.

    Attributes:
        workers: number of worker processes that wrote events.
        final_step: the highest committed step any worker reached.
        faults: failed members, never a survivor that committed ("Counting faults" in the
            module docstring); one SIGKILL counts 1 however many survivors saw it.
        fault_reports: fault-detected events (one per survivor per failure).
        discarded_steps: step attempts discarded, counted on the worker that lost most.
        heals: state-received events.
        follows: replacements promoted by a follow (``Job(follow=True)``): healed while the
            survivors committed, nothing received at the epoch change.
        parity_mismatches: digest comparisons that found members apart.
        goodput: committed step time over worker lifetime, both summed over workers.
        final_digests: each finished worker's last digest.
        shard_ranks: each worker's rank in its replica group (from the launcher's log; empty
            without replica groups, where every worker holds the whole state).
    """

    workers: int = 0
    final_step: int = 0
    faults: int = 0
    fault_reports: int = 0
    discarded_steps: int = 0
    heals: int = 0
    follows: int = 0
    parity_mismatches: int = 0
    goodput: float = 0.0
    final_digests: dict[int, str] = field(default_factory=dict)
    shard_ranks: dict[int, int] = field(default_factory=dict)

    @property
    def final_digests_equal(self) -> bool:
        """Whether the finished workers holding the same shard ended on the same digest."""
        by_shard: dict[int, set[str]] = {}
        for wid, d in self.final_digests.items():
            by_shard.setdefault(self.shard_ranks.get(wid, 0), set()).add(d)
        return all(len(ds) == 1 for ds in by_shard.values())


def summarize(folder: Path) -> JobSummary:
    """Summarize the event files in ``folder`` (see the module docstring)."""
    events = read_events(folder)
    summary = JobSummary(workers=len(events))
    busy = alive = 0.0
    by_epoch: dict[Any, tuple[set[int], set[int]]] = {}  # epoch -> (reporters, members)
    epochs: dict[int, set[int]] = {}  # epoch -> its members, from the members' reconfigured
    for wid, lines in events.items():
        if not lines:
            continue
        alive += lines[-1]["t"] - lines[0]["t"]
        steps = [e for e in lines if e["kind"] == EventKind.STEP]
        busy += sum(e.get("dt", 0.0) for e in steps if e["committed"])
        summary.discarded_steps = max(
            summary.discarded_steps, sum(not e["committed"] for e in steps)
        )
        summary.final_step = max(
            [summary.final_step] + [e["step"] for e in steps if e["committed"]]
        )
        for e in lines:
            if e["kind"] == EventKind.RECONFIGURED and "members" in e:
                epochs[int(e["epoch"])] = set(e["members"])
            if e["kind"] == EventKind.FAULT_DETECTED:
                summary.fault_reports += 1
                reporters, members = by_epoch.setdefault(e.get("epoch"), (set(), set()))
                reporters.add(wid)
                members.update(e.get("members", ()))
        summary.heals += sum(e["kind"] == EventKind.STATE_RECEIVED for e in lines)
        summary.follows += sum(e["kind"] == EventKind.FOLLOW and e.get("role") == "follower"
                               and e.get("outcome") == "promoted" for e in lines)  # fmt: skip
        summary.parity_mismatches += sum(e["kind"] == EventKind.PARITY_MISMATCH for e in lines)
        finish = [e for e in lines if e["kind"] == EventKind.FINISH]
        if finish:
            summary.final_digests[wid] = finish[-1]["digest"]
    summary.faults = _failed_members(by_epoch, epochs, launcher_lines(folder))
    summary.goodput = busy / alive if alive > 0 else 0.0
    summary.shard_ranks = {
        int(e["wid"]): int(e["group_rank"])
        for e in launcher_lines(folder)
        if e["kind"] == EventKind.SPAWNED and "group_rank" in e
    }
    return summary


def _failed_members(by_epoch: dict[Any, tuple[set[int], set[int]]], epochs: dict[int, set[int]],
                    launcher: list[dict[str, Any]]) -> int:  # fmt: skip
    """How many members failed ("Counting faults" above)."""
    dead = {e["wid"] for e in launcher if e["kind"] == EventKind.EXITED and e["rc"] != 0
            and not e.get("stopped") and e.get("taken_down_by") is None}  # fmt: skip
    after = {n: min((k for k in epochs if n is not None and k > n), default=-1) for n in by_epoch}
    missing = {w for n, (_, m) in by_epoch.items() if after[n] >= 0
               for w in m - epochs[after[n]]}  # fmt: skip
    guessed = sum(max(1, len(m - r)) for n, (r, m) in by_epoch.items() if after[n] < 0)
    return len(dead | missing) if launcher else len(missing) + guessed
