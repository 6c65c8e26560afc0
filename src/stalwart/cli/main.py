"""Entry point of the ``stalwart`` command: builds the typer app from the command modules.

``stalwart`` and ``python -m stalwart`` are the same app. Exit codes and the meaning of
``--json`` are the same for every command: see :mod:`stalwart.cli.conventions`.
Shell completion: ``stalwart --install-completion`` (bash, zsh, fish, PowerShell).
"""

from __future__ import annotations

import logging

import typer
from rich.console import Console
from rich.logging import RichHandler

from stalwart.cli import ckpt, demo, plan, protect, pvf, rca, run
from stalwart.cli.conventions import GuardedGroup

app = typer.Typer(
    name="stalwart",
    help="Keep PyTorch training alive through faults, and find out why they happened.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    cls=GuardedGroup,
    epilog="Exit codes: 0 ok, 1 damage or a failed check found, 2 usage error, "
    "3 unexpected error (run with -v for the traceback).",
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"stalwart {version('stalwart')}")
        except PackageNotFoundError:  # a source tree on sys.path, not installed
            typer.echo("stalwart (not installed; version unknown)")
        raise typer.Exit()


@app.callback()
def _main(
    verbose: bool = typer.Option(
        False, "--verbose", "-v", help="Log progress details; print tracebacks of crashes."
    ),
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(message)s",
        # stderr: stdout carries results (--json) that logging must never interleave with
        handlers=[RichHandler(console=Console(stderr=True), show_path=False)],
    )


demo.register(app)
ckpt.register(app)
pvf.register(app)
protect.register(app)
rca.register(app)
run.register(app)
plan.register(app)

if __name__ == "__main__":
    app()
