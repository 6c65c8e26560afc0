"""``launch``: start the coordinator and N workers (or N / G replica groups), report the run.

The loop that spawns, reaps, replaces and publishes epochs is the :class:`Supervisor`
(:mod:`stalwart.elastic.supervisor`: groups as the unit of failure, hung workers, stragglers,
coordinator loss); with ``--rdzv`` the other nodes' launchers run as agents
(:mod:`stalwart.elastic.nodes`). The timeouts derive from ``timeout_s``
(:mod:`stalwart.elastic.timeouts`).

Exit code: 0 when every member of the final epoch exited cleanly; 3
(:data:`~stalwart.elastic.supervisor.EXIT_FATAL`) when a worker reported a fatal error (the
job had committed steps and nothing can resume them: no checkpoint attached, or none
verifies), at once, or when excluded workers (``exclude_suspect_after``) left fewer than
``min_size`` replica groups; ``128 + N`` when signal N (SIGTERM, SIGINT) stopped the launcher,
host or agent node, after its workers got it too (:mod:`stalwart.elastic.stopping`); 1
otherwise (all workers died, restarts ran out with fewer than ``min_size`` replica groups
left, or a member of the final epoch failed).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.elastic.events import JobSummary, summarize
from stalwart.elastic.fleet_log import write_fleet_log
from stalwart.elastic.nodes import parse_nnodes, rendezvous, run_agent
from stalwart.elastic.protocol import ENV_EVENTS, ENV_HANG, ENV_TIMEOUT
from stalwart.elastic.recovery import Recovery, recoveries
from stalwart.elastic.roster import Roster
from stalwart.elastic.sdc import write_policy
from stalwart.elastic.stopping import run_with_signals
from stalwart.elastic.supervisor import Supervisor
from stalwart.elastic.timeouts import Timeouts
from stalwart.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["LaunchResult", "launch"]


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
        fatal: the error a worker reported as fatal (the job stopped at once, exit code
            :data:`~stalwart.elastic.supervisor.EXIT_FATAL`), else None.
        excluded: the workers the exclusion policy removed (not replaced).
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
    fatal: str | None = None
    excluded: list[int] = field(default_factory=list)


def _agent(cmd: list[str], nproc: int, max_restarts: int, env: dict[str, str], store: Any,
           stdout: int | None, rdzv: str, folder: Path) -> LaunchResult:  # fmt: skip
    t0, stops = time.monotonic(), list[int]()
    code, n = run_with_signals(
        lambda: run_agent(cmd, nproc, max_restarts, env, store, stdout, rdzv, folder, stops),
        stops,
    )
    return LaunchResult(code, n, time.monotonic() - t0, folder, summarize(folder),
                        recoveries(folder), hung={}, stragglers=[])  # fmt: skip


def _prepare(events_dir: str | os.PathLike[str] | None, env: Mapping[str, str] | None,
             timeout_s: float, hang_s: float | None) -> tuple[Path, dict[str, str]]:  # fmt: skip
    """The events folder (made) and the workers' environment (the timeouts derived)."""
    timeouts = Timeouts(timeout_s=timeout_s, hang_override_s=hang_s)
    folder = Path(events_dir) if events_dir else Path(tempfile.mkdtemp(prefix="stalwart-run-"))
    folder.mkdir(parents=True, exist_ok=True)
    worker_env = dict(os.environ if env is None else env)
    worker_env.update({ENV_EVENTS: str(folder), ENV_TIMEOUT: str(timeouts.timeout_s),
                       ENV_HANG: str(timeouts.hang_s)})  # fmt: skip
    return folder, worker_env


def _check_sizes(nproc: int, min_size: int, max_restarts: int, group_size: int,
                 max_nodes: int, rdzv: str | None, exclude_after: int = 0) -> None:  # fmt: skip
    """Refuse sizes :func:`launch` cannot run (ConfigError, saying what to change)."""
    if exclude_after < 0 or (exclude_after and rdzv is not None):
        raise ConfigError(
            f"exclude_suspect_after={exclude_after}: use 0 (off) or N >= 1, on one node (the "
            "agents of --rdzv nodes would replace an excluded worker: not supported yet)"
        )
    Roster(max(nproc, 1), group_size)  # refuses a group size that does not divide nproc
    if nproc < 1 or max_restarts < 0:
        raise ConfigError(
            f"launch(nproc={nproc}, max_restarts={max_restarts}): need nproc >= 1 and "
            "max_restarts >= 0"
        )
    most = nproc // group_size * max_nodes  # replica groups the job holds at its largest
    if not 1 <= min_size <= most:
        nodes = f" on each of up to {max_nodes} nodes" if max_nodes > 1 else ""
        raise ConfigError(
            f"min_size={min_size} (--min-size): {nproc} workers{nodes} in groups of "
            f"{group_size} make at most {most} replica groups; pass a min_size from 1 to "
            f"{most}, or start more workers (--nproc, or --nnodes MIN:MAX with --rdzv)"
        )
    if max_nodes > 1 and rdzv is None:  # else it waits its join timeout for nodes that
        raise ConfigError(  # have no address to meet at, in silence, then runs on one
            f"--nnodes with up to {max_nodes} nodes needs --rdzv HOST:PORT, where they meet"
        )
    if group_size > 1 and rdzv is not None:
        raise ConfigError(
            "--group-size with --rdzv (several nodes) is not supported yet; run replica groups "
            "on one node, or --group-size 1 across nodes"
        )


