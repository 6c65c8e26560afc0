"""``stalwart ckpt``: list, inspect, verify, diff, export, import and collect checkpoints.

Exit status (as for every command, :mod:`stalwart.cli.conventions`): 0 on success; 1 when
``verify`` finds damage or damaged data is met while reading; 2 for any other problem (a
missing root or step, a bad argument), reported as one short red line on stderr with what to
do next, never a traceback. ``--json`` (on every command) prints JSON on stdout alone
(progress bars and errors go to stderr), so it can be piped.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from stalwart.checkpoint.options import CheckpointOptions
from stalwart.checkpoint.policy import KeepLast
from stalwart.checkpoint.tools.diff import diff_steps
from stalwart.checkpoint.tools.inspection import inspect_manifest
from stalwart.checkpoint.tools.verify import verify_all, verify_step
from stalwart.cli.ckpt_options import (
    FORCE,
    HTML,
    JSON,
    OPTS,
    ROOT,
    STEP,
    Format,
    ckpt_app,
    console,
    error_console,
    finish,
    fmt_ratio,
    fmt_size,
    new_table,
    open_root,
    step_of,
)
from stalwart.cli.ckpt_transfer import export, import_
from stalwart.cli.conventions import cli_hint, emit_json, handled
from stalwart.cli.diff_html import write_diff_html
from stalwart.errors import ConfigError, CorruptCheckpointError

__all__ = ["Format", "ckpt_app", "register"]


@ckpt_app.command("ls")
def ls(root: str = ROOT, as_json: bool = JSON, storage_option: list[str] = OPTS) -> None:
    """List committed steps: time, tensors, logical size, bytes written, dedup, world size."""
    with handled(), open_root(root, storage_option) as ck:
        rows: list[dict[str, Any]] = []
        for s in ck.steps():
            try:
                m = ck.manifest(s)
            except CorruptCheckpointError as e:
                rows.append({"step": s, "damaged": cli_hint(str(e))})
                continue
            logical = sum(t.nbytes for t in m.tensors.values())
            written = int(m.stats.get("bytes_written", 0))
            rows.append(
                {
                    "step": s,
                    "created_unix": m.created_unix,
                    "tensors": len(m.tensors),
                    "logical_bytes": logical,
                    "bytes_written": written,
                    "dedup_ratio": logical / written if written else None,
                    "world_size": m.world_size,
                }
            )
        if as_json:
            emit_json({"root": ck.url, "steps": rows})
            return
        if not rows:
            console().print(f"no committed checkpoints under {escape(ck.url)}")
            return
        cols = ("step", "created", "tensors", "logical", "written", "dedup", "world")
        table = new_table(escape(ck.url), cols, left=("created",))
        for r in rows:
            if "damaged" in r:
                table.add_row(str(r["step"]), "[red]damaged manifest[/]", *[""] * 5)
                continue
            created = _when(r["created_unix"])
            dedup = fmt_ratio(r["dedup_ratio"]) if r["bytes_written"] else "all reused"
            sizes = (fmt_size(r["logical_bytes"]), fmt_size(r["bytes_written"]), dedup)
            table.add_row(str(r["step"]), created, str(r["tensors"]), *sizes, str(r["world_size"]))
        console().print(table)


@ckpt_app.command("inspect")
def inspect(
    root: str = ROOT,
    step: int | None = STEP,
    as_json: bool = JSON,
    limit: int = typer.Option(50, "--limit", "-n", min=0, help="Tensors shown in the table."),
    storage_option: list[str] = OPTS,
) -> None:
    """Show a step's tensors (dtype, shape, shards, bytes, chunks) and its dedup ratio."""
    with handled(), open_root(root, storage_option) as ck:
        s = step_of(ck, step)
        m = ck.manifest(s)
        found = inspect_manifest(m)
        tensors, totals = found.to_json()["tensors"], found.totals
        refs, logical, stored = m.chunks(), totals["logical_bytes"], totals["stored_bytes"]
        info = {"step": s, "world_size": m.world_size, "metadata": m.metadata}
        if as_json:
            emit_json({**info, "totals": totals, "tensors": tensors})
            return
        cols = ("tensor", "dtype", "shape", "shards", "bytes", "chunks")
        table = new_table(f"step {s} of {escape(ck.url)}", cols, left=("tensor", "dtype"))
        for t in tensors[:limit]:
            nums = (str(t["shards"]), fmt_size(t["bytes"]), str(t["chunks"]))
            table.add_row(escape(t["name"]), t["dtype"], str(tuple(t["shape"])), *nums)
        out = console()
        out.print(table)
        if len(tensors) > limit:
            out.print(f"… {len(tensors) - limit} more tensors (use --limit or --json)")
        out.print(
            f"{totals['tensors']} tensors, {fmt_size(logical)} logical in {len(refs)} chunk refs; "
            f"{totals['distinct_chunks']} distinct chunks, {fmt_size(stored)} stored in "
            f"{totals['packs']} packs; dedup ratio {fmt_ratio(totals['dedup_ratio'])}; "
            f"world size {m.world_size}"
        )
        if m.metadata:
            out.print(f"metadata: {escape(json.dumps(m.metadata))}")


