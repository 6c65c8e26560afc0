"""What every ``stalwart`` command shares: exit codes, ``--json``, error reporting.

Exit codes (the same for every command)::

    0  OK           the command did what was asked
    1  FINDING      it ran and found damage or a failed check (verify, demo parity, a
                    damaged checkpoint met while reading)
    2  USAGE        bad input: an unknown option or choice, a missing file, root or step,
                    a missing extra; one red line on stderr says what to do next
    3  UNEXPECTED   a bug or an environment failure nobody anticipated: a short message on
                    stderr; ``stalwart -v ...`` prints the traceback

``--json`` is a switch on every command (help shows every boolean flag as a bare switch): the
result goes to stdout as one JSON document instead of tables (progress and messages go to
stderr), so it can be piped. Files are written by path options (``--out DIR``, ``--json-out
FILE``, ``--html FILE``), each through :func:`write_file` or :func:`staged_files`: atomically
(a file in a staging folder beside it, renamed into place), so a full disk or a crash leaves
the earlier file whole. :func:`check_outputs` refuses, before any work, an output that would
replace one of the command's inputs, a file of a checkpoint root, or another output.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import numbers
import os
import re
import shutil
import tempfile
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup, TyperOption

from stalwart.errors import ConfigError, CorruptCheckpointError, StalwartError, StorageFullError

__all__ = [
    "EXIT_FINDING",
    "EXIT_OK",
    "EXIT_UNEXPECTED",
    "EXIT_USAGE",
    "JSON_HELP",
    "GuardedGroup",
    "check_outputs",
    "checkpoint_root_of",
    "cli_hint",
    "disk_full",
    "emit_json",
    "file_out",
    "folder_out",
    "handled",
    "json_text",
    "plain_switches",
    "staged_files",
    "write_file",
]

EXIT_OK = 0
EXIT_FINDING = 1
EXIT_USAGE = 2
EXIT_UNEXPECTED = 3

JSON_HELP = "Print the result as JSON on stdout instead of tables."


def json_text(obj: Any) -> str:
    """``obj`` as indented, strict JSON: a NaN or infinity (a figure nobody measured, such as
    a modelled overhead) becomes ``null``, since JSON has no token for it; anything else JSON
    cannot hold becomes its ``str``."""
    return json.dumps(_finite(obj), indent=2, default=str, allow_nan=False)


def _finite(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if isinstance(obj, numbers.Real) and not isinstance(obj, numbers.Integral):
        f = float(obj)  # also NumPy's floats, which json would write as their str
        return f if math.isfinite(f) else None
    return obj


def emit_json(obj: Any) -> None:
    """Write ``obj`` as indented JSON on stdout, alone (nothing else goes to stdout); see
    :func:`json_text`."""
    Console().out(json_text(obj), highlight=False)


def file_out(value: Path | None) -> Path | None:
    """Option callback: an output file the command can write at its end (checked before any
    work): not a folder, in a folder that exists, outside every checkpoint root."""
    if value is None:
        return None
    if value.is_dir():
        raise typer.BadParameter(f"{value} is a folder; give a file name")
    if value.parent.exists() and not value.parent.is_dir():
        raise typer.BadParameter(f"{value.parent} is a file, not a folder; give a path in a folder")
    if not value.parent.is_dir():
        raise typer.BadParameter(f"no folder {value.parent}; create it first")
    _outside_roots(value, typer.BadParameter)
    return value


def folder_out(value: Path | None) -> Path | None:
    """Option callback: an output folder (made if missing), not an existing file, not in a
    checkpoint root."""
    if value is not None and value.exists() and not value.is_dir():
        raise typer.BadParameter(f"{value} is a file; give a folder (made if missing)")
    if value is not None:
        _outside_roots(value, typer.BadParameter)
    return value


def checkpoint_root_of(path: str | os.PathLike[str]) -> Path | None:
    """The stalwart checkpoint root ``path`` is or lies in (links followed), else None.

    A root is recognised by its markers (docs/format.md): a ``manifests/`` folder holding a
    committed step's manifest, or ``manifests/`` beside ``packs/`` (a root before its first
    commit). A ``manifests/`` folder alone (a Kubernetes repository's, say) is no root.
    """
    resolved = Path(path).resolve()
    for folder in (resolved, *resolved.parents):
        manifests = folder / "manifests"
        if manifests.is_dir() and ((folder / "packs").is_dir() or _holds_manifest(manifests)):
            return folder
    return None


def _holds_manifest(folder: Path) -> bool:
    from stalwart.checkpoint.durable.manifest import step_from_key  # only where one may be

    with contextlib.suppress(OSError):
        return any(step_from_key(f"manifests/{p.name}") is not None for p in folder.iterdir())
    return False


def _outside_roots(path: Path, error: Callable[[str], Exception], what: str = "") -> None:
    root = checkpoint_root_of(path)
    if root is not None:
        raise error(
            f"{what}{path} is inside the checkpoint root {root}; writing there could replace "
            "or confuse the checkpoint's own files: write it outside the root"
        )


def check_outputs(
    outputs: Mapping[str, Path | None], inputs: Mapping[str, Path | None] | None = None
) -> None:
    """Refuse outputs that would destroy data, before any work: an output (keyed by its
    option, ``--html``) that is one of the command's ``inputs`` (keyed by how to name it, such
    as ``--inputs plan.toml``), lies in a checkpoint root, or names the same file as another
    output. Regenerating an earlier report stays allowed.

    Raises:
        ConfigError: what is wrong with which option, and what to do (exit 2 in a command).
    """
    given = [(opt, p) for opt, p in outputs.items() if p is not None]
    for i, (opt, out) in enumerate(given):
        for what, src in (inputs or {}).items():
            if src is not None and _same(out, src):
                raise ConfigError(
                    f"{opt} {out} would replace {what}, which the command reads; give the "
                    "output another file name"
                )
        for earlier, other in given[:i]:
            if _same(out, other):
                raise ConfigError(f"{earlier} and {opt} both name {out}; give each its own file")
        _outside_roots(out, ConfigError, f"{opt} ")


def _same(a: Path, b: Path) -> bool:
    with contextlib.suppress(OSError):
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()  # one is not there yet: the same path?


def write_file(path: Path, data: str | bytes | Callable[[Path], object]) -> Path:
    """Write one output file of a command atomically (see :func:`staged_files`): ``data`` as
    text (UTF-8) or bytes, or ``data(tmp)`` writes a file at the path it is given."""
    with staged_files(path.parent) as staging:
        tmp = staging / path.name
        if isinstance(data, str):
            tmp.write_text(data, encoding="utf-8")
        elif isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            data(tmp)
    return path


@contextlib.contextmanager
def staged_files(folder: Path) -> Iterator[Path]:
    """A staging folder inside ``folder`` (made if missing) for a command's output files.

    Leaving the block normally fsyncs each file written there and renames it over its
    namesake in ``folder``; an error removes the staging folder, so the earlier files stay
    whole and no partial one appears. A full disk (``ENOSPC``, ``EDQUOT``) raises
    :class:`StorageFullError` naming the files and what to do.
    """
    folder.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".stalwart-", dir=folder))
    written = ""
    try:
        yield staging
        for tmp in sorted(staging.iterdir()):
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, folder / tmp.name)
    except OSError as e:
        if disk_full(e, folder):
            with contextlib.suppress(OSError):  # name the files being written
                written = ", ".join(str(folder / p.name) for p in sorted(staging.iterdir()))
            raise StorageFullError(
                f"no space left on the device writing {written or folder}; free space there or "
                "write the output elsewhere (what was there before is unchanged)"
            ) from e
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


_FULL = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})


def disk_full(e: BaseException, folder: Path) -> bool:
    """Whether ``e`` (an ``OSError``) means a full disk: its errno says so, or (a library's
    I/O error without one, such as pyarrow's) ``folder``'s file system has next to no room."""
    if not isinstance(e, OSError):
        return False
    if e.errno is not None:
        return e.errno in _FULL
    with contextlib.suppress(OSError):
        return shutil.disk_usage(folder).free < 1 << 20
    return False


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """Expected failures become one red line on stderr and a documented exit code.

    Damaged data (:class:`CorruptCheckpointError`) exits with 1; any other stalwart or OS
    error (a bad argument, a missing file, root, step or extra) exits with 2.
    """
    try:
        yield
    except (StalwartError, OSError) as e:
        Console(stderr=True).print(f"[red]error:[/] {escape(cli_hint(str(e)))}")
        code = EXIT_FINDING if isinstance(e, CorruptCheckpointError) else EXIT_USAGE
        raise typer.Exit(code) from None


_CLI_HINTS = (
    (  # fallback=True is an argument of Checkpointer.load; not every command takes --step
        re.compile(r"(?:load an earlier step,? or )?use fallback=True"),
        "use an earlier, intact step (`stalwart ckpt verify ROOT` shows which; "
        "`stalwart ckpt rm ROOT N` removes a damaged one)",
    ),
    (  # overwrite=True of save, import_file, import_dcp, StalwartWriter is --overwrite
        re.compile(
            r"pass (?:[\w.]+\(\.\.\., overwrite=True\)(?: or )?)+"
            r"|pass overwrite=True(?: \((?:CLI: )?--overwrite\))?"
        ),
        "pass --overwrite",
    ),
)


def cli_hint(message: str) -> str:
    """``message`` with the library's Python advice told the command line's way:
    ``fallback=True`` becomes ``--step`` of an intact step, ``overwrite=True`` ``--overwrite``."""
    for pattern, cli in _CLI_HINTS:
        message = pattern.sub(cli, message)
    return message


def plain_switches(cmd: Any) -> None:
    """Show boolean flags (``--json``, ``--help``, ``--fresh/--no-fresh``) as bare switches in
    the help of ``cmd`` and every command under it, not followed by a ``<bool>`` value they
    do not take. Typer labels every option with its type; an empty metavar hides the label."""
    _plain([*cmd.params, cmd.get_help_option(typer.Context(cmd))])  # the help option is cached
    for sub in getattr(cmd, "commands", {}).values():
        plain_switches(sub)


def _plain(params: list[Any]) -> None:
    for p in params:
        if isinstance(p, TyperOption) and p.is_flag and p.metavar is None:
            p.metavar = ""


class GuardedGroup(TyperGroup):
    """The root command group: an exception no command handled exits with 3, not 1.

    Click turns usage errors into exit 2 and ``typer.Exit`` carries the command's own code;
    anything else is a bug or an unforeseen failure, reported in one line (the traceback
    with ``-v``) so that scripts can tell it from "damage found" (1).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        plain_switches(self)

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)
        _plain(params)  # typer adds --install-completion and --show-completion after __init__
        return params

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except (KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except BaseException as e:  # torch's CheckpointException is a BaseException too
            if _control_flow(e):
                raise
            raise typer.Exit(_report(e, verbose=bool(ctx.params.get("verbose")))) from None


_CONTROL = {"ClickException", "Exit", "Abort"}


def _control_flow(e: BaseException) -> bool:
    """Click's and typer's own signals (usage errors, exits, aborts), whichever copy of
    click raised them (typer >= 0.29 vendors its own)."""
    return any(
        c.__name__ in _CONTROL and c.__module__.startswith(("click", "typer"))
        for c in type(e).__mro__
    )


def _report(e: BaseException, *, verbose: bool) -> int:
    """Print ``e`` on stderr the way its kind deserves; return the exit code."""
    err = Console(stderr=True)
    if verbose or logging.getLogger().isEnabledFor(logging.DEBUG):  # a user's error too: its
        err.out("".join(traceback.format_exception(e)), highlight=False)  # cause is chained
    if isinstance(e, (StalwartError, OSError)):  # a command without its own handled()
        err.print(f"[red]error:[/] {escape(cli_hint(str(e)))}")
        return EXIT_FINDING if isinstance(e, CorruptCheckpointError) else EXIT_USAGE
    err.print(
        f"[red]unexpected error:[/] {escape(type(e).__name__)}: {escape(str(e))}\n"
        "This is a bug or an unforeseen failure; run again with `stalwart -v ...` for the "
        "traceback and report it."
    )
    return EXIT_UNEXPECTED
