"""Fleet logs: a folder of runs read into one table, a row per worker incarnation, and analysed
once per kind of fault (``analyze_fleet``; ``stalwart rca FOLDER``).

    FOLDER/<run>/members.jsonl  {"schema": 1, "run", "worker", "incarnation", "steps", "host"}
    FOLDER/<run>/faults.jsonl   {"schema": 1, "run", "worker", "incarnation", "step", "kind",
                                 "decided_by", "tensor", "host"}
    FOLDER/<run>/run.json       optional: {"schema": 1, "run", "attributes"}

docs/diagnose.md ("Fleet logs") is the specification; ``stalwart run`` writes these rows and
``stalwart.testing.simulate_fleet`` simulates a fleet in them. A row is read strictly: a wrong
type, a missing field, a kind or schema this version does not know is a ``ConfigError`` naming
the file and line (``skip_bad_lines`` skips such rows instead and counts them); fields this
version does not know are ignored, so a later writer may add some within one schema version.

The table holds ``run``, ``worker``, ``incarnation`` and ``steps`` (never analysed), one boolean
column per fault kind (the incarnation had at least one fault of that kind), and the attributes:
the host's (``stalwart.environment.host_attributes``, plus site attributes such as ``rack``) and
the run's. Site attributes nest, coarsest first (``SITE_LEVELS``): the analysis declares those
present one hierarchy and keeps them from being dropped as ID-like, so a bad host is reported as
the host, not as its rack, and a bad rack as the rack, not as one of its hosts.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa

from stalwart.diagnose.analyze import analyze
from stalwart.diagnose.options import DiagnoseOptions
from stalwart.diagnose.result import Diagnosis, FleetDiagnosis
from stalwart.errors import ConfigError

__all__ = [
    "FLEET_SCHEMA",
    "SITE_LEVELS",
    "FaultKind",
    "FleetLog",
    "analyze_fleet",
    "fleet_runs",
    "read_fleet",
]

FLEET_SCHEMA = 1
"""The version of the rows this module reads and ``simulate_fleet`` writes."""
MEMBERS, FAULTS, RUN = "members.jsonl", "faults.jsonl", "run.json"
SITE_LEVELS = ("zone", "rack", "hostname", "device_uuid")
"""Host attributes that nest, coarsest first: one hierarchy of the analysis, never ID-like."""
_IDENTITY = ("run", "worker", "incarnation", "steps")
T = TypeVar("T")


class FaultKind(StrEnum):
    """The kinds of fault a row records (``kind``), one analysis each."""

    CRASH = "crash"
    HANG = "hang"
    STRAGGLER = "straggler"
    SDC_SUSPECT = "sdc_suspect"


@dataclass(frozen=True)
class FleetLog:
    """A fleet folder as the table the analysis mines."""

    table: pa.Table
    """One row per worker incarnation: identity, a boolean per fault kind, the attributes."""
    attributes: tuple[str, ...]
    """The attribute columns: the hosts' and the runs'."""
    runs: int
    faults: dict[str, int]
    """Faults per kind (rows of faults.jsonl; an incarnation may hold several)."""
    notes: tuple[str, ...] = ()


def fleet_runs(path: str | Path) -> list[Path] | None:
    """The run folders of ``path``: itself when it holds ``members.jsonl``, else its subfolders
    that do (sorted). None when ``path`` is not a local folder, or is a folder of Parquet files
    (another input of ``analyze``); an empty list when it is a folder with no runs."""
    if not isinstance(path, (str, Path)) or not Path(path).is_dir():
        return None
    folder = Path(path)
    if (folder / MEMBERS).is_file():
        return [folder]
    runs = sorted(p.parent for p in folder.glob(f"*/{MEMBERS}") if p.is_file())
    if not runs and any(p.suffix in (".parquet", ".pq", ".parq") for p in folder.rglob("*")):
        return None  # a folder of Parquet files (hive partitions too): another input
    return runs


def read_fleet(folder: str | Path, *, skip_bad_lines: bool = False) -> FleetLog:
    """Read a fleet folder (module docstring) into one table, a row per worker incarnation.

    Raises:
        ConfigError: no runs in ``folder``; a malformed row, an unknown schema version or kind
            (file and line named; ``skip_bad_lines`` skips malformed rows and says how many).
    """
    runs = fleet_runs(folder)
    if not runs:
        raise ConfigError(
            f"{folder}: no runs to analyse: a fleet folder holds one folder per run, each with "
            f"a {MEMBERS} (and a {FAULTS}) as docs/diagnose.md 'Fleet logs' specifies; "
            "`stalwart run` writes them. To analyse one log file, pass the file or a glob"
        )
    reader = _Reader(skip_bad_lines)
    for run in runs:
        reader.read_run(run)
    return reader.log(len(runs))


class _Reader:
    """Rows of every run, keyed by incarnation, and the faults they hold."""

    def __init__(self, skip_bad_lines: bool) -> None:
        self.skip = skip_bad_lines
        self.skipped = 0
        self.members: dict[tuple[str, str, int], dict[str, Any]] = {}
        self.faults = {k.value: 0 for k in FaultKind}
        self.orphans = 0

    def read_run(self, folder: Path) -> None:
        attrs = self._run_attributes(folder / RUN)
        for where, (key, steps, host) in self._records(folder / MEMBERS, _member_fields):
            if key in self.members:
                raise ConfigError(
                    f"{where}: incarnation {key[2]} of worker {key[1]} of run {key[0]} is listed "
                    "twice; one row per worker incarnation"
                )
            self.members[key] = _member(key, steps, host, attrs, where)
        if not (folder / FAULTS).is_file():
            return
        for where, (key, kind, host) in self._records(folder / FAULTS, _fault_fields):
            if key not in self.members:  # its member row was never written (a lost launcher)
                self.orphans += 1
                self.members[key] = _member(key, 0, host, attrs, where)
            self.members[key][kind] = True
            self.faults[kind] += 1

    def _records(
        self, path: Path, parse: Callable[[dict[str, Any], str], T]
    ) -> Iterator[tuple[str, T]]:
        """(``file:line``, ``parse(row)``) for each row of a JSON-lines file; blank lines are
        skipped, and so are malformed rows with ``skip_bad_lines`` (never a row of another
        schema version: nothing in it is known to be readable)."""
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: cannot read it ({e}); check the file") from e
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                row = json.loads(line)
                error = "" if isinstance(row, dict) else f"not a JSON object: {line[:60]!r}"
            except ValueError as e:
                row, error = None, f"not valid JSON ({e})"
            if not error:
                _schema(row, where)
            try:
                if error:
                    raise ConfigError(
                        f"{where}: {error}; a row is one JSON object on one line: fix the row, "
                        "or pass skip_bad_lines to skip malformed rows"
                    )
                record = parse(row, where)
            except ConfigError:
                if not self.skip:
                    raise
                self.skipped += 1
                continue
            yield where, record

    def _run_attributes(self, path: Path) -> dict[str, str]:
        if not path.is_file():
            return {}
        try:
            row = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: not a JSON object ({e}); fix or remove it") from e
        if not isinstance(row, dict):
            raise ConfigError(f"{path}: must be a JSON object with 'schema' and 'attributes'")
        _schema(row, str(path))
        return _attributes(row.get("attributes", {}), f"{path}: 'attributes'")

    def log(self, runs: int) -> FleetLog:
        notes = []
        if self.skipped:
            notes.append(f"skipped {self.skipped} malformed row(s) (skip_bad_lines)")
        if self.orphans:
            notes.append(
                f"{self.orphans} fault(s) name an incarnation without a row in {MEMBERS}: "
                "counted with their own host attributes and 0 steps"
            )
        rows = list(self.members.values())
        attrs = sorted({k for r in rows for k in r} - set(_IDENTITY) - set(self.faults))
        columns: dict[str, pa.Array] = {
            "run": pa.array([r["run"] for r in rows], pa.string()),
            "worker": pa.array([r["worker"] for r in rows], pa.string()),
            "incarnation": pa.array([r["incarnation"] for r in rows], pa.int64()),
            "steps": pa.array([r["steps"] for r in rows], pa.int64()),
        }
        for kind in self.faults:
            columns[kind] = pa.array([bool(r.get(kind)) for r in rows], pa.bool_())
        for a in attrs:
            columns[a] = pa.array([r.get(a) for r in rows], pa.string())
        return FleetLog(pa.table(columns), tuple(attrs), runs, dict(self.faults), tuple(notes))


def _member_fields(
    row: dict[str, Any], where: str
) -> tuple[tuple[str, str, int], int, dict[str, str]]:
    """A members.jsonl row's incarnation, steps served and host attributes."""
    return _key(row, where), _integer(row, "steps", where), _host(row, where)