@ckpt_app.command("verify")
def verify(
    root: str = ROOT,
    step: int | None = typer.Option(None, "--step", "-s", help="Step to verify; all if omitted."),
    as_json: bool = JSON,
    storage_option: list[str] = OPTS,
) -> None:
    """Read and hash every chunk; exit 1 and list every damaged item when any is bad."""
    with handled(), open_root(root, storage_option) as ck:
        cols = (TextColumn("step {task.fields[step]}"), BarColumn(), MofNCompleteColumn())
        with Progress(*cols, console=error_console(), transient=True) as bar:
            task = bar.add_task("verify", total=None, step="…")

            def progress(s: int, done: int, total: int) -> None:
                bar.update(task, completed=done, total=total, step=s)

            if step is None:
                reports = verify_all(ck, progress=progress)
                if not reports:
                    raise ConfigError(f"no committed checkpoint under {ck.url} to verify")
            else:
                one = step
                reports = [verify_step(ck, one, progress=lambda d, t: progress(one, d, t))]
        ok = all(r.ok for r in reports)
        if as_json:
            emit_json({"ok": ok, "steps": [_told(r.to_json()) for r in reports]})
        else:
            out = console()
            for r in reports:
                state = "[green]ok[/]" if r.ok else f"[red]DAMAGED ({len(r.damaged)} items)[/]"
                out.print(
                    f"step {r.step}: {state} — {r.chunks_checked} chunks, "
                    f"{fmt_size(r.bytes_checked)} checked"
                )
            if not ok:
                table = Table(title="damaged", title_style="red")
                table.add_column("step", justify="right")
                table.add_column("what is damaged", overflow="fold")
                for r in reports:
                    for item in r.damaged:
                        table.add_row(str(r.step), escape(cli_hint(item)))
                out.print(table)
                out.print("remove a damaged step with `stalwart ckpt rm ROOT N`, or use another")
        if not ok:
            raise typer.Exit(1)


@ckpt_app.command("diff")
def diff(
    root: str = ROOT,
    a: int = typer.Argument(..., help="Reference step."),
    b: int = typer.Argument(..., help="Step compared with A."),
    as_json: bool = JSON,
    html: Path | None = HTML,
    show_all: bool = typer.Option(False, "--all", help="List unchanged tensors too."),
    storage_option: list[str] = OPTS,
) -> None:
    """Per tensor: unchanged / changed / added / removed, with the size of the change."""
    with handled(), open_root(root, storage_option) as ck:
        report = diff_steps(ck, a, b)
        if html is not None:
            write_diff_html(report, html)
            error_console().print(f"wrote {escape(str(html))}")
        if as_json:
            emit_json(report.to_json())
            return
        rows = [r for r in report.tensors if show_all or r.status != "unchanged"]
        rows.sort(key=lambda r: -1.0 if r.relative is None else r.relative, reverse=True)
        out = console()
        if rows:
            cols = ("tensor", "status", "dtype", "shape", "changed", "L2", "max |Δ|", "rel")
            table = new_table(f"step {a} → step {b}", cols, left=("tensor", "status"))
            for r in rows:
                shape = str(r.shape) if r.old_shape is None else f"{r.old_shape}→{r.shape}"
                changed = "—" if r.changed_elements is None else str(r.changed_elements)
                table.add_row(
                    escape(r.name),
                    r.status,
                    r.dtype if r.old_dtype is None else f"{r.old_dtype}→{r.dtype}",
                    shape,
                    changed,
                    *(_g(x) for x in (r.l2, r.max_abs, r.relative)),
                )
            out.print(table)
        c = report.counts()
        out.print(
            f"{c['unchanged']} unchanged, {c['changed']} changed, {c['added']} added, "
            f"{c['removed']} removed, {c['reshaped']} reshaped; {report.tensors_read} tensors "
            f"read ({fmt_size(report.bytes_read)}), the rest settled by chunk hashes"
        )
        if report.values:
            vt = Table(title="non-tensor values")
            for col in ("path", "status", f"step {a}", f"step {b}"):
                vt.add_column(col)
            for v in report.values:
                vt.add_row(*(escape(x or "—") for x in (v.path, v.status, v.old, v.new)))
            out.print(vt)


