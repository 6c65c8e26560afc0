"""Entry point of the ``stalwart`` command: builds the typer app from the command modules."""

from __future__ import annotations

import logging

import typer
from rich.console import Console
from rich.logging import RichHandler

from stalwart.cli import ckpt, demo, protect, pvf, rca, run

app = typer.Typer(
    name="stalwart",
    help="Keep PyTorch training alive through faults, and find out why they happened.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _main(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log progress details."),
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

if __name__ == "__main__":
    app()