def _fault_fields(
    row: dict[str, Any], where: str
) -> tuple[tuple[str, str, int], str, dict[str, str]]:
    """A faults.jsonl row's incarnation, kind and host attributes (the rest checked)."""
    kind = row.get("kind")
    if kind not in FaultKind.__members__.values():
        raise ConfigError(
            f"{where}: kind {kind!r} is not a fault kind; use one of {', '.join(FaultKind)}"
        )
    _integer(row, "step", where)
    _text(row, "decided_by", where)
    if row.get("tensor") is not None:
        _text(row, "tensor", where)
    return _key(row, where), str(kind), _host(row, where)


def _schema(row: dict[str, Any], where: str) -> None:
    version = row.get("schema")
    if version == FLEET_SCHEMA:
        return
    if isinstance(version, int) and not isinstance(version, bool) and version > FLEET_SCHEMA:
        raise ConfigError(
            f"{where}: schema {version} is newer than this stalwart reads ({FLEET_SCHEMA}); "
            "upgrade stalwart to analyse these runs"
        )
    raise ConfigError(
        f"{where}: schema {version!r} is not a fleet-log schema this stalwart knows "
        f'({FLEET_SCHEMA}); every row needs "schema": {FLEET_SCHEMA}'
    )


def _key(row: dict[str, Any], where: str) -> tuple[str, str, int]:
    run = _text(row, "run", where)
    worker = row.get("worker")
    if isinstance(worker, bool) or not isinstance(worker, (str, int)) or worker == "":
        raise ConfigError(f"{where}: 'worker' must be a name or a number, found {worker!r}")
    return run, str(worker), _integer(row, "incarnation", where)