def _g(x: float | None) -> str:
    return "—" if x is None else f"{x:.3g}"


# Registered here, after diff and before gc, in the order `stalwart ckpt --help` lists them.
ckpt_app.command("export")(export)
ckpt_app.command("import")(import_)


@ckpt_app.command("gc")
def gc(
    root: str = ROOT,
    grace_s: float | None = typer.Option(
        None, "--grace-s", min=0, help="Keep unreferenced packs younger than this (default 3600)."
    ),
    keep_last: int | None = typer.Option(
        None, "--keep-last", min=1, help="Delete all but the newest N steps first."
    ),
    storage_option: list[str] = OPTS,
    as_json: bool = JSON,
) -> None:
    """Apply retention, then delete pack files no checkpoint or live lease references."""
    with handled():
        options = CheckpointOptions(keep=KeepLast(keep_last)) if keep_last else None
        with open_root(root, storage_option, options=options) as ck:
            r = ck.gc(grace_s=grace_s)
            doc = {"deleted_steps": r.deleted_steps, "deleted_packs": r.deleted_packs}
            temps = {"temps_removed": r.temps_removed, "temps_bytes_freed": r.temps_bytes_freed}
            finish(
                as_json,
                {**doc, "bytes_freed": r.bytes_freed, "kept_packs": r.kept_packs, **temps},
                f"deleted {len(r.deleted_steps)} steps {r.deleted_steps or ''} and "
                f"{len(r.deleted_packs)} packs"
                + (f" and {r.temps_removed} temporaries of dead writes" if r.temps_removed else "")
                + f", freed {fmt_size(r.bytes_freed)}; {r.kept_packs} packs kept",
            )
            if r.skipped:
                error_console().print(
                    f"left {len(r.skipped)} file(s) under packs/ that stalwart did not write, "
                    f"e.g. {escape(r.skipped[0])}; move them out of the checkpoint root"
                )


@ckpt_app.command("rm")
def rm(
    root: str = ROOT,
    step: int = typer.Argument(..., help="The step to delete (its manifest and its own packs)."),
    force: bool = FORCE,
    storage_option: list[str] = OPTS,
    as_json: bool = JSON,
) -> None:
    """Delete one committed step, even one whose manifest is damaged, and the packs only it
    used (a damaged step's packs go at the next gc, after its grace)."""
    with handled(), open_root(root, storage_option) as ck:
        r = ck.delete(step, force=force)
        doc = {"deleted_step": step, "root": ck.url, "deleted_packs": r.deleted_packs}
        finish(
            as_json,
            {**doc, "bytes_freed": r.bytes_freed},
            f"deleted step {step} from {escape(ck.url)} and {len(r.deleted_packs)} packs only "
            f"it used, freed {fmt_size(r.bytes_freed)}",
        )


def _told(doc: dict[str, Any]) -> dict[str, Any]:
    """A verify report's JSON with its damage told the command line's way (:func:`cli_hint`)."""
    return {**doc, "damaged": [cli_hint(d) for d in doc.get("damaged", [])]}


def register(app: typer.Typer) -> None:
    """Add the ``ckpt`` command group to ``app``."""
    app.add_typer(
        ckpt_app, name="ckpt", help="Inspect, verify, diff, export and import checkpoints."
    )


def _when(created_unix: float) -> str:
    """A manifest's creation time, local; "—" for one no calendar holds (informational only:
    the step's data may still be sound, ``ckpt verify`` says)."""
    try:
        return datetime.fromtimestamp(created_unix).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):
        return "—"
