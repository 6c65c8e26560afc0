"""``stalwart demo``: the main job, one section per part of stalwart.

Checkpoints (SIGKILL a training run, resume it, check it bit for bit), peers' memory (lose a
rank, rebuild it by erasure decoding), silent corruption (a short PVF campaign) and root
cause (a generated failure log analysed).
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from stalwart.cli.conventions import JSON_HELP, emit_json, folder_out
from stalwart.demos.resume import REPORT_NAME, run_demo
from stalwart.errors import ConfigError, MissingDependencyError, require

__all__ = ["demo", "register"]

# What each optional section imports, checked before the run rather than a minute into it.
_SECTION_NEEDS = {
    "pvf": (("scipy", "sdc"), ("pyarrow", "sdc"), ("sklearn", "sdc")),
    "rca": (("duckdb", "rca"), ("pyarrow", "rca")),
}


def _check_extras(sections: dict[str, bool]) -> None:
    """Raise MissingDependencyError, with the flag that skips it, when a section lacks its extra."""
    for section, wanted in sections.items():
        for module, extra in _SECTION_NEEDS[section] if wanted else ():
            try:
                require(module, extra, f"the demo's {section} section")
            except MissingDependencyError as e:
                raise MissingDependencyError(f"{e}; or pass --no-{section}") from e.__cause__


_Root = Annotated[Path, typer.Option(
    callback=folder_out, help="Folder for the demo's checkpoints (ROOT/run) and its report."
)]  # fmt: skip


def demo(
    root: _Root = Path("stalwart-demo"),
    steps: Annotated[int, typer.Option(min=2, help="Training steps of the whole run.")] = 300,
    every: Annotated[int, typer.Option(min=1, help="Checkpoint every this many steps.")] = 25,
    fresh: Annotated[
        bool, typer.Option(help="Delete ROOT/run of an earlier demo first, to start clean.")
    ] = True,
    recovery: Annotated[
        bool, typer.Option(help="Also lose a rank of 5 and rebuild it from peers' memory.")
    ] = True,
    pvf: Annotated[bool, typer.Option(help="Also run a short PVF campaign.")] = True,
    rca: Annotated[bool, typer.Option(help="Also analyse a generated failure log.")] = True,
    elastic: Annotated[
        bool, typer.Option(help="Also train 3 elastic workers; kill one, pause one, heal both.")
    ] = True,
    as_json: Annotated[
        bool, typer.Option("--json", help=JSON_HELP + " (progress goes to stderr)")
    ] = False,
) -> None:
    """The main job: crash and resume bit-identically, rebuild a lost rank, PVF, root cause.

    Trains a small model on CPU straight through, then in a child process that checkpoints
    every EVERY steps and is SIGKILLed mid-run, then resumed from the newest checkpoint;
    then loses a rank of 5 and rebuilds it from its peers' memory, runs a short PVF campaign
    and analyses a generated failure log; then trains 3 elastic workers, kills one and
    pauses one, and heals both replacements from the survivor.

    Exits with status 1 (a finding) unless the resumed run equals the uninterrupted one (and
    the rebuilt rank equals its lost state, and the elastic members' digests are equal).
    """
    started = time.perf_counter()
    console = Console(stderr=as_json)  # with --json, stdout carries the summary alone
    try:
        _check_extras({"pvf": pvf, "rca": rca})
    except MissingDependencyError as e:
        console.print(str(e), style="red", markup=False)
        raise typer.Exit(code=2) from e
    root = root.absolute()
    run_root = root / "run"
    if fresh and run_root.exists():
        if not (root / REPORT_NAME).is_file():
            console.print(
                f"{run_root} exists but {root} holds no {REPORT_NAME}, so it was not made by "
                "the demo; not deleting it. Pick another --root.",
                style="red",
                markup=False,
            )
            raise typer.Exit(code=2)
        shutil.rmtree(run_root)
    root.mkdir(parents=True, exist_ok=True)
    try:
        report = run_demo(root, steps=steps, checkpoint_every=every, console=console)
    except ConfigError as e:
        console.print(str(e), style="red", markup=False)
        raise typer.Exit(code=2) from e
    summary: dict[str, object] = {"resume": dataclasses.asdict(report), "resume_ok": report.ok}
    ok = report.ok
    if recovery:
        from stalwart.demos.recovery import run_recovery_demo

        summary["recovery_ok"] = run_recovery_demo(console)
        ok = bool(summary["recovery_ok"]) and ok
    if pvf:
        from stalwart.demos.pvf import run_pvf_demo

        summary["pvf"] = run_pvf_demo(console).to_dict()
    if rca:
        from stalwart.demos.rca import run_rca_demo

        summary["rca"] = run_rca_demo(console).to_dict()
    if elastic:
        from stalwart.demos.elastic import run_elastic_demo

        summary["elastic_ok"] = run_elastic_demo(console)
        ok = bool(summary["elastic_ok"]) and ok
    seconds = time.perf_counter() - started
    console.print(f"demo finished in {seconds:.1f} s; folder: {root}")
    if as_json:
        emit_json({"ok": ok, "root": str(root), "seconds": seconds, **summary})
    if not ok:
        raise typer.Exit(code=1)


def register(app: typer.Typer) -> None:
    """Add the ``demo`` command to ``app``."""
    app.command("demo")(demo)
