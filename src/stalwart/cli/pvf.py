"""``stalwart pvf``: run a weight-fault campaign on a model and report PVF with intervals.

MODEL_SPEC is a reference model name (``digits-cnn``, ``mlp``, ``dlrm``, ``gcn``,
``transformer``) or ``package.module:factory``, where ``factory()`` returns a
:class:`stalwart.models.ReferenceModel` or a tuple ``(model, inputs[, labels])``.
Exit codes as for every command (:mod:`stalwart.cli.conventions`): 0 on success, 2 on bad
input (one red line on stderr, never a traceback); choices are checked before any work.
"""

from __future__ import annotations

import enum
import importlib
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from rich.console import Console
from rich.table import Table

from stalwart.cli.conventions import JSON_HELP, emit_json, handled
from stalwart.errors import ConfigError

__all__ = ["handled", "load_spec", "pvf_command", "register"]

_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp64": torch.float64,
}


# The library's names as option choices (click rejects others before any work starts), copied
# so that ``--help`` needs no SciPy; tests/unit/test_cli_surface.py keeps them equal.
class By(str, enum.Enum):
    """``--by``: how trials are grouped."""

    tensor = "tensor"
    layer = "layer"
    module = "module"
    param = "param"
    part = "part"
    bit = "bit"
    field = "field"
    dtype = "dtype"
    component = "component"
    all = "all"


class Error(str, enum.Enum):
    """``--error``: the error model of each fault."""

    bitflip = "bitflip"
    multibit = "multibit"
    burst = "burst"
    stuck_at = "stuck_at"
    random_value = "random_value"


class Dtype(str, enum.Enum):
    """``--dtype``: the dtype the model runs in."""

    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"
    fp64 = "fp64"


class Interval(str, enum.Enum):
    """``--interval``: the confidence interval."""

    wilson = "wilson"
    clopper_pearson = "clopper-pearson"


class Engine(str, enum.Enum):
    """``--engine``: the campaign engine."""

    fast = "fast"
    naive = "naive"
    copy = "copy"


def check_criteria(names: list[str]) -> None:
    """Reject a misspelt criterion before the model is built (which may mean training it)."""
    from stalwart.vulnerability.criteria import criterion

    for name in names:
        criterion(name)


def load_spec(spec: str, dtype: str = "fp32") -> Any:
    """A :class:`ReferenceModel` from a reference name or ``package.module:factory``."""
    from stalwart import models

    if ":" in spec:
        mod, _, fn = spec.partition(":")
        try:
            obj = getattr(importlib.import_module(mod), fn)()
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"cannot load {spec!r} ({e}); give package.module:factory") from e
        if not isinstance(obj, models.ReferenceModel):
            if not isinstance(obj, tuple) or len(obj) not in (2, 3):
                raise ConfigError(
                    f"{spec} must return a ReferenceModel or (model, inputs[, labels])"
                )
            model, inputs, *labels = obj
            inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
            lab = labels[0] if labels else torch.zeros(0)
            obj = models.ReferenceModel(spec, model.eval(), inputs, lab, ("top1",), "accuracy")
        ref = obj
    else:
        ref = models.load(spec)
    if dtype not in _DTYPES:
        raise ConfigError(
            f"--dtype {dtype!r}: use one of {', '.join(_DTYPES)} (fp8/int8 weights "
            "cannot run a forward pass; inject into them with the Python API)"
        )
    if _DTYPES[dtype] is not torch.float32:
        import copy

        ref = copy.copy(ref)
        ref.model = copy.deepcopy(ref.model).to(_DTYPES[dtype])
        ref.inputs = tuple(t.to(_DTYPES[dtype]) if t.is_floating_point() else t for t in ref.inputs)
    return ref


