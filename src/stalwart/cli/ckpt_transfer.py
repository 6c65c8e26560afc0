"""``stalwart ckpt export`` and ``import``: a step to and from one file or a DCP folder.

Both are commands of :data:`~stalwart.cli.ckpt_options.ckpt_app`, registered by
:mod:`stalwart.cli.ckpt` in the order its help lists them. No pickle from an imported source
runs unless ``--trust-pickle`` (see :mod:`stalwart.checkpoint.tools.importing`).
"""

from __future__ import annotations

from pathlib import Path

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
from stalwart.cli.conventions import handled
from stalwart.errors import ConfigError

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
        if out.exists() and any(out.iterdir()) and not overwrite:
            raise ConfigError(f"{out} exists and is not empty; pass --overwrite or another OUT")
        r = export_dcp(ck, out, step=step_of(ck, step))
        doc = {"step": r.step, "tensors": r.tensors, "values": r.values, "path": str(out)}
        finish(
            as_json,
            {**doc, "bytes": r.bytes_total, "format": "dcp"},
            f"exported step {r.step} ({r.tensors} tensors, {r.values} values, "
            f"{fmt_size(r.bytes_total)}) to {escape(str(out))} as a DCP checkpoint",
        )


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
