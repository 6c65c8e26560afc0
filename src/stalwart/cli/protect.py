"""``stalwart protect``: measure protections on a model with one replayed fault list.

Replays the same seeded weight faults with no protection and under each protection
(paired), then sweeps bit-error rates; prints recovery and cost, and with ``--out`` writes
``protect.json`` and ``report.html`` (metric vs BER per protection, benefit vs cost).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from stalwart.cli.pvf import handled, load_spec
from stalwart.errors import ConfigError, require

__all__ = ["protect_command", "register"]

CHOICES = ("clip", "abft", "sbp", "scrub")


def _build(names: list[str], ref: Any, tmp: str) -> list[Any]:
    from stalwart import protect

    out: list[Any] = []
    for n in names:
        if n not in CHOICES:
            raise ConfigError(f"--protection {n!r}: choose from {', '.join(CHOICES)}")
        if n == "clip":
            out.append(protect.ActivationClipping(ref.model, ref.inputs))
        elif n == "abft":
            out.append(protect.ABFT(ref.model, ref.inputs))
        elif n == "sbp":
            out.append(protect.SelectiveBitProtection(("sign", "exponent")))
        else:
            out.append(protect.ParameterScrubber(ref.model, root=Path(tmp) / "scrub"))
    return out


def protect_command(
    model_spec: Annotated[
        str, typer.Argument(help="Reference model name or package.module:factory.")
    ],
    protection: Annotated[
        list[str] | None,
        typer.Option("--protection", "-p", help="clip, abft, sbp, scrub (repeatable)."),
    ] = None,
    trials: Annotated[int, typer.Option(min=1, help="Replayed single-fault trials.")] = 500,
    bit: Annotated[int | None, typer.Option(help="Flip this bit only (default: any bit).")] = None,
    criterion: Annotated[
        str | None, typer.Option("--criterion", "-c", help="Criterion; default: the model's first.")
    ] = None,
    ber: Annotated[
        list[float] | None, typer.Option(help="Bit-error rates to sweep (repeatable).")
    ] = None,
    repeats: Annotated[int, typer.Option(min=1, help="Repeats per bit-error rate.")] = 3,
    seed: Annotated[int, typer.Option(help="Fault-list seed.")] = 0,
    out: Annotated[
        Path | None, typer.Option(help="Write protect.json and report.html here.")
    ] = None,
) -> None:
    """Replay one fault list with and without each protection; report recovery and cost."""
    from stalwart import inject, protect, vulnerability

    with handled(), tempfile.TemporaryDirectory() as tmp:
        ref = load_spec(model_spec)
        ps = _build(protection or list(CHOICES), ref, tmp)
        crit = criterion or ref.criteria[0]
        labels = ref.labels if len(ref.labels) else None
        faults = vulnerability.sample_faults(
            ref.model, trials, seed=seed, error=inject.BitFlip(bit)
        )
        results = protect.evaluate(ref.model, ref.inputs, faults, ps, crit, labels=labels)
        console = Console()
        table = Table(title=f"Protections on {model_spec}: {trials} replayed faults ({crit})")
        for col in (
            "protection",
            "failures",
            "unprotected",
            "fixed",
            "broken",
            "recovered",
            "p (McNemar)",
            "runtime",
            "cost",
        ):
            table.add_column(col, justify="left" if col in ("protection", "cost") else "right")
        for r in results:
            cost = ", ".join(f"{k}={v:.3g}" for k, v in r.cost.items())
            table.add_row(
                r.name,
                str(r.failures),
                str(r.baseline_failures),
                str(r.fixed),
                str(r.broken),
                f"{r.recovered:.0%}",
                f"{r.p_value:.2g}",
                f"{r.overhead:+.0%}",
                cost,
            )
        console.print(table)
        sweep = (
            protect.ber_sweep(ref.model, ref.evaluate, ber, ps, repeats=repeats, seed=seed)
            if ber
            else {}
        )
        if sweep:
            st = Table(
                title=f"{ref.metric} vs bit-error rate (mean of {repeats}; clean {ref.quality:.4f})"
            )
            st.add_column("BER", justify="right")
            for name in sweep:
                st.add_column(name, justify="right")
            for rate in ber or []:
                st.add_row(
                    f"{rate:g}", *[f"{sum(v[rate]) / len(v[rate]):.4f}" for v in sweep.values()]
                )
            console.print(st)
        if out is not None:
            _write(out, model_spec, ref, results, sweep)
            console.print(f"wrote {out / 'protect.json'}, {out / 'report.html'}")


def _write(out: Path, spec: str, ref: Any, results: list[Any], sweep: dict[str, Any]) -> None:
    import dataclasses

    matplotlib = require("matplotlib", "sdc", "stalwart protect --out")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from stalwart.vulnerability.report import figure_html, write_html

    out.mkdir(parents=True, exist_ok=True)
    data = {
        "model": spec,
        "quality": ref.quality,
        "results": [dataclasses.asdict(r) for r in results],
        "ber_sweep": {k: {str(r): v for r, v in d.items()} for k, d in sweep.items()},
    }
    (out / "protect.json").write_text(json.dumps(data, indent=2))
    sections = []
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
    write_html(out / "report.html", f"Protections on {spec}", sections, {"model": spec})


def register(app: typer.Typer) -> None:
    """Add the ``protect`` command to ``app``."""
    app.command("protect")(protect_command)
