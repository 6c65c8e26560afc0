"""``stalwart protect``: measure protections on a model with one replayed fault list.

Replays the same seeded weight faults with no protection and under each protection
(paired), then sweeps bit-error rates; prints recovery and cost, and with ``--out`` writes
``protect.json`` and ``report.html`` (metric vs BER per protection, benefit vs cost).

Clipping bounds and ABFT thresholds are calibrated on a held-out share of the model's inputs
(``--calibration-fraction``) and every protection is scored on the other, disjoint share;
every output says so, and says how each result was obtained: ``measured`` (the mechanism
runs on the faulty model and its time per forward is measured: clipping, ABFT, ``shadow``,
the stored shadow copy + parity of the sign and exponent bits, and scrubbing) or
``modelled`` (``sbp``: a simulated SECDED code, check bits counted, runtime not measured).
Each row also gives the detector's false-alarm rate on the clean scored inputs.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from stalwart.cli.conventions import (
    JSON_HELP,
    emit_json,
    folder_out,
    handled,
    json_text,
    staged_files,
)
from stalwart.cli.pvf import check_criteria, load_spec
from stalwart.errors import ConfigError, require

__all__ = ["protect_command", "register"]

_OUT_HELP = "Write protect.json and report.html here."

CHOICES = ("clip", "abft", "sbp", "shadow", "scrub")


def _names(given: list[str] | None) -> list[str]:
    """The protections asked for: ``-p clip,abft`` and ``-p clip -p abft`` say the same, a
    name given twice runs once, and none given means all."""
    names = list(dict.fromkeys(x.strip() for n in given or () for x in n.split(",")))
    names = [n for n in names if n] or list(CHOICES)
    bad = [n for n in names if n not in CHOICES]
    if bad:
        raise ConfigError(f"--protection {bad[0]!r}: choose from {', '.join(CHOICES)}")
    return names


def _build(names: list[str], ref: Any, calibration: tuple[Any, ...], tmp: str) -> list[Any]:
    from stalwart import protect

    out: list[Any] = []
    for n in names:  # checked by _names
        if n == "clip":
            out.append(protect.ActivationClipping(ref.model, calibration))
        elif n == "abft":
            out.append(protect.ABFT(ref.model, calibration))
        elif n == "sbp":
            out.append(protect.SelectiveBitProtection(("sign", "exponent")))
        elif n == "shadow":
            out.append(protect.ShadowBitProtection(ref.model, ("sign", "exponent")))
        else:
            out.append(protect.ParameterScrubber(ref.model, root=Path(tmp) / "scrub"))
    return out


def _split(ref: Any, spec: str, fraction: float, seed: int) -> tuple[Any, Any, dict[str, Any]]:
    """Calibration inputs, the reference model restricted to the scored inputs, and a record."""
    from stalwart.protect.evaluate import split_inputs

    labels = ref.labels if len(ref.labels) else None
    n = int(ref.inputs[0].shape[0])
    if fraction == 0.0:
        info: dict[str, Any] = {
            "fraction": 0.0,
            "calibration_samples": n,
            "evaluation_samples": n,
        }
        info["note"] = "in-sample: calibrated on the scored inputs (--calibration-fraction 0)"
        return ref.inputs, ref, info
    if not ref.independent_samples:
        raise ConfigError(
            f"{spec}'s inputs are one graph whose samples reach each other: they cannot be "
            "split into calibration and evaluation sets; pass --calibration-fraction 0 to "
            "calibrate on the scored inputs (the report then says it is in-sample)"
        )
    split = split_inputs(ref.inputs, labels, fraction, seed=seed)
    scored = dataclasses.replace(
        ref, inputs=split.evaluation, labels=split.labels if labels is not None else ref.labels
    )
    scored.quality = scored.evaluate()
    held: dict[str, Any] = {
        "fraction": fraction,
        "calibration_samples": len(split.calibration_index),
        "evaluation_samples": len(split.evaluation_index),
        "seed": seed,
        "note": "held out: calibration and evaluation inputs are disjoint",
    }
    return split.calibration, scored, held


def _table(title: str, results: list[Any]) -> Table:
    table = Table(title=title)
    for col in (
        "protection",
        "basis",
        "failures",
        "unprotected",
        "fixed",
        "broken",
        "recovered",
        "p (McNemar)",
        "runtime",
        "false alarms",
        "cost",
        "how",
    ):
        left = col in ("protection", "cost", "how")
        table.add_column(col, justify="left" if left else "right")
    for r in results:
        cost = ", ".join(f"{k}={v:.3g}" for k, v in r.cost.items())
        table.add_row(
            r.name,
            r.basis,
            str(r.failures),
            str(r.baseline_failures),
            str(r.fixed),
            str(r.broken),
            f"{r.recovered:.0%}",
            f"{r.p_value:.2g}",
            _runtime(r),
            f"{r.false_alarm_rate:.1%}",
            cost,
            r.method,
        )
    return table


def _runtime(r: Any) -> str:
    """Relative and absolute time one protected forward adds; n/a when modelled."""
    if r.overhead != r.overhead:  # NaN: nothing ran to be timed
        return "n/a (modelled)"
    return f"{r.overhead:+.0%} ({r.overhead_s * 1e3:+.2f} ms)"


def _rates(values: list[float] | None) -> list[float] | None:
    """Option callback: bit-error rates are probabilities, refused before any replay runs."""
    bad = [r for r in values or [] if not 0.0 <= r <= 1.0]
    if bad:
        raise typer.BadParameter(f"{bad[0]:g} is not a probability; give rates from 0 to 1")
    return values


def protect_command(
    model_spec: Annotated[
        str, typer.Argument(help="Reference model name or package.module:factory.")
    ],
    protection: Annotated[
        list[str] | None,
        typer.Option(
            "--protection", "-p", help="clip, abft, sbp, shadow, scrub (repeatable; or a,b)."
        ),
    ] = None,
    trials: Annotated[int, typer.Option(min=1, help="Replayed single-fault trials.")] = 500,
    bit: Annotated[int | None, typer.Option(help="Flip this bit only (default: any bit).")] = None,
    criterion: Annotated[
        str | None, typer.Option("--criterion", "-c", help="Criterion; default: the model's first.")
    ] = None,
    ber: Annotated[
        list[float] | None,
        typer.Option(callback=_rates, help="Bit-error rates to sweep (repeatable)."),
    ] = None,
    repeats: Annotated[int, typer.Option(min=1, help="Repeats per bit-error rate.")] = 3,
    seed: Annotated[int, typer.Option(min=0, help="Fault-list and calibration-split seed.")] = 0,
    calibration_fraction: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=0.9,
            help="Share of the inputs held out to calibrate clipping bounds and ABFT "
            "thresholds; the rest are scored. 0: calibrate on the scored inputs (in-sample).",
        ),
    ] = 0.5,
    out: Annotated[Path | None, typer.Option(callback=folder_out, help=_OUT_HELP)] = None,
    as_json: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
) -> None:
    """Replay one fault list with and without each protection; report recovery and cost."""
    from stalwart import inject, protect, vulnerability

    with handled(), tempfile.TemporaryDirectory() as tmp:
        names = _names(protection)
        check_criteria([criterion] if criterion else [])
        ref = load_spec(model_spec)
        calibration, scored, split = _split(ref, model_spec, calibration_fraction, seed)
        ps = _build(names, ref, calibration, tmp)
        crit = criterion or ref.criteria[0]
        labels = scored.labels if len(scored.labels) else None
        faults = vulnerability.sample_faults(
            ref.model, trials, seed=seed, error=inject.BitFlip(bit)
        )
        results = protect.evaluate(
            ref.model,
            scored.inputs,
            faults,
            ps,
            crit,
            labels=labels,
            in_sample=calibration_fraction == 0.0,
        )
        console = Console(stderr=as_json)  # with --json, stdout carries the JSON alone
        title = (
            f"Protections on {model_spec}: {trials} replayed faults ({crit}); calibrated on "
            f"{split['calibration_samples']} inputs, scored on {split['evaluation_samples']} "
            f"({split['note']})"
        )
        console.print(_table(title, results))
        sweep = (
            protect.ber_sweep(ref.model, scored.evaluate, ber, ps, repeats=repeats, seed=seed)
            if ber
            else {}
        )
        if sweep:
            st = Table(
                title=f"{ref.metric} on the scored inputs vs bit-error rate (mean of {repeats}; "
                f"clean {scored.quality:.4f})"
            )
            st.add_column("BER", justify="right")
            for name in sweep:
                st.add_column(name, justify="right")
            for rate in ber or []:
                st.add_row(
                    f"{rate:g}", *[f"{sum(v[rate]) / len(v[rate]):.4f}" for v in sweep.values()]
                )
            console.print(st)
        data = _data(model_spec, scored, results, sweep, split)
        if as_json:
            emit_json(data)
        if out is not None:
            _write(out, model_spec, data, scored, results, sweep, split)
            console.print(f"wrote {out / 'protect.json'}, {out / 'report.html'}")


def _data(
    spec: str, ref: Any, results: list[Any], sweep: dict[str, Any], split: dict[str, Any]
) -> dict[str, Any]:
    """What ``--json`` prints and ``protect.json`` holds."""
    return {
        "model": spec,
        "quality": ref.quality,
        "calibration": split,
        "results": [dataclasses.asdict(r) for r in results],
        "ber_sweep": {k: {str(r): v for r, v in d.items()} for k, d in sweep.items()},
    }


def _write(
    out: Path,
    spec: str,
    data: dict[str, Any],
    ref: Any,
    results: list[Any],
    sweep: dict[str, Any],
    split: dict[str, Any],
) -> None:
    import html

    matplotlib = require("matplotlib", "sdc", "stalwart protect --out")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from stalwart.vulnerability.report import figure_html, write_html

    rows = "".join(
        f"<tr><td>{html.escape(r.name)}</td><td>{r.basis}</td><td>{_runtime(r)}</td>"
        f"<td>{r.false_alarm_rate:.1%}</td><td>{r.cost.get('extra_bytes', 0):.0f}</td>"
        f"<td>{html.escape(r.method)}</td></tr>"
        for r in results
    )
    sections = [
        (
            "How each result was obtained",
            f"<p>Calibration: {split['calibration_samples']} inputs; scored on "
            f"{split['evaluation_samples']} ({html.escape(split['note'])}).</p>"
            "<table><tr><th>protection</th><th>basis</th><th>runtime per forward</th>"
            f"<th>false alarms (clean)</th><th>extra bytes</th><th>method</th></tr>{rows}</table>",
        )
    ]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for r in results:
        ax.scatter(max(r.overhead, 0) * 100, r.recovered * 100)
        ax.annotate(r.name, (max(r.overhead, 0) * 100, r.recovered * 100), fontsize=8)
    ax.set_xlabel("runtime overhead (%)")
    ax.set_ylabel("failures recovered (%)")
    ax.set_title("Benefit vs cost")
    fig.tight_layout()
    sections.append(("Benefit vs cost", figure_html(fig)))
    if sweep:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for name, d in sweep.items():
            rates = sorted(d)
            ax.plot(rates, [sum(d[r]) / len(d[r]) for r in rates], marker="o", label=name)
        ax.set_xscale("log")
        ax.set_xlabel("bit-error rate")
        ax.set_ylabel(ref.metric)
        ax.legend(fontsize=7)
        fig.tight_layout()
        sections.append((f"{ref.metric} vs bit-error rate", figure_html(fig)))
    with staged_files(out) as staging:  # neither replaces its earlier file before both exist
        (staging / "protect.json").write_text(json_text(data))
        manifest = {"model": spec, "calibration": split["note"]}
        write_html(staging / "report.html", f"Protections on {spec}", sections, manifest)


def register(app: typer.Typer) -> None:
    """Add the ``protect`` command to ``app``."""
    app.command("protect")(protect_command)