def pvf_command(
    model_spec: Annotated[
        str, typer.Argument(help="Reference model name or package.module:factory.")
    ],
    trials: Annotated[int, typer.Option(min=1, help="Faults (per tensor when stratified).")] = 2000,
    by: Annotated[By, typer.Option(help="Group the trials by this.")] = By["bit"],
    criterion: Annotated[
        list[str] | None,
        typer.Option(
            "--criterion", "-c", help="Criterion (repeatable); default: the model's first."
        ),
    ] = None,
    targets: Annotated[str, typer.Option(help="Glob of parameters to corrupt.")] = "*",
    error: Annotated[Error, typer.Option(help="Error model of each fault.")] = Error["bitflip"],
    dtype: Annotated[Dtype, typer.Option(help="Run the model in this dtype.")] = Dtype["fp32"],
    seed: Annotated[int, typer.Option(help="Fault-list seed.")] = 0,
    margin: Annotated[
        float | None,
        typer.Option(help="Add rounds until every interval half-width is at most this."),
    ] = None,
    confidence: Annotated[float, typer.Option(help="Interval confidence.")] = 0.95,
    interval: Annotated[Interval, typer.Option(help="Confidence interval.")] = Interval["wilson"],
    engine: Annotated[Engine, typer.Option(help="Campaign engine.")] = Engine["fast"],
    out: Annotated[
        Path | None, typer.Option(help="Write trials.parquet/csv, pvf.json, report.html here.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
) -> None:
    """Estimate PVF (probability that one fault makes the output wrong) per group."""
    from stalwart import vulnerability as vuln
    from stalwart.vulnerability.report import write_outputs

    with handled():
        check_criteria(criterion or [])
        ref = load_spec(model_spec, dtype.value)
        crits = criterion or [ref.criteria[0]]
        labels = ref.labels if len(ref.labels) else None
        stop: vuln.StoppingRule = (
            vuln.FixedTrials(trials) if margin is None else vuln.UntilWidth(margin, trials=trials)
        )
        options = vuln.PVFOptions(
            by=by.value,
            stop=stop,
            seed=seed,
            targets=targets,
            error=error.value,
            confidence=confidence,
            interval=vuln.Interval(interval.value),
            engine=vuln.Engine(engine.value),
        )
        report = vuln.pvf(
            ref.model, ref.inputs, crits, options, labels=labels, progress=not as_json
        )
        if as_json:
            emit_json(report.to_dict())
        else:
            _print(Console(), report, model_spec)
        if out is not None:
            paths = write_outputs(report, out, title=f"PVF of {model_spec}")
            Console(stderr=as_json).print(f"wrote {', '.join(str(p) for p in paths.values())}")


def _print(console: Console, report: Any, spec: str) -> None:
    for c in report.criteria:
        table = Table(
            title=f"PVF of {spec} by {report.by} "
            f"({c}, {int(report.confidence * 100)} % {report.method})"
        )
        for col in ("group", "trials", "failures", "pvf", "interval", "per-inference rate"):
            table.add_column(col, justify="left" if col == "group" else "right")
        for r in report.rows:
            if r.criterion == c:
                rate = "—" if r.rate != r.rate else f"{r.rate:.2e}"
                table.add_row(
                    r.group,
                    str(r.trials),
                    str(r.failures),
                    f"{r.pvf:.4f}",
                    f"[{r.low:.4f}, {r.high:.4f}]",
                    rate,
                )
        console.print(table)
        p, lo, hi = report.overall[c]
        console.print(f"model-level PVF ({c}): {p:.4f} [{lo:.4f}, {hi:.4f}]")
    m = report.result.manifest
    console.print(
        f"{m['trials']} trials in {m['seconds']:.1f} s ({m['trials_per_s']:,.0f}/s, "
        f"engine {m['engine']}, "
        f"{m['rechecked']} re-run exactly); model hash {m['model_hash']}"
    )


def register(app: typer.Typer) -> None:
    """Add the ``pvf`` command to ``app``."""
    app.command("pvf")(pvf_command)
