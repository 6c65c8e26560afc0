"""``stalwart run``: launch an elastic training job and print its recovery summary."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from stalwart.cli.conventions import JSON_HELP, emit_json, folder_out

__all__ = ["register", "run"]


_Script = Annotated[
    Path, typer.Argument(help="The worker script (it builds a stalwart.elastic.Job).")
]
_Args = Annotated[
    list[str] | None,
    typer.Argument(
        metavar="SCRIPT_ARGS",
        help="Everything after the script goes to it, options too: give stalwart's options "
        "before the script.",
    ),
]
_Nproc = Annotated[int, typer.Option("--nproc", min=1, help="Workers to start.")]
_MinSize = Annotated[
    int, typer.Option("--min-size", min=1, help="Fewest members (replica groups) to train with.")
]
_GroupSize = Annotated[
    int,
    typer.Option(
        "--group-size",
        min=1,
        help="Ranks per replica group (FSDP2 / tensor parallel inside; it must divide --nproc). "
        "A rank's death takes its group out and a new group heals from the live ones.",
    ),
]
_MaxRestarts = Annotated[
    int, typer.Option("--max-restarts", min=0, help="Replacement workers to start at most.")
]
_Events = Annotated[
    Path | None,
    typer.Option(
        callback=folder_out, help="Folder for the workers' event files (default: a temp folder)."
    ),
]
_Timeout = Annotated[
    float,
    typer.Option(
        min=0.1,
        help="The job's timeout, seconds: each epoch's group (gloo/NCCL) timeout; the hang "
        "timeout (/2), heartbeat period (/10) and join timeout (x30, >= 60 s) derive from it.",
    ),
]
_HangTimeout = Annotated[
    float | None,
    typer.Option(
        min=0.0,
        help="Kill and replace a worker silent (no heartbeat) this long, s; 0: off "
        "(default: --timeout / 2).",
    ),
]
_Straggler = Annotated[
    float, typer.Option(min=0.0, help="Report a member this many times slower than the others.")
]
_Rdzv = Annotated[
    str | None,
    typer.Option(
        "--rdzv",
        help="HOST:PORT where the launchers of several nodes meet; the first to bind it hosts "
        "the job (--nproc is per node).",
    ),
]
_Nnodes = Annotated[
    str, typer.Option("--nnodes", help="MIN:MAX nodes with --rdzv; the first epoch waits for MIN.")
]
_ExcludeAfter = Annotated[
    int,
    typer.Option(
        "--exclude-suspect-after",
        min=0,
        help="A worker named by this many SDC verdicts (a parity majority, its own non-finite "
        "gradients) leaves with exit code 12 and is not replaced; 0: never (default).",
    ),
]
_Json = Annotated[
    bool,
    typer.Option(
        "--json", help=JSON_HELP + " (the workers' stdout goes to stderr)", metavar=""
    ),  # a plain switch: no `<bool>` in --help
]


def run(
    ctx: typer.Context,
    script: _Script,
    args: _Args = None,
    nproc: _Nproc = 1,
    min_size: _MinSize = 1,
    group_size: _GroupSize = 1,
    max_restarts: _MaxRestarts = 3,
    events: _Events = None,
    timeout: _Timeout = 10.0,
    hang_timeout: _HangTimeout = None,
    straggler_factor: _Straggler = 2.0,
    rdzv: _Rdzv = None,
    nnodes: _Nnodes = "1",
    exclude_suspect_after: _ExcludeAfter = 0,
    as_json: _Json = False,
) -> None:
    """Start N workers around a coordinator; replace dead ones; survivors never restart.

    stalwart's options go before the script: everything after it is the script's own.
    """
    from stalwart.elastic import launch  # torch is imported only when a job runs

    result = launch(
        script, args or [], nproc=nproc, min_size=min_size,
        max_restarts=max_restarts, events_dir=events, timeout_s=timeout,
        hang_s=hang_timeout, straggler_factor=straggler_factor,
        stdout=2 if as_json else None, rdzv=rdzv, nnodes=nnodes, group_size=group_size,
        exclude_suspect_after=exclude_suspect_after,
    )  # fmt: skip
    options = {o for p in ctx.command.params for o in p.opts if o.startswith("-")}
    misplaced = [a for a in args or [] if a.split("=")[0] in options]
    if as_json:
        _explain(result, script, misplaced)
        emit_json(summary_json(result))
        raise typer.Exit(result.exit_code)
    console = Console()
    console.print(_summary_table(result))
    if result.recoveries:
        console.print(_recovery_table(result.recoveries))
    if result.fatal:
        Console(stderr=True).print(f"stopped: {result.fatal}", style="red", markup=False,
                                   highlight=False, soft_wrap=True)  # fmt: skip
    _explain(result, script, misplaced)
    if result.exit_code:
        raise typer.Exit(result.exit_code)


def _explain(result: Any, script: Path, misplaced: list[str]) -> None:
    """On stderr: why a job whose workers never joined it ended, and which of the script's
    arguments are the launcher's own options (``misplaced``: they went to the script)."""
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    if result.summary.workers == 0 and result.exit_code and not result.fatal:
        err.print(
            f"the workers exited without joining the job: {script} wrote no events. Does it "
            "build a stalwart.elastic.Job and train in it (docs/elastic.md)? A plain script "
            "runs with python, not `stalwart run`.",
            style="red",
            markup=False,
        )
    if misplaced and (result.exit_code or "--json" in misplaced):  # a script's own --timeout
        err.print(
            f"note: {' '.join(misplaced)} came after the script and went to it, not to "
            f"stalwart run; put stalwart's options before {script}",
            markup=False,
        )


