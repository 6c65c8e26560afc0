"""``stalwart ckpt export`` and ``import``: a step to and from one file or a DCP folder.

Both are commands of :data:`~stalwart.cli.ckpt_options.ckpt_app`, registered by
:mod:`stalwart.cli.ckpt` in the order its help lists them. No pickle from an imported source
runs unless ``--trust-pickle`` (see :mod:`stalwart.checkpoint.tools.importing`).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from stalwart.checkpoint.tools.export import export_step
from stalwart.checkpoint.tools.importing import import_file
from stalwart.cli.ckpt_options import (
    FORMAT,
    JSON,
    OPTS,
    OUT_FILE,
    ROOT,
    SRC,
    STEP,
    SUBTREE,
    TRUST_PICKLE,
    Format,
    finish,
    fmt_size,
    open_root,
    parse_storage_options,
    step_of,
)
from stalwart.cli.conventions import check_outputs, disk_full, handled
from stalwart.errors import ConfigError, StalwartError, StorageError, StorageFullError

__all__ = ["export", "import_"]


def export(
    root: str = ROOT,
    out: Path = OUT_FILE,
    step: int | None = STEP,
    fmt: Format | None = FORMAT,
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT if it exists."),
    subtree: str | None = SUBTREE,
    storage_option: list[str] = OPTS,
    as_json: bool = JSON,
) -> None:
    """Write a step's full tensors to one safetensors or torch.save file, or a DCP folder."""
    if fmt is Format.dcp:
        _export_dcp(root, out, step, overwrite, subtree, storage_option, as_json)
        return
    fmt_name = fmt.value if fmt else None
    with handled(), open_root(root, storage_option) as ck:
        check_outputs({"OUT": out})
        r = export_step(
            ck, out, step=step_of(ck, step), format=fmt_name, overwrite=overwrite, subtree=subtree
        )
        doc = {"step": r.step, "tensors": r.tensors, "bytes": r.bytes, "path": str(r.path)}
        finish(
            as_json,
            {**doc, "format": r.format},
            f"exported step {r.step} ({r.tensors} tensors, {fmt_size(r.bytes)}) to "
            f"{escape(str(r.path))} as {r.format}",
        )


def _export_dcp(
    root: str,
    out: Path,
    step: int | None,
    overwrite: bool,
    subtree: str | None,
    pairs: list[str],
    as_json: bool,
) -> None:
    from stalwart.integrations.dcp import export_dcp

    with handled(), open_root(root, pairs) as ck:
        if subtree is not None:
            raise ConfigError("--subtree is for file formats; --format dcp writes the whole step")
        if out.exists() and not out.is_dir():
            raise ConfigError(
                f"{out} is a file; --format dcp writes a folder: give a folder path for OUT "
                "(made if missing)"
            )
        check_outputs({"OUT": out})
        if out.exists() and any(out.iterdir()) and not overwrite:
            raise ConfigError(f"{out} exists and is not empty; pass --overwrite or another OUT")
        r = _dcp_written(lambda: export_dcp(ck, out, step=step_of(ck, step)), out)
        doc = {"step": r.step, "tensors": r.tensors, "values": r.values, "path": str(out)}
        finish(
            as_json,
            {**doc, "bytes": r.bytes_total, "format": "dcp"},
            f"exported step {r.step} ({r.tensors} tensors, {r.values} values, "
            f"{fmt_size(r.bytes_total)}) to {escape(str(out))} as a DCP checkpoint",
        )


def _dcp_written(export: Callable[[], Any], out: Path) -> Any:
    """``export()``'s result. DCP's failure (its ``CheckpointException`` is a BaseException
    holding every rank's error) becomes the stalwart error it wraps, or a storage error naming
    ``out`` (``StorageFullError`` for a full disk), after removing what the export added to
    ``out``: the folder it created, or the entries it added to an existing one."""
    before = set(out.iterdir()) if out.is_dir() else None
    try:
        return export()
    except BaseException as e:
        if before is None:
            shutil.rmtree(out, ignore_errors=True)
        else:
            for added in set(out.iterdir()) - before:
                if added.is_dir():
                    shutil.rmtree(added, ignore_errors=True)
                else:
                    added.unlink(missing_ok=True)
        if isinstance(e, (KeyboardInterrupt, SystemExit, StalwartError)):
            raise
        raise _dcp_error(e, out, mixed=bool(before)) from e


