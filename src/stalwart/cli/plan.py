"""``stalwart plan``: how often to save to each tier, and what the recovery ladder buys at a
given scale, for checkpoint-restart, stalwart without its memory tier and stalwart's ladder.

Inputs, later ones winning: the defaults (Llama 3's job and failure rates, stalwart's costs
measured here; every source printed by ``--json``), ``--inputs FILE`` (TOML or JSON with
``[job]``, ``[fleet]``, ``[tiers.*]``, ``[costs]``), ``--fleet`` (a preset of failure rates),
``--costs FILE`` (costs alone, as a probe would write them), the options, then ``--set
SECTION.FIELD=VALUE``. Every figure printed is modelled, not measured. Exit codes as for every
command (:mod:`stalwart.cli.conventions`): 0 on success, 2 on bad input (one red line).
"""

from __future__ import annotations

import enum
import json
import math
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from stalwart.cli.conventions import (
    JSON_HELP,
    check_outputs,
    emit_json,
    file_out,
    handled,
    write_file,
)
from stalwart.errors import ConfigError

__all__ = ["plan_command", "register"]


# The choices of --fleet (failure rates of a public report) and --strategy (the library's
# stalwart.plan.Strategy values, kept equal by tests/unit/plan/test_cli_plan.py), spelled out so
# that no command imports the planner before it runs.
Preset = enum.Enum("Preset", {"llama3": "llama3", "meta_rsc1": "meta-rsc1",
                              "meta_rsc2": "meta-rsc2"}, type=str, module=__name__)  # fmt: skip
StrategyName = enum.Enum("StrategyName", {"checkpoint_restart": "checkpoint-restart",
                         "no_memory": "stalwart-no-memory", "ladder": "stalwart-ladder"},
                         type=str, module=__name__)  # fmt: skip

_Inputs = Annotated[Path | None, typer.Option("--inputs", help="TOML or JSON file of inputs.")]
_Costs = Annotated[Path | None, typer.Option("--costs", help="TOML or JSON file of costs.")]
_Fleet = Annotated[Preset | None, typer.Option("--fleet", help="Failure rates of a report.")]
_Accel = Annotated[int | None, typer.Option("--accelerators", min=1, help="Ranks in the job.")]
_Group = Annotated[
    int | None, typer.Option("--group-size", min=1, help="Ranks per replica (full copy).")
]


