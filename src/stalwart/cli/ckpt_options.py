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
from stalwart.cli.conventions import JSON_HELP, emit_json, handled
from stalwart.errors import ConfigError, StalwartError
from stalwart.integrations.lightning_pointer import POINTER_KEY, read_pointer

ckpt_app = typer.Typer(
    help="Inspect, verify, compare, export and import checkpoints.", no_args_is_help=True
)

_ROOT = typer.Argument(..., help="Checkpoint root: a folder or an fsspec URL (s3://bucket/p).")
_STEP = typer.Option(None, "--step", "-s", help="Step to use; the newest when omitted.")
_JSON = typer.Option(False, "--json", help=JSON_HELP)


class Format(str, enum.Enum):
    """``export --format``: ``tools.export.FORMATS`` and DCP (a test keeps them equal)."""

    safetensors = "safetensors"
    torch = "torch"
    dcp = "dcp"


_FORMAT = typer.Option(
    Format["safetensors"], "--format", "-f", help="File format, or dcp (a DCP folder)."
)
_OPTS = typer.Option(
    [],
    "--storage-option",
    "-o",
    help="KEY=VALUE passed to fsspec for remote roots (repeatable; VALUE is parsed as JSON "
    "when it can be, e.g. anon=true).",
)

_HTML = typer.Option(None, "--html", help="Also write a self-contained HTML report here.")
_OUT_FILE = typer.Argument(..., help="File to write.")
_SRC = typer.Argument(..., help="safetensors file, torch.save file or DCP checkpoint folder.")


def _out() -> Console:
    return Console()


def _err() -> Console:
    return Console(stderr=True)


_handled = handled  # damaged data: exit 1; other stalwart or OS errors: exit 2


def _done(as_json: bool, doc: dict[str, Any], text: str) -> None:
    """Report a command's result: ``doc`` as JSON with ``--json``, else the ``text`` line."""
    if as_json:
        emit_json(doc)
    else:
        _out().print(text)


def _storage_options(pairs: list[str]) -> dict[str, Any] | None:
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


def _open(
    root: str,
    pairs: list[str],
    *,
    must_exist: bool = True,
    options: CheckpointOptions | None = None,
) -> Checkpointer:
    local = "://" not in root or root.startswith("file://")
    path = Path(root.removeprefix("file://"))
    if local and path.is_file():
        raise ConfigError(_file_as_root(path))
    if must_exist and local and not path.is_dir():
        raise ConfigError(f"checkpoint root {root} does not exist; check the path")
    return Checkpointer(root, options, storage_options=_storage_options(pairs))


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
    return (
        f"{said}; pass the folder given to Checkpointer(...) (the one holding manifests and "
        f"packs), or import the file as a step with `stalwart ckpt import {path} ROOT`"
    )


def _step(ck: Checkpointer, step: int | None) -> int:
    if step is not None:
        return step
    latest = ck.latest_step()
    if latest is None:
        raise ConfigError(f"no committed checkpoint under {ck.url}; save one first")
    return latest


def _size(n: float | None) -> str:
    if n is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _ratio(x: float | None) -> str:
    return "—" if x is None else ("∞" if math.isinf(x) else f"{x:.2f}x")


def _table(title: str, cols: tuple[str, ...], left: tuple[str, ...]) -> Table:
    """A table whose ``left`` columns are left-aligned, numbers right-aligned; only tensor
    names wrap (they are the point of the table), other cells never do."""
    table = Table(title=title)
    for col in cols:
        fold: dict[str, Any] = {"overflow": "fold"} if col == "tensor" else {"no_wrap": True}
        table.add_column(col, justify="left" if col in left else "right", **fold)
    return table


def _json(obj: Any) -> None:
    emit_json(obj)