def _dcp_error(e: BaseException, out: Path, *, mixed: bool) -> Exception:
    """The error to report for DCP's failure ``e`` writing ``out`` (see :func:`_dcp_written`)."""
    causes, seen = [e], 0
    while seen < len(causes) < 50:  # the failures of each rank, and what caused them
        c, seen = causes[seen], seen + 1
        failures = getattr(c, "failures", None) or {}
        causes += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        causes += [x for x in (c.__cause__, c.__context__) if x is not None]
    for c in causes:
        if isinstance(c, StalwartError):
            return c  # the checkpoint's own damage (a chunk failing its hash), said as such
    after = (
        f"; {out} may now mix the earlier files with new ones: delete it or export again"
        if mixed
        else " (the partial export was removed)"
    )
    if any(disk_full(c, out.parent) for c in causes):
        return StorageFullError(
            f"no space left on the device writing the DCP checkpoint {out}; free space there "
            f"or export elsewhere{after}"
        )
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    last = (lines[-1].strip() if lines else type(e).__name__)[:500]
    return StorageError(f"writing the DCP checkpoint {out} failed ({last}){after}")


def import_(
    src: Path = SRC,
    root: str = ROOT,
    step: int | None = typer.Option(
        None,
        "--step",
        "-s",
        min=0,
        help="Step to save it as (default: 0 in a new root, else one past the newest step).",
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace STEP if it exists."),
    trust_pickle: bool = TRUST_PICKLE,
    storage_option: list[str] = OPTS,
    as_json: bool = JSON,
) -> None:
    """Save a safetensors / torch.save file or a DCP checkpoint as a step (no pickle runs)."""
    if step is None:
        with handled(), open_root(root, storage_option, must_exist=False) as ck:
            latest = ck.latest_step()
        step = 0 if latest is None else latest + 1
    if (src / ".metadata").is_file():  # a DCP folder: streamed through DCP's public API
        _import_dcp(src, root, step, overwrite, trust_pickle, storage_option, as_json)
        return
    with handled(), open_root(root, storage_option, must_exist=False) as ck:
        r = import_file(src, ck, step=step, overwrite=overwrite, trust_pickle=trust_pickle)
        doc = {"source": str(src), "kind": r.kind, "step": step, "root": ck.url}
        finish(
            as_json,
            {**doc, "tensors": r.tensors, "bytes": r.save.bytes_total},
            f"imported {escape(str(src))} ({r.kind}) as step {step} into {escape(ck.url)}: "
            f"{r.tensors} tensors, {fmt_size(r.save.bytes_total)} "
            f"({fmt_size(r.save.bytes_written)} written)",
        )


def _import_dcp(
    src: Path,
    root: str,
    step: int,
    overwrite: bool,
    trust_pickle: bool,
    pairs: list[str],
    as_json: bool,
) -> None:
    from stalwart.integrations.dcp import import_dcp

    with handled():
        open_root(root, pairs, must_exist=False).close()  # a file given as ROOT is named as one
        opts = parse_storage_options(pairs)
        r = import_dcp(
            src, root, step, trust_pickle=trust_pickle, overwrite=overwrite, storage_options=opts
        )
        doc = {"source": str(src), "kind": "dcp", "step": step, "root": root}
        finish(
            as_json,
            {**doc, "tensors": r.tensors, "bytes": r.bytes_total},
            f"imported {escape(str(src))} (dcp) as step {step} into {escape(root)}: "
            f"{r.tensors} tensors, {fmt_size(r.bytes_total)} ({fmt_size(r.bytes_written)} written)",
        )
