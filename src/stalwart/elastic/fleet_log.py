"""A finished run's events folder, written as fleet-log rows for ``stalwart rca``.

:func:`write_fleet_log` reads the workers' logs (``worker<wid>.jsonl``: their ``start`` line
with the host attributes, committed steps, ``sdc-suspect``) and the launcher's
(``launcher.jsonl``: ``spawned``, ``exited``, ``hung``, ``straggler``) and writes, next to
them or in another folder, ``members.jsonl`` (one row per worker incarnation) and
``faults.jsonl`` (one row per fault) in the schema of docs/diagnose.md, "Fleet logs"
(:mod:`stalwart.diagnose.fleet` reads them). A folder of such runs is what ``stalwart rca
FOLDER`` takes.

* Identity: a replacement is a fresh worker id whose ``spawned`` line names the id it
  ``replaces``; the chain's first id is the row's ``worker`` and its depth the
  ``incarnation`` (0: the first process).
* ``steps``: the steps the incarnation committed (recomputed steps after a rollback count).
* ``crash``: an ``exited`` line with a non-zero code, unless the launcher stopped it, took it
  down with its replica group, or had taken it for hung (``decided_by``: ``exit-signal`` for
  a signal, ``exit-code`` otherwise), at the last step it committed.
* ``hang``: a ``hung`` line (``heartbeat-timeout``). ``straggler``: a ``straggler`` line
  (``step-time-outlier``, at the step of its window).
* ``sdc_suspect``: one row per (step, suspect) however many members wrote it, ``decided_by``
  ``parity-<rule>`` (``parity-majority``, ``parity-rollback``, and the in-reduction
  ``parity-nonfinite-count``, ``parity-grad-norm``), the tensor it names. A worker the
  exclusion policy removed (``exited`` with ``excluded``) is one more ``sdc_suspect`` row,
  ``decided_by: "excluded"``, at the step of its last verdict, not a crash.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalwart.elastic.events import EventKind, launcher_lines, read_events
from stalwart.errors import ConfigError

__all__ = ["FLEET_SCHEMA", "FleetRows", "fleet_rows", "write_fleet_log"]

FLEET_SCHEMA = 1  # stalwart.diagnose.fleet.FLEET_SCHEMA (diagnose sits beside elastic)
MEMBERS, FAULTS, RUN = "members.jsonl", "faults.jsonl", "run.json"


@dataclass(frozen=True)
class FleetRows:
    """The rows of one run: ``members`` (one per incarnation) and ``faults``."""

    members: list[dict[str, Any]]
    faults: list[dict[str, Any]]


class _Run:
    """What the rows need from one events folder."""

    def __init__(self, events: Path) -> None:
        self.workers = read_events(events)
        self.launcher = launcher_lines(events)
        replaces: dict[int, Any] = {
            int(e["wid"]): e.get("replaces") for e in self._of(EventKind.SPAWNED)
        }
        self.ids = sorted(set(self.workers) | set(replaces))
        self.identity: dict[int, tuple[int, int]] = {}
        for wid in self.ids:
            root, depth, seen = wid, 0, {wid}
            while replaces.get(root) is not None and int(replaces[root]) not in seen:
                root, depth = int(replaces[root]), depth + 1
                seen.add(root)
            self.identity[wid] = (root, depth)

    def _of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.launcher if e.get("kind") == kind]

    def host(self, wid: int) -> dict[str, str]:
        starts = [e for e in self.workers.get(wid, []) if e.get("kind") == EventKind.START]
        host = starts[0].get("host") if starts else None
        return {str(k): str(v) for k, v in (host or {}).items()}

    def steps(self, wid: int) -> list[int]:
        return [
            int(e["step"]) for e in self.workers.get(wid, []) if e.get("kind") == EventKind.STEP
        ]

    def row(self, run: str, wid: int, **fields: Any) -> dict[str, Any]:
        worker, incarnation = self.identity.get(wid, (wid, 0))
        return {"schema": FLEET_SCHEMA, "run": run, "worker": worker,
                "incarnation": incarnation, **fields, "host": self.host(wid)}  # fmt: skip

    def fault(self, run: str, wid: int, step: int, kind: str, how: str,
              tensor: str | None = None) -> dict[str, Any]:  # fmt: skip
        return self.row(run, wid, step=max(step, 0), kind=kind, decided_by=how, tensor=tensor)

    def last_step(self, wid: int) -> int:
        return max(self.steps(wid), default=0)

    def last_verdict(self, wid: int) -> int:
        """The step of the last ``sdc-suspect`` naming ``wid`` in its own log (else its last)."""
        named = [int(e["step"]) for e in self.workers.get(wid, [])
                 if e.get("kind") == EventKind.SDC_SUSPECT and e.get("suspect") == wid]  # fmt: skip
        return max(named, default=self.last_step(wid))

    def faults(self, run: str) -> list[dict[str, Any]]:
        out = []
        hung = {int(e["wid"]) for e in self._of(EventKind.HUNG)}
        for e in self._of(EventKind.EXITED):
            wid, rc = int(e["wid"]), int(e.get("rc") or 0)
            if e.get("excluded"):  # the exclusion policy removed it: not a crash
                out.append(self.fault(run, wid, self.last_verdict(wid), "sdc_suspect", "excluded"))
                continue
            if rc == 0 or e.get("stopped") or "taken_down_by" in e or wid in hung:
                continue
            how = "exit-signal" if rc < 0 else "exit-code"
            out.append(self.fault(run, wid, self.last_step(wid), "crash", how))
        for e in self._of(EventKind.HUNG):
            wid = int(e["wid"])
            out.append(self.fault(run, wid, self.last_step(wid), "hang", "heartbeat-timeout"))
        for e in self._of(EventKind.STRAGGLER):
            wid = int(e["wid"])
            step = int(e.get("step") or self.last_step(wid))
            out.append(self.fault(run, wid, step, "straggler", "step-time-outlier"))
        seen: set[tuple[int, int]] = set()
        for wid in self.ids:
            for e in self.workers.get(wid, []):
                if e.get("kind") != EventKind.SDC_SUSPECT:
                    continue
                key = (int(e["step"]), int(e["suspect"]))
                if key not in seen:
                    seen.add(key)
                    how = f"parity-{e['decided_by']}"
                    out.append(self.fault(run, key[1], key[0], "sdc_suspect", how, e.get("tensor")))
        return out


def fleet_rows(events: str | Path, run: str | None = None) -> FleetRows:
    """The fleet-log rows of the run whose events are in ``events`` (module docstring).

    Args:
        events: the run's events folder (``stalwart run --events``).
        run: the run id in every row (default: the folder's name).

    Raises:
        ConfigError: the folder holds no worker or launcher log.
    """
    folder = Path(events)
    if not list(folder.glob("worker*.jsonl")) and not (folder / "launcher.jsonl").exists():
        raise ConfigError(
            f"{folder} holds no worker*.jsonl or launcher.jsonl: give the folder that "
            "`stalwart run --events` wrote"
        )
    r = _Run(folder)
    name = run or folder.resolve().name
    members = [r.row(name, wid, steps=len(r.steps(wid))) for wid in r.ids]
    return FleetRows(members, r.faults(name))


def write_fleet_log(events: str | Path, out: str | Path | None = None, *, run: str | None = None,
                    attributes: dict[str, str] | None = None) -> FleetRows:  # fmt: skip
    """Write ``members.jsonl``, ``faults.jsonl`` (and ``run.json`` with ``attributes``).

    Args:
        events: the run's events folder.
        out: where to write (default: ``events`` itself, so that a folder of runs' events
            folders is a fleet folder for ``stalwart rca``).
        run: the run id (default: the name of the folder written to).
        attributes: run attributes (text) shared by every member: the job, the image...

    Returns:
        The rows written.
    """
    folder = Path(out) if out is not None else Path(events)
    rows = fleet_rows(events, run or folder.resolve().name)
    folder.mkdir(parents=True, exist_ok=True)
    for name, lines in ((MEMBERS, rows.members), (FAULTS, rows.faults)):
        text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in lines)
        (folder / name).write_text(text, encoding="utf-8")
    if attributes is not None:
        run_id = rows.members[0]["run"] if rows.members else (run or Path(events).name)
        doc = {"schema": FLEET_SCHEMA, "run": run_id,
               "attributes": {k: str(v) for k, v in attributes.items()}}  # fmt: skip
        (folder / RUN).write_text(json.dumps(doc, sort_keys=True) + "\n", encoding="utf-8")
    return rows