def _text(row: dict[str, Any], name: str, where: str) -> str:
    value = row.get(name)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: {name!r} must be non-empty text, found {value!r}")
    return value


def _integer(row: dict[str, Any], name: str, where: str) -> int:
    value = row.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where}: {name!r} must be an integer >= 0, found {value!r}")
    return value


def _host(row: dict[str, Any], where: str) -> dict[str, str]:
    return _attributes(row.get("host"), f"{where}: 'host'")


def _attributes(value: Any, what: str) -> dict[str, str]:
    """An object of attribute name -> scalar, as text (JSON null: an empty value)."""
    if not isinstance(value, dict):
        raise ConfigError(f"{what} must be an object of attribute names and values")
    out = {}
    for k, v in value.items():
        if k in _IDENTITY or k in FaultKind.__members__.values():
            raise ConfigError(f"{what}: attribute {k!r} shadows a column of the fleet table")
        if isinstance(v, (dict, list)):
            raise ConfigError(f"{what}: attribute {k!r} must be text or a number, not {v!r}")
        out[str(k)] = "" if v is None else str(v)
    return out


def _member(
    key: tuple[str, str, int],
    steps: int,
    host: dict[str, str],
    run_attrs: dict[str, str],
    where: str,
) -> dict[str, Any]:
    clash = sorted(set(host) & set(run_attrs))
    if clash:
        raise ConfigError(
            f"{where}: {', '.join(clash)} is both a host attribute and a run attribute "
            f"({RUN}); rename one of them"
        )
    run, worker, incarnation = key
    return {
        "run": run,
        "worker": worker,
        "incarnation": incarnation,
        "steps": steps,
        **host,
        **run_attrs,
    }