def summary_json(result: Any) -> dict[str, Any]:
    """``stalwart run --json``'s document: outcome, summary, recoveries, hangs, stragglers.

    Keys: ``exit_code``, ``ok``, ``restarts``, ``coordinator_rehosts``, ``wall_s``,
    ``events_dir``, ``summary`` (:class:`~stalwart.elastic.JobSummary` fields, ``goodput`` a
    share in [0, 1]), ``final_digests_equal`` (per shard with replica groups),
    ``recoveries`` (one object per dead worker),
    ``hung`` (worker id to seconds of silence), ``stragglers``, ``excluded`` (worker ids the
    exclusion policy removed) and ``fatal`` (the error a worker reported as fatal, or the
    exclusions that left too few members: exit code 3; else null).
    """
    summary = dataclasses.asdict(result.summary)
    return {
        "exit_code": result.exit_code,
        "ok": result.exit_code == 0,
        "restarts": result.restarts,
        "coordinator_rehosts": result.rehosts,
        "wall_s": round(result.wall_s, 3),
        "events_dir": str(result.events_dir),
        "summary": summary,
        "final_digests_equal": result.summary.final_digests_equal,
        "recoveries": [dataclasses.asdict(r) for r in result.recoveries],
        "hung": {str(w): s for w, s in sorted(result.hung.items())},
        "stragglers": result.stragglers,
        "excluded": result.excluded,
        "fatal": result.fatal,
    }


def _summary_table(result: Any) -> Table:
    """The ``stalwart run`` summary as a two-column table."""
    s = result.summary
    table = Table(title="stalwart run", show_header=False)
    for name, value in (
        ("exit code", result.exit_code),
        ("final step", s.final_step),
        ("workers started", s.workers),
        ("restarts", result.restarts),
        ("coordinator re-hosted", result.rehosts),
        ("faults (failed members)", s.faults),
        ("fault reports (one per survivor)", s.fault_reports),
        ("steps discarded (most on one worker)", s.discarded_steps),
        ("heals (state received)", s.heals),
        ("follows (healed while the others trained)", s.follows),
        ("parity mismatches", s.parity_mismatches),
        ("hung (killed, silence)", _hung(result.hung)),
        ("stragglers (own time vs others)", _stragglers(result.stragglers)),
        ("excluded (SDC verdicts)", ", ".join(map(str, result.excluded)) or "none"),
        ("final digests equal", _digests_row(s)),
        ("goodput", f"{s.goodput:.1%}"),
        ("wall time", f"{result.wall_s:.1f} s"),
        ("events", str(result.events_dir)),
    ):
        table.add_row(name, str(value))
    return table


def _digests_row(s: Any) -> str:
    per_shard = ", per shard across replica groups" if s.shard_ranks else ""
    return f"{s.final_digests_equal} ({len(s.final_digests)} workers{per_shard})"


def _hung(hung: dict[int, float]) -> str:
    return ", ".join(f"worker {w} ({s:.1f} s)" for w, s in sorted(hung.items())) or "none"


def _stragglers(reports: list[dict[str, Any]]) -> str:
    parts = [
        f"worker {r['wid']} ({r['own_median'] * 1e3:.1f} vs {r['others_median'] * 1e3:.1f} ms)"
        for r in reports
    ]
    return ", ".join(parts) or "none"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _recovery_table(recoveries: list[Any]) -> Table:
    """One row per worker that died: detection, resumption, lost steps, rejoin.

    ``detected``, ``resumed`` and ``reaped`` count from the dead worker's last event (its
    last sign of life) to the first survivor's fault-detected, to the first commit without
    it, and to the launcher seeing it exit; ``rejoined`` from the replacement's launch to its
    first commit.
    """
    table = Table(title="recoveries")
    for col in ("worker", "exit", "detected", "resumed", "reaped", "lost steps", "replacement",
                "rejoined"):  # fmt: skip
        table.add_column(col)
    for r in recoveries:
        table.add_row(
            str(r.worker), str(r.exit_code), _seconds(r.detect_s), _seconds(r.resume_s),
            _seconds(r.reaped_s),
            str(r.lost_steps), "-" if r.replacement is None else str(r.replacement),
            _seconds(r.rejoin_s),
        )  # fmt: skip
    return table


def register(app: typer.Typer) -> None:
    """Add the ``run`` command to ``app``."""
    # Everything after the script is the script's own (as torchrun does): an option the
    # launcher also knows (--timeout, --json, ...) must not be taken from the script's line.
    settings = {"allow_extra_args": True, "ignore_unknown_options": True,
                "allow_interspersed_args": False}  # fmt: skip
    app.command("run", context_settings=settings)(run)
