"""``stalwart demo``: SIGKILL a training run, resume it from its checkpoint, check it bit for bit."""

from __future__ import annotations

import shutil
from pathlib import Path

import typer
from rich.console import Console

from stalwart.demo import REPORT_NAME, run_demo
from stalwart.errors import ConfigError

__all__ = ["demo", "register"]


def demo(
    root: Path = typer.Option(
        Path("stalwart-demo"),
        help="Folder for the demo's checkpoints (ROOT/run) and report; created if missing.",
    ),
    steps: int = typer.Option(300, min=2, help="Training steps of the whole run."),
    every: int = typer.Option(25, min=1, help="Save a checkpoint every this many steps."),
    fresh: bool = typer.Option(
        True, help="Delete ROOT/run from an earlier demo first, so the demo starts clean."
    ),
) -> None:
    """Kill a training run with SIGKILL, resume it, and prove the resume is bit-identical.

    Trains a small model three ways on CPU: straight through; in a child process that saves
    a checkpoint every EVERY steps and is killed mid-run; and resumed from the newest
    checkpoint. Exits with status 1 unless the resumed run equals the uninterrupted one.
    """
    console = Console()
    root = root.absolute()
    run_root = root / "run"
    if fresh and run_root.exists():
        if not (root / REPORT_NAME).is_file():
            console.print(
                f"[red]{run_root} exists but {root} holds no {REPORT_NAME}, so it was not "
                "made by the demo; not deleting it. Pick another --root.[/]"
            )
            raise typer.Exit(code=2)
        shutil.rmtree(run_root)
    root.mkdir(parents=True, exist_ok=True)
    try:
        report = run_demo(root, steps=steps, checkpoint_every=every, console=console)
    except ConfigError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(code=2) from e
    if not report.ok:
        raise typer.Exit(code=1)


def register(app: typer.Typer) -> None:
    """Add the ``demo`` command to ``app``."""
    app.command("demo")(demo)