def launch(
    script: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    nproc: int,
    min_size: int = 1,
    max_restarts: int = 3,
    events_dir: str | os.PathLike[str] | None = None,
    timeout_s: float = 10.0,
    hang_s: float | None = None,
    straggler_factor: float = 2.0,
    start_grace_s: float = 60.0,
    env: Mapping[str, str] | None = None,
    stdout: int | None = None,
    rdzv: str | None = None,
    nnodes: str = "1",
    group_size: int = 1,
    exclude_suspect_after: int = 0,
) -> LaunchResult:
    """Run ``python script args...`` as an elastic job of ``nproc`` workers.

    Args:
        script: the worker script (it builds a :class:`stalwart.elastic.Job`).
        args: the script's arguments.
        nproc: workers to start.
        min_size: the fewest members (replica groups) to train with.
        max_restarts: replacements (of a worker, or of a whole group) to start at most.
        events_dir: folder for the event files (default: a new temporary folder).
        timeout_s: the job's one timeout, seconds: each epoch's group timeout; the hang and
            join timeouts and the heartbeat period derive from it (:mod:`.timeouts`).
        hang_s: kill a worker silent (no heartbeat) this long, s (0: never; None: timeout / 2).
        straggler_factor: report a member this many times slower than the others (<= 1: off).
        start_grace_s: how long the first epoch waits for all ``nproc`` workers.
        env: environment of the workers (default: this process's).
        stdout: where the workers' stdout goes (a file descriptor, e.g. 2 for this process's
            stderr, or ``subprocess.DEVNULL``); None: this process's stdout.
        rdzv: ``HOST:PORT`` where several nodes' launchers meet (:mod:`.nodes`; per node nproc).
        nnodes: ``MIN:MAX`` nodes (``--rdzv`` only): the first epoch waits for MIN.
        group_size: workers per replica group (:mod:`.roster`); it must divide ``nproc``.
        exclude_suspect_after: a worker named by this many SDC verdicts (a parity majority,
            its own non-finite gradients) leaves and is not replaced (:mod:`.sdc`); 0: off.

    Raises:
        ConfigError: the script is not a file, an argument is out of range, or the job
            already has MAX nodes.
    """
    min_nodes, max_nodes = parse_nnodes(nnodes)
    _check_sizes(nproc, min_size, max_restarts, group_size, max_nodes, rdzv, exclude_suspect_after)
    _check_script(script)  # after the arguments: each says what is wrong with it alone
    folder, worker_env = _prepare(events_dir, env, timeout_s, hang_s)
    write_policy(folder, exclude_suspect_after)
    cmd = [sys.executable, str(script), *args]
    coord = None
    if rdzv is not None:
        coord, store, _ = rendezvous(rdzv, max_nodes)
        if coord is None:  # an agent node: run its workers; the host supervises
            return _agent(cmd, nproc, max_restarts, worker_env, store, stdout, rdzv, folder)
    sup = Supervisor(cmd, nproc, min_size, max_restarts, worker_env, start_grace_s,
                      straggler_factor, stdout, coord, min_nodes, group_size)  # fmt: skip
    return _result(sup, run_with_signals(sup.run, sup.stop_signals, sup.request_rehost), folder)


def _check_script(script: str | os.PathLike[str]) -> None:
    """Refuse a script that is not a file: else every worker dies at once and is respawned."""
    if not os.path.isfile(script):
        what = "is a folder" if os.path.isdir(script) else "does not exist"
        raise ConfigError(f"the worker script {os.fspath(script)} {what}; check the path")


def _result(sup: Supervisor, code: int, folder: Path) -> LaunchResult:
    """The launch's outcome from the supervisor and the event files; the fleet rows written."""
    wall = time.monotonic() - sup.t0
    _write_fleet_log(folder)
    return LaunchResult(
        code, sup.restarts, wall, folder, summarize(folder), recoveries(folder),
        hung=sup.hung, stragglers=list(sup.stragglers.reported.values()), rehosts=sup.rehosts,
        fatal=sup.fatal["error"] if sup.fatal else None, excluded=list(sup.excluded),
    )  # fmt: skip


def _write_fleet_log(folder: Path) -> None:
    """``members.jsonl`` and ``faults.jsonl`` beside the events, for ``stalwart rca`` over runs.

    Never fails the launch: the run's result matters more than its fleet rows.
    """
    try:
        write_fleet_log(folder)
    except (OSError, ValueError) as e:  # ConfigError is a ValueError
        log.warning("no fleet log for %s: %s", folder, e)