def _finite(value: float | None) -> float | None:
    """Option callback: a real, finite number (inf or nan is no size nor time to plan)."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number; give a positive number")
    return value


_State = Annotated[
    float | None, typer.Option("--state-gb", callback=_finite, help="State per rank, GB.")
]
_Step = Annotated[
    float | None, typer.Option("--step-s", callback=_finite, help="Seconds per training step.")
]
_Set = Annotated[
    list[str],
    typer.Option("--set", help="Any input: SECTION.FIELD=VALUE (tiers.disk.interval_s=600)."),
]
_Strategy = Annotated[
    list[StrategyName], typer.Option("--strategy", help="Strategies to model (default: all).")
]
_Simulate = Annotated[
    bool, typer.Option("--simulate/--no-simulate", help="Run the discrete-event simulation.")
]
_Failures = Annotated[int, typer.Option("--failures", min=20, help="Simulated failures.")]
_Seed = Annotated[int, typer.Option("--seed", min=0, help="Root seed of the simulation.")]
_Sizes = Annotated[
    str | None, typer.Option("--sizes", help="Job sizes for the scaling table: 1024,4096,16384.")
]
_Plot = Annotated[Path | None, typer.Option(
    "--plot", callback=file_out, help="Write ETTR against job size here."
)]  # fmt: skip
_Json = Annotated[bool, typer.Option("--json", metavar="", help=JSON_HELP)]


def plan_command(
    inputs: _Inputs = None,
    costs: _Costs = None,
    fleet: _Fleet = None,
    accelerators: _Accel = None,
    group_size: _Group = None,
    state_gb: _State = None,
    step_s: _Step = None,
    set_: _Set = [],  # noqa: B006 - typer reads the default
    strategy: _Strategy = [],  # noqa: B006
    simulate: _Simulate = True,
    failures: _Failures = 2_000,
    seed: _Seed = 0,
    sizes: _Sizes = None,
    plot: _Plot = None,
    as_json: _Json = False,
) -> None:
    """Model checkpoint intervals and ETTR (goodput) for a job at scale."""
    from stalwart.plan import plan

    with handled():
        check_outputs({"--plot": plot}, {f"--inputs {inputs}": inputs, f"--costs {costs}": costs})
        options = {"job.accelerators": accelerators, "job.group_size": group_size,
                   "job.state_gb": state_gb, "job.step_s": step_s}  # fmt: skip
        given = _inputs(inputs, costs, fleet, options, set_)
        chosen = [s.value for s in strategy] or [s.value for s in StrategyName]
        scale = _sizes(sizes) or ((1024, 2048, 4096, 8192, 16384) if plot else ())
        result = plan(given, strategies=chosen, sizes=scale, simulate=simulate,
                      failures=failures, seed=seed)  # fmt: skip
        if plot is not None:
            write_file(plot, result.plot)
    if as_json:
        emit_json(result.to_dict())
        return
    out = Console()
    out.print(result.table())
    for note in (f"{p.strategy}: {n}" for p in result.plans for n in p.notes):
        out.print(f"[yellow]{note}[/]")
    if result.scaling:
        out.print(_scaling_table(result))
    out.print(f"[dim]{_provenance(result.sources)}[/]")
    if plot is not None:
        out.print(f"plot: {plot}")


def _inputs(path: Path | None, costs: Path | None, fleet: Preset | None,
            options: dict[str, Any], sets: list[str]) -> Any:  # fmt: skip
    """The inputs, later sources winning (module docstring)."""
    import dataclasses

    from stalwart.plan import Fleet, PlanInputs, read_costs, read_inputs

    given = read_inputs(path) if path is not None else PlanInputs()
    if fleet is not None:
        preset = Fleet.llama3() if fleet.value == "llama3" else Fleet.meta_rsc(fleet.value[5:])
        given = dataclasses.replace(given, fleet=preset)
    if costs is not None:
        given = dataclasses.replace(given, costs=read_costs(costs))
    changes = {k: v for k, v in options.items() if v is not None}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"--set {item!r}: write SECTION.FIELD=VALUE")
        changes[key.strip()] = _value(value.strip())
    if "job.group_size" not in changes:
        _fit_group(given.job.group_size, changes.get("job.accelerators"))
    return given.replace(**changes) if changes else given


def _fit_group(group: int, n: Any) -> None:
    """A job size given without a group size must be a multiple of the one it keeps (Llama
    3's 128 by default): say which option fixes it, not only which field of Job is wrong."""
    if not isinstance(n, int) or n < 1 or n % group == 0:
        return
    fits = [d for d in range(1, min(group, n - 1) + 1) if n % d == 0]
    example = f"--group-size {fits[-1]} ({n // fits[-1]} replicas), or " if fits else ""
    raise ConfigError(
        f"the replica group size {group} (the default, or --inputs' job.group_size) must divide "
        f"accelerators ({n}); pass --group-size G dividing {n}, e.g. {example}--group-size {n} "
        "(no live replica to heal from)"
    )


def _value(text: str) -> Any:
    """A --set value: a JSON number, true/false/null, or else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _sizes(text: str | None) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise typer.BadParameter(f"--sizes {text!r}: give whole numbers, 1024,4096,16384") from None
    if not sizes or min(sizes) < 1:
        raise typer.BadParameter(f"--sizes {text!r}: give positive whole numbers")
    return sizes


def _scaling_table(result: Any) -> Table:
    strategies = list(dict.fromkeys(p.strategy for p in result.scaling))
    table = Table(title="Modelled ETTR against job size", title_justify="left")
    table.add_column("accelerators", justify="right")
    for s in strategies:
        table.add_column(s, justify="right")
    for n in dict.fromkeys(p.accelerators for p in result.scaling):
        row = {p.strategy: p for p in result.scaling if p.accelerators == n}
        cells = [_ettr(row[s]) for s in strategies]
        table.add_row(f"{n:,}", *cells)
    return table


def _ettr(point: Any) -> str:
    if point.simulated == point.simulated:  # not NaN: simulated
        return f"{point.simulated:.2%} ± {point.ci:.2%}"
    return f"{point.analytic:.2%} (closed form)"


def _provenance(sources: dict[str, str]) -> str:
    kinds = ("public", "derived", "measured here", "assumption", "given")
    counts = {k: sum(1 for v in sources.values() if v.startswith(k)) for k in kinds}
    listed = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
    return f"Modelled, not measured. Inputs: {listed}; --json lists every source."


def register(app: typer.Typer) -> None:
    """Add the ``plan`` command to ``app``."""
    app.command("plan")(plan_command)