def analyze_fleet(
    folder: str | Path,
    *,
    kinds: Sequence[str] | None = None,
    columns: Sequence[str] | None = None,
    options: DiagnoseOptions | None = None,
    skip_bad_lines: bool = False,
) -> FleetDiagnosis:
    """Which attribute values (hosts, devices, software versions, run settings) single out each
    kind of fault across a folder of runs.

    Args:
        folder: a fleet folder (module docstring), or one run's folder.
        kinds: the fault kinds to analyse (``FaultKind`` values); all of them when omitted.
        columns: the attributes to analyse; every host and run attribute when omitted.
        options: as for ``analyze``; the site attributes present (``SITE_LEVELS``) are added to
            ``keep``; unless set, ``hierarchies`` are the site's and each host-level attribute
            under the hostname (``_hierarchies``), and ``rank_by`` is ``"likelihood"``.
        skip_bad_lines: skip malformed rows (and say how many) instead of failing.

    Returns:
        A ``FleetDiagnosis``: one ``Diagnosis`` per kind over the worker incarnations (a kind
        without faults gets an empty one saying so).
    """
    start = time.perf_counter()
    wanted = list(kinds) if kinds is not None else [k.value for k in FaultKind]
    for k in wanted:
        if k not in FaultKind.__members__.values():
            raise ConfigError(f"fault kind {k!r}: use one of {', '.join(FaultKind)}")
    log = read_fleet(folder, skip_bad_lines=skip_bad_lines)
    opts = _fleet_options(options or DiagnoseOptions(), log)
    by_kind: dict[str, Diagnosis] = {}
    for kind in wanted:
        if log.faults[kind] == 0:
            none = f"no {kind} faults in these runs: nothing to explain"
            rows = float(log.table.num_rows)
            by_kind[kind] = Diagnosis([], "events", 0.0, rows, 0, log.attributes, message=none)
        else:
            by_kind[kind] = analyze(
                log.table, kind, columns=columns or log.attributes, options=opts
            )
    return FleetDiagnosis(
        by_kind,
        runs=log.runs,
        members=log.table.num_rows,
        faults=log.faults,
        columns=log.attributes,
        notes=list(log.notes),
        timings_s={"total": round(time.perf_counter() - start, 4)},
    )


def _fleet_options(opts: DiagnoseOptions, log: FleetLog) -> DiagnoseOptions:
    """``opts`` with the site attributes kept and, unless hierarchies are set, declared."""
    site = tuple(a for a in SITE_LEVELS if a in log.attributes)
    keep = opts.keep + tuple(a for a in site if a not in opts.keep)
    hierarchies = opts.hierarchies or _hierarchies(log.table, log.attributes)
    rank_by = opts.rank_by or "likelihood"
    return dataclasses.replace(opts, keep=keep, hierarchies=hierarchies, rank_by=rank_by)


def _hierarchies(table: pa.Table, attributes: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """The site attributes present as one chain, coarsest first, and under the hostname (or the
    device) every attribute one host (one device) always has one value of: a CPU model, a
    kernel, a driver. A coarse value is then reported only when its hosts do not explain it."""
    site = tuple(a for a in SITE_LEVELS if a in attributes)
    out = [site] if len(site) >= 2 else []
    placed = set(SITE_LEVELS)
    for level in ("hostname", "device_uuid"):
        if level not in attributes:
            continue
        n = _distinct(table, level)
        for a in attributes:
            if a not in placed and _distinct(table, a) < n == _distinct(table, level, a):
                out.append((a, level))
                placed.add(a)
    return tuple(out)


def _distinct(table: pa.Table, *columns: str) -> int:
    return table.group_by(list(columns)).aggregate([]).num_rows
