"""What the ``stalwart ckpt`` commands share: the command group, its arguments and options,
opening a root, choosing a step, and the small renderers of sizes, ratios and tables.
"""

from __future__ import annotations

import enum
import json
import math
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from stalwart.checkpoint.durable.checkpointer import Checkpointer
from stalwart.checkpoint.options import CheckpointOptions
from stalwart.cli.conventions import JSON_HELP, emit_json, file_out
from stalwart.errors import ConfigError, StalwartError
from stalwart.integrations.lightning_pointer import POINTER_KEY, read_pointer

ckpt_app = typer.Typer(
    help="Inspect, verify, compare, export and import checkpoints.", no_args_is_help=True
)

ROOT = typer.Argument(..., help="Checkpoint root: a folder or an fsspec URL (s3://bucket/p).")
STEP = typer.Option(None, "--step", "-s", help="Step to use; the newest when omitted.")
JSON = typer.Option(False, "--json", help=JSON_HELP)
FORCE = typer.Option(
    False, "--force", help="Delete even while a load holds the step (that load then fails)."
)
SUBTREE = typer.Option(
    None, "--subtree", help="Export only this model state dict (e.g. model), its prefix stripped."
)
TRUST_PICKLE = typer.Option(
    False,
    "--trust-pickle",
    help="Let a DCP folder's pickles run unrestricted (only for folders you trust).",
)


class Format(str, enum.Enum):
    """``export --format``: ``tools.export.FORMATS`` and DCP (a test keeps them equal)."""

    safetensors = "safetensors"
    torch = "torch"
    dcp = "dcp"


FORMAT = typer.Option(
    None,
    "--format",
    "-f",
    help="File format, or dcp (a DCP folder). Default: the one OUT's suffix names (.pt, .pth, "
    ".bin: torch), else safetensors.",
)
OPTS = typer.Option(
    [],
    "--storage-option",
    "-o",
    help="KEY=VALUE passed to fsspec for remote roots (repeatable; VALUE is parsed as JSON "
    "when it can be, e.g. anon=true).",
)

HTML = typer.Option(
    None, "--html", callback=file_out, help="Also write a self-contained HTML report here."
)
OUT_FILE = typer.Argument(..., help="File to write.")
SRC = typer.Argument(..., help="safetensors file, torch.save file or DCP checkpoint folder.")


def console() -> Console:
    """The console a command reports on (stdout)."""
    return Console()


def error_console() -> Console:
    """The console for progress and messages that must stay off stdout (stderr)."""
    return Console(stderr=True)


def finish(as_json: bool, doc: dict[str, Any], text: str) -> None:
    """Report a command's result: ``doc`` as JSON with ``--json``, else the ``text`` line."""
    if as_json:
        emit_json(doc)
    else:
        console().print(text)


def parse_storage_options(pairs: list[str]) -> dict[str, Any] | None:
    """``--storage-option KEY=VALUE`` pairs as fsspec options (VALUE parsed as JSON when it
    can be); ``None`` when there are none."""
    opts: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--storage-option {pair!r}: write it as KEY=VALUE")
        try:
            opts[key] = json.loads(value)
        except ValueError:
            opts[key] = value
    return opts or None


def open_root(
    root: str,
    pairs: list[str],
    *,
    must_exist: bool = True,
    options: CheckpointOptions | None = None,
) -> Checkpointer:
    """The ``Checkpointer`` of ``root``; a missing local root (unless ``must_exist`` is false)
    or a file given as a root is a ``ConfigError`` that says what to pass instead."""
    local = "://" not in root or root.startswith("file://")
    path = Path(root.removeprefix("file://"))
    if local and path.is_file():
        raise ConfigError(_file_as_root(path))
    if must_exist and local and not path.is_dir():
        raise ConfigError(f"checkpoint root {root} does not exist; check the path")
    return Checkpointer(root, options, storage_options=parse_storage_options(pairs))


def _file_as_root(path: Path) -> str:
    """What to say when a file is given where a checkpoint root (a folder) is expected."""
    said = f"{path} is a file, not a checkpoint root folder"
    with open(path, "rb") as f:
        head = f.read(4096)
    if POINTER_KEY.encode() in head:  # Lightning's pointer names its root
        try:
            ptr = read_pointer(path)
        except (OSError, StalwartError):
            ptr = None
        if ptr is not None:
            return (
                f"{said}: it is a Lightning pointer to step {ptr['step']} of the root "
                f"{ptr['root']}; pass that root (and --step {ptr['step']})"
            )
    if path.parent.name in ("manifests", "packs", "leases"):  # a file of a root: that root
        return f"{said}: it is part of the checkpoint root {path.parent.parent}; pass that root"
    return (
        f"{said}; pass the folder given to Checkpointer(...) (the one holding manifests and "
        f"packs), or import the file as a step with `stalwart ckpt import {path} ROOT`"
    )


def step_of(ck: Checkpointer, step: int | None) -> int:
    """``step``, or the newest committed step when it is ``None``."""
    if step is not None:
        return step
    latest = ck.latest_step()
    if latest is None:
        raise ConfigError(f"no committed checkpoint under {ck.url}; save one first")
    return latest


def fmt_size(n: float | None) -> str:
    """Bytes for people: ``512 B``, ``1.5 MiB``; ``—`` when unknown."""
    if n is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def fmt_ratio(x: float | None) -> str:
    """A ratio: ``2.50x``, ``∞``; ``—`` when unknown."""
    return "—" if x is None else ("∞" if math.isinf(x) else f"{x:.2f}x")


def new_table(title: str, cols: tuple[str, ...], left: tuple[str, ...]) -> Table:
    """A table whose ``left`` columns are left-aligned, numbers right-aligned; only tensor
    names wrap (they are the point of the table), other cells never do."""
    table = Table(title=title)
    for col in cols:
        fold: dict[str, Any] = {"overflow": "fold"} if col == "tensor" else {"no_wrap": True}
        table.add_column(col, justify="left" if col in left else "right", **fold)
    return table
