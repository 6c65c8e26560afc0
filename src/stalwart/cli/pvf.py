"""``stalwart pvf``: run a weight-fault campaign on a model and report PVF with intervals.

MODEL_SPEC is a reference model name (``digits-cnn``, ``mlp``, ``dlrm``, ``gcn``,
``transformer``) or ``package.module:factory``, where ``factory()`` returns a
:class:`stalwart.models.ReferenceModel` or a tuple ``(model, inputs[, labels])``.
``--workers N`` shards the campaign over N processes (``--backend torch``, the default),
Ray actors (``ray``) or runs the shards one after another here (``local``) through
:mod:`stalwart.vulnerability.scale`; the report equals the one-process one. With
``--campaign-dir`` the finished shards are kept there, and the same command after a crash
re-runs only the missing ones. Exit codes as for every command
(:mod:`stalwart.cli.conventions`): 0 on success, 2 on bad input (one red line on stderr,
never a traceback); choices are checked before any work.
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from rich.console import Console
from rich.table import Table

from stalwart.cli.conventions import JSON_HELP, emit_json, folder_out, handled, staged_files
from stalwart.errors import ConfigError

__all__ = ["handled", "load_spec", "pvf_command", "register"]

_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp64": torch.float64,
}


# The library's names as option choices (click rejects others before any work starts), copied
# so that no ``stalwart`` command pays for importing the vulnerability package (~50 ms) before
# it needs it; tests/unit/test_cli_surface.py keeps them equal. Each is a ``StrEnum`` whose
# members are named and valued by the words listed (``By["bit"].value == "bit"``).
By = StrEnum("By", "tensor layer module param part bit field dtype component all")
"""``--by``: how trials are grouped."""
Error = StrEnum("Error", "bitflip multibit burst stuck_at random_value")
"""``--error``: the error model of each fault."""
Dtype = StrEnum("Dtype", "fp32 fp16 bf16 fp64")
"""``--dtype``: the dtype the model runs in (the keys of ``_DTYPES``)."""
Interval = StrEnum("Interval", "wilson clopper-pearson")
"""``--interval``: the confidence interval."""
Engine = StrEnum("Engine", "fast naive copy")
"""``--engine``: the campaign engine."""
Backend = StrEnum("Backend", "local torch ray")
"""``--backend``: where the shards of a ``--workers`` campaign run."""
_Out = Annotated[Path | None, typer.Option(
    callback=folder_out, help="Write trials.parquet/csv, pvf.json, report.html here."
)]  # fmt: skip
_CampaignDir = Annotated[Path | None, typer.Option(
    callback=folder_out, help="Keep finished shards here; rerun to resume (implies sharding)."
)]  # fmt: skip
_Component = Annotated[list[str] | None, typer.Option(
    "--component", help="With --by component: NAME=GLOB puts the tensors the glob matches in "
    "group NAME (repeatable; NAME again adds a glob; the rest are 'other')."
)]  # fmt: skip


def check_criteria(names: list[str]) -> None:
    """Reject a misspelt criterion before the model is built (which may mean training it)."""
    from stalwart.vulnerability.criteria import criterion

    for name in names:
        criterion(name)


def parse_components(specs: list[str], by: str) -> dict[str, list[str]] | None:
    """``--component NAME=GLOB`` options as ``PVFOptions.components`` (None without any),
    checked before any work: a group needs a name and a glob, and they need ``--by component``
    (as ``--by component`` needs them)."""
    example = "e.g. --by component --component convs='conv*' --component head='fc*'"
    if not specs:
        if by == "component":
            raise ConfigError(
                f"--by component needs its groups: give --component NAME=GLOB, {example}"
            )
        return None
    if by != "component":
        raise ConfigError(
            f"--component groups the trials only with --by component (got --by {by}): add "
            "--by component, or drop --component"
        )
    out: dict[str, list[str]] = {}
    for spec in specs:
        name, eq, glob = (part.strip() for part in spec.partition("="))
        if not (eq and name and glob):
            raise ConfigError(f"--component {spec!r}: give NAME=GLOB, {example}")
        out.setdefault(name, []).append(glob)
    return out


def check_components(model: torch.nn.Module, components: dict[str, list[str]] | None) -> None:
    """Every ``--component`` glob must match a tensor of the model (else its group is empty)."""
    from stalwart.inject.targets import select_tensors

    for name, globs in (components or {}).items():
        for glob in globs:
            try:
                select_tensors(model, glob, quantized=True)
            except ConfigError as e:
                raise ConfigError(f"--component {name}={glob}: {e}") from None


def load_spec(spec: str, dtype: str = "fp32") -> Any:
    """A :class:`ReferenceModel` from a reference name or ``package.module:factory``."""
    from stalwart import models

    if ":" in spec:
        from stalwart.vulnerability.scale.worker import factory_of  # the campaign's own loader

        make = factory_of(spec)
        try:
            obj = make()
        except Exception as e:  # the factory's own error is the user's to fix, not a crash
            raise ConfigError(
                f"{spec} failed while building the model ({type(e).__name__}: {e}); fix the "
                "factory (run with -v for its traceback)"
            ) from e
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
    seed: Annotated[int, typer.Option(min=0, help="Fault-list seed.")] = 0,
    margin: Annotated[
        float | None,
        typer.Option(help="Add rounds until every interval half-width is at most this."),
    ] = None,
    confidence: Annotated[float, typer.Option(help="Interval confidence.")] = 0.95,
    interval: Annotated[Interval, typer.Option(help="Confidence interval.")] = Interval["wilson"],
    engine: Annotated[Engine, typer.Option(help="Campaign engine.")] = Engine["fast"],
    out: _Out = None,
    workers: Annotated[int, typer.Option(min=1, help="Shard the trials over N workers.")] = 1,
    backend: Annotated[
        Backend, typer.Option(help="Where the shards run (with --workers or --campaign-dir).")
    ] = Backend["torch"],
    campaign_dir: _CampaignDir = None,
    component: _Component = None,
    as_json: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
) -> None:
    """Estimate PVF (probability that one fault makes the output wrong) per group."""
    from stalwart import vulnerability as vuln
    from stalwart.vulnerability import options as vopts

    with handled():
        check_criteria(criterion or [])
        groups = parse_components(component or [], by.value)
        ref = load_spec(model_spec, dtype.value)
        check_components(ref.model, groups)
        crits = criterion or [ref.criteria[0]]
        stop: vopts.StoppingRule = (
            vuln.FixedTrials(trials) if margin is None else vuln.UntilWidth(margin, trials=trials)
        )
        options = vuln.PVFOptions(
            by=by.value,
            stop=stop,
            seed=seed,
            targets=targets,
            error=error.value,
            confidence=confidence,
            interval=vopts.Interval(interval.value),
            engine=vopts.Engine(engine.value),
            components=groups,
        )
        shards = Sharding(workers, backend.value, campaign_dir)
        report = _estimate(ref, (model_spec, dtype.value), crits, options, shards, not as_json)
        _emit(report, model_spec, as_json, out)


def _estimate(
    ref: Any, spec: tuple[str, str], crits: list[str], opts: Any, shards: Sharding, show: bool
) -> Any:
    """The PVF report: in this process, or sharded when workers or a directory are asked for."""
    from stalwart import vulnerability as vuln

    if shards.workers > 1 or shards.directory is not None:
        factory = functools.partial(_reference, *spec)
        return sharded_pvf(ref, factory, crits, opts, shards, show)
    labels = ref.labels if len(ref.labels) else None
    return vuln.pvf(ref.model, ref.inputs, crits, opts, labels=labels, progress=show)


def _emit(report: Any, spec: str, as_json: bool, out: Path | None) -> None:
    from stalwart.vulnerability.report import write_outputs

    if as_json:
        emit_json(report.to_dict())
    else:
        _print(Console(), report, spec)
    if out is not None:
        with staged_files(out) as staging:  # no earlier file is replaced before all exist
            paths = write_outputs(report, staging, title=f"PVF of {spec}")
        Console(stderr=as_json).print(
            f"wrote {', '.join(str(out / p.name) for p in paths.values())}"
        )


def _reference(spec: str, dtype: str) -> Any:
    """The model factory every worker calls (module level, so a partial of it pickles)."""
    return load_spec(spec, dtype)


@dataclasses.dataclass(frozen=True)
class Sharding:
    """How a ``--workers`` campaign is spread out."""

    workers: int
    backend: str
    directory: Path | None
    """Where the shards live (None: a temporary directory, removed afterwards)."""


def sharded_pvf(
    ref: Any, factory: Any, crits: list[str], opts: Any, shards: Sharding, progress: bool
) -> Any:
    """:func:`stalwart.vulnerability.pvf`, each round run by :func:`~stalwart.vulnerability.
    scale.run_sharded`: the same faults (seeds, stopping rounds), so the same report."""
    from stalwart import vulnerability as vuln
    from stalwart.inject import BitFlip, error_model
    from stalwart.vulnerability import scale
    from stalwart.vulnerability.pvf import draw_round, faults_per_round

    labels = ref.labels if len(ref.labels) else None
    # built here too: the criteria are checked and the faults drawn before any worker starts
    kw = {"engine": opts.engine.value, "independent_samples": opts.independent_samples}
    campaign = vuln.Campaign(ref.model, ref.inputs, crits, labels=labels, **kw)
    per_round, targets = faults_per_round(ref.model, opts), opts.targets
    error = error_model(opts.error) if opts.error is not None else BitFlip()
    with tempfile.TemporaryDirectory(prefix="stalwart-pvf-") as tmp:
        root = shards.directory or Path(tmp)
        rnd = 0
        while True:
            faults = draw_round(campaign, opts, per_round, targets, error, rnd)
            part = scale.run_sharded(
                factory,
                faults,
                root / f"round-{rnd}",
                crits,
                workers=shards.workers,
                backend=shards.backend,
                progress=progress,
                **kw,
            )
            result = part if campaign.result is None else campaign.result.extend(part)
            campaign.result = result
            report = vuln.estimate(
                result,
                opts.by,
                confidence=opts.confidence,
                method=opts.interval.value,
                components=opts.components,
            )
            wide = opts.stop.next_round(report, len(result))
            if not wide:
                return report
            rnd += 1
            if opts.by == "tensor":
                targets = wide
            elif opts.by == "bit" and isinstance(error, BitFlip) and error.bit is None:
                bits = [int(b) for b in wide if b.lstrip("-").isdigit() and int(b) >= 0]
                error = dataclasses.replace(error, bits=bits)


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
