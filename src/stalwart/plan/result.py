"""What the planner returns, and its renderings: a plain dict (JSON), a rich table, and a
matplotlib plot of ETTR against job size. Every figure here is *modelled*; the renderings say so.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

from stalwart.errors import require
from stalwart.plan.simulate import SimResult

__all__ = ["Estimate", "PlanResult", "ScalePoint", "StrategyPlan"]


@dataclass(frozen=True)
class Estimate:
    """The closed-form figures for one strategy (:func:`stalwart.plan.model.analytic`)."""

    ettr: float
    lost_work_s: float
    """Expected training progress redone per failure, seconds."""
    downtime_s: float
    """Expected stall per failure (detection, restore, heal debt), seconds."""
    method: str
    """``exact (Daly's complete model)`` or ``first order``."""


@dataclass(frozen=True)
class StrategyPlan:
    """One strategy's plan: intervals, where failures land, and its ETTR both ways."""

    strategy: str
    intervals_s: dict[str, float]
    """Recommended seconds between snapshots, per snapshot tier."""
    landing_per_day: dict[str, float]
    """Failures per day that each rung takes when they strike alone."""
    analytic: Estimate
    simulated: SimResult | None
    failures_per_day: float
    notes: tuple[str, ...] = ()
    """Tiers left out and why."""

    @property
    def ettr(self) -> float:
        """The figure to quote: simulated when simulated, else the closed form."""
        return self.simulated.ettr if self.simulated else self.analytic.ettr

    @property
    def lost_work_s(self) -> float:
        return self.simulated.lost_work_s if self.simulated else self.analytic.lost_work_s


@dataclass(frozen=True)
class ScalePoint:
    """ETTR of one strategy at one job size."""

    accelerators: int
    strategy: str
    analytic: float
    simulated: float
    """NaN when not simulated."""
    ci: float


@dataclass(frozen=True)
class PlanResult:
    """The plan for every strategy asked for, the inputs with their sources, and the
    scaling curve (empty unless sizes were given)."""

    inputs: dict[str, Any]
    sources: dict[str, str]
    plans: tuple[StrategyPlan, ...]
    scaling: tuple[ScalePoint, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Everything as plain values; NaN becomes None."""
        return _clean(
            {
                "label": "modelled",
                "plans": [asdict(p) | {"ettr": p.ettr} for p in self.plans],
                "scaling": [asdict(s) for s in self.scaling],
                "inputs": self.inputs,
                "sources": self.sources,
            }
        )

    def to_json(self, path: str | Path | None = None, *, indent: int | None = 2) -> str:
        """The dict as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            Path(path).write_text(text + "\n", encoding="utf-8")
        return text

    def table(self, *, title: str | None = "Modelled ETTR (not measured)") -> Table:
        """A rich table: one row per strategy."""
        table = Table(title=title, title_justify="left", caption=_CAPTION, caption_justify="left")
        table.add_column("strategy", no_wrap=True)
        for name in ("ETTR sim. ± 95% CI", "closed form", "lost / failure", "down / failure"):
            table.add_column(name, justify="right")
        table.add_column("intervals")
        for p in self.plans:
            sim = p.simulated
            table.add_row(
                p.strategy,
                f"{sim.ettr:.2%} ± {sim.ettr_ci:.2%}" if sim else "not simulated",
                f"{p.analytic.ettr:.2%}{'' if p.analytic.method.startswith('first') else ' exact'}",
                _duration(p.lost_work_s),
                _duration(sim.downtime_s if sim else p.analytic.downtime_s),
                ", ".join(f"{t} {_duration(s)}" for t, s in p.intervals_s.items()),
            )
        return table

    def plot(self, path: str | Path) -> Path:
        """Plot ETTR against job size, one line per strategy, to an image file (PNG, SVG, PDF:
        by suffix). Needs matplotlib and a scaling curve (``plan(..., sizes=...)``)."""
        if not self.scaling:
            from stalwart.errors import ConfigError

            raise ConfigError("no scaling curve to plot: plan(..., sizes=[1024, 4096, ...])")
        require("matplotlib", "rca", "PlanResult.plot")
        import matplotlib

        matplotlib.use("Agg")  # files only; never a window
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.2))
        for strategy in dict.fromkeys(s.strategy for s in self.scaling):
            pts = [s for s in self.scaling if s.strategy == strategy]
            xs = [s.accelerators for s in pts]
            simulated = all(not math.isnan(s.simulated) for s in pts)
            ys = [s.simulated if simulated else s.analytic for s in pts]
            err = [s.ci for s in pts] if simulated else None
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=strategy)
        ax.set_xscale("log", base=2)
        sizes = sorted({s.accelerators for s in self.scaling})
        ax.set_xticks(sizes, [f"{n:,}" for n in sizes])
        ax.minorticks_off()
        ax.set_xlabel("accelerators")
        ax.set_ylabel("ETTR (modelled)")
        ax.set_title("Modelled ETTR against job size (stalwart plan)")
        ax.grid(True, alpha=0.3)
        ax.legend()
        out = Path(path)
        fig.savefig(out, bbox_inches="tight", dpi=120)
        plt.close(fig)
        return out


_CAPTION = (
    "closed form: first order unless marked exact; lost: training redone per failure; "
    "down: stall per failure (detection, restore, heal)"
)


def _duration(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    return f"{s:.1f} s"


def _clean(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value
