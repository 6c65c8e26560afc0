"""Per-worker JSON-lines event files, and the job summary computed from them.

Every member appends one line per step attempt and one per event::

    {"t": wall time, "wid": id, "kind": "step", "step": committed steps after it,
     "committed": bool, "epoch": n, "members": [...], "dt": seconds the attempt took,
     "digest": hex (when one was computed at this step)}
    {"t": ..., "wid": ..., "kind": "fault-detected" | "reconfigured" | "state-received"
     | "first-commit-after-change" | "parity-mismatch" | "start" | "finish", ...}

:func:`summarize` reads a folder of them (``worker<id>.jsonl``) and returns a
:class:`JobSummary`: steps reached, faults seen, step attempts discarded, heals, parity
mismatches, and goodput: committed step time summed over workers divided by the workers'
lifetimes (first to last line) summed.

**Counting faults.** Every survivor of a failure writes its own ``fault-detected`` (a survivor
cannot tell who died: gloo reports a closed connection), so one SIGKILL among three members
gives two reports. A fault counts once per failed member: the reports of one epoch are one
collective's failure, and its failed members are the epoch's members (listed in each report)
that reported nothing. The raw count stays in ``fault_reports``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

__all__ = ["EventLog", "JobSummary", "read_events", "summarize"]


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

    def write(self, kind: str, **fields: Any) -> None:
        """Append one line (flushed: a SIGKILL loses nothing written before it)."""
        if self._file is not None:
            line = {"t": time.time(), "wid": self.wid, "kind": kind, **fields}
            self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self) -> None:
        """Close the file."""
        if self._file is not None:
            self._file.close()
            self._file = None


def read_events(folder: Path) -> dict[int, list[dict[str, Any]]]:
    """Every worker's events by worker id; a torn last line (a killed writer) is skipped."""
    out: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(folder.glob("worker*.jsonl")):
        lines = []
        for raw in path.read_text().splitlines():
            try:
                lines.append(json.loads(raw))
            except json.JSONDecodeError:
                continue
        out[int(path.stem.removeprefix("worker"))] = lines
    return out


@dataclass
class JobSummary:
    """What the event files say about a run.

    Attributes:
        workers: number of worker processes that wrote events.
        final_step: the highest committed step any worker reached.
        faults: failed members: fault-detected reports deduplicated by epoch and member
            (module docstring); one SIGKILL counts 1 however many survivors saw it.
        fault_reports: fault-detected events (one per survivor per failure).
        discarded_steps: step attempts discarded, counted on the worker that lost most.
        heals: state-received events.
        parity_mismatches: digest comparisons that found members apart.
        goodput: committed step time over worker lifetime, both summed over workers.
        final_digests: each finished worker's last digest.
    """

    workers: int = 0
    final_step: int = 0
    faults: int = 0
    fault_reports: int = 0
    discarded_steps: int = 0
    heals: int = 0
    parity_mismatches: int = 0
    goodput: float = 0.0
    final_digests: dict[int, str] = field(default_factory=dict)


def summarize(folder: Path) -> JobSummary:
    """Summarize the event files in ``folder`` (see the module docstring)."""
    events = read_events(folder)
    s = JobSummary(workers=len(events))
    busy = alive = 0.0
    by_epoch: dict[Any, tuple[set[int], set[int]]] = {}  # epoch -> (reporters, members)
    for wid, lines in events.items():
        if not lines:
            continue
        alive += lines[-1]["t"] - lines[0]["t"]
        steps = [e for e in lines if e["kind"] == "step"]
        busy += sum(e.get("dt", 0.0) for e in steps if e["committed"])
        s.discarded_steps = max(s.discarded_steps, sum(not e["committed"] for e in steps))
        s.final_step = max([s.final_step] + [e["step"] for e in steps if e["committed"]])
        for e in lines:
            if e["kind"] == "fault-detected":
                s.fault_reports += 1
                reporters, members = by_epoch.setdefault(e.get("epoch"), (set(), set()))
                reporters.add(wid)
                members.update(e.get("members", ()))
        s.heals += sum(e["kind"] == "state-received" for e in lines)
        s.parity_mismatches += sum(e["kind"] == "parity-mismatch" for e in lines)
        finish = [e for e in lines if e["kind"] == "finish"]
        if finish:
            s.final_digests[wid] = finish[-1]["digest"]
    s.faults = sum(max(1, len(members - reporters)) for reporters, members in by_epoch.values())
    s.goodput = busy / alive if alive > 0 else 0.0
    return s
