"""Recovery breakdown: for each worker that died, how long the job took to notice and go on.

The launcher logs ``spawned`` (``wid``, ``replaces``) and ``exited`` (``wid``, ``rc``) lines in
``<events>/launcher.jsonl``; the workers' own event files (:mod:`stalwart.elastic.events`)
give the rest. Times are wall-clock seconds from the dead worker's last event line, its last
sign of life: at most one step before a crash, the moment a hung worker froze (the launcher
kills a hung worker only once the others gave up on it, so its reaping comes late).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalwart.elastic.events import LAUNCHER_LOG, EventKind, launcher_lines, read_events

__all__ = ["LAUNCHER_LOG", "Recovery", "digest_divergences", "recoveries"]


@dataclass(frozen=True)
class Recovery:
    """One worker's death and what followed.

    Attributes:
        worker: the dead worker's id.
        exit_code: its exit status (negative: killed by that signal).
        detect_s: last sign of life → the first survivor's ``fault-detected`` (None: none).
        resume_s: last sign of life → the first step a survivor committed without it.
        reaped_s: last sign of life → the launcher saw the process exit.
        lost_steps: step attempts the survivors discarded for it (most on one survivor), or
            the committed steps lost when every holder died and the job resumed from a tier.
        replacement: the replacement's worker id (None: not replaced).
        rejoin_s: the replacement's launch → its first committed step (None: never committed).
    """

    worker: int
    exit_code: int
    detect_s: float | None
    resume_s: float | None
    reaped_s: float
    lost_steps: int
    replacement: int | None
    rejoin_s: float | None


def _first_after(lines: list[dict[str, Any]], t: float, pred: Any) -> float | None:
    times = [e["t"] for e in lines if e["t"] >= t and pred(e)]
    return min(times) if times else None


def _discarded(e: dict[str, Any]) -> bool:
    return e["kind"] == EventKind.STEP and not e["committed"]


def _recovery(death: dict[str, Any], events: dict[int, list[dict[str, Any]]],
              spawned: dict[int, dict[str, Any]]) -> Recovery:  # fmt: skip
    wid, reaped = int(death["wid"]), float(death["t"])
    own = events.get(wid) or []
    t0 = own[-1]["t"] if own else reaped
    slack = t0

    def resumed(e: dict[str, Any]) -> bool:
        return e["kind"] == EventKind.STEP and e["committed"] and wid not in e["members"]

    def detected(e: dict[str, Any]) -> bool:
        return e["kind"] == EventKind.FAULT_DETECTED

    others = [lines for w, lines in events.items() if w != wid]
    detect = min((t for ls in others if (t := _first_after(ls, slack, detected))), default=None)
    resume = min((t for ls in others if (t := _first_after(ls, slack, resumed))), default=None)
    end = resume if resume is not None else float("inf")
    lost = max(
        (sum(_discarded(e) and slack <= e["t"] <= end for e in ls) for ls in others),
        default=0,
    )  # fmt: skip
    # every holder died: the job resumed from a checkpoint tier (``resumed``, ladder.py); the
    # steps it lost are the committed steps past the step it resumed
    resumed_from = [e.get("steps_lost") or 0 for ls in others for e in ls
                    if e["kind"] == EventKind.RESUMED and e["t"] >= slack]  # fmt: skip
    lost = max([lost, *resumed_from])
    new = next((w for w, s in spawned.items() if s.get("replaces") == wid), None)
    first = None
    if new is not None and new in events:
        first = _first_after(
            events[new], 0, lambda e: e["kind"] == EventKind.STEP and e["committed"]
        )
    return Recovery(
        worker=wid,
        exit_code=int(death["rc"]),
        detect_s=None if detect is None else max(0.0, detect - t0),
        resume_s=None if resume is None else max(0.0, resume - t0),
        reaped_s=reaped - t0,
        lost_steps=int(lost),
        replacement=new,
        rejoin_s=None if first is None or new is None else first - spawned[new]["t"],
    )


def recoveries(folder: Path) -> list[Recovery]:
    """Every abnormal worker exit in ``folder``'s logs, with its recovery times.

    A joiner the launcher stopped because the job had finished is not a failure, nor a worker
    killed with its replica group (``taken_down_by``: the group's death is its first worker's).
    """
    launcher = launcher_lines(folder)
    events = read_events(folder)
    spawned = {int(e["wid"]): e for e in launcher if e["kind"] == EventKind.SPAWNED}
    deaths = [
        e
        for e in launcher
        if e["kind"] == EventKind.EXITED
        and e["rc"] != 0
        and not e.get("stopped")
        and e.get("taken_down_by") is None
    ]
    return [_recovery(d, events, spawned) for d in deaths]


def digest_divergences(folder: Path) -> tuple[int, int]:
    """``(divergences, verified steps)`` in ``folder``'s event files, per shard.

    Workers holding the same shard (every worker without replica groups; rank ``i`` of every
    group with them, from the launcher's ``spawned`` lines) must log the same digest at every
    verified step and finish on the same one. A divergence is a (step, shard) with two
    digests, or a shard whose finished workers' final digests differ.
    """
    shard = {
        int(e["wid"]): int(e.get("group_rank", 0))
        for e in launcher_lines(folder)
        if e["kind"] == EventKind.SPAWNED
    }
    digests: dict[tuple[int, int], set[str]] = {}
    finals: dict[int, set[str]] = {}
    for wid, lines in read_events(folder).items():
        for e in lines:
            if e["kind"] == EventKind.STEP and e.get("digest"):
                digests.setdefault((e["step"], shard.get(wid, 0)), set()).add(e["digest"])
            elif e["kind"] == EventKind.FINISH:
                finals.setdefault(shard.get(wid, 0), set()).add(e["digest"])
    bad = sum(len(d) > 1 for d in digests.values()) + sum(len(d) > 1 for d in finals.values())
    return bad, len({step for step, _ in digests})
