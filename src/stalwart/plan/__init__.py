"""Plan past this machine: how often to save to each tier, and what the recovery ladder buys
at a given scale, modelled from stalwart's measured costs and public failure rates.

    inputs (job, fleet, tiers, costs) ─► intervals per tier (exact one-tier optimum, Young's
    in the limit) ─► ETTR and lost work per failure: closed forms where exact or first order,
    and a seeded discrete-event simulation of the whole ladder ─► table, JSON, plot

``plan()`` models three strategies: checkpoint-restart with torchrun from remote storage
only, stalwart without the memory tier, and stalwart's full ladder (live peer, erasure-coded
peers' memory, local disk, remote). Every default input names its source
(:mod:`stalwart.plan.sources`); every figure the planner prints is *modelled*, never measured.
docs/plan.md has the formulas, their validity ranges and the citations.

Depends on no other stalwart package but ``stalwart.errors``; plotting needs matplotlib.
"""

from __future__ import annotations

from stalwart.plan.analytic import exact_ettr, optimal_interval, young_interval
from stalwart.plan.config import PlanInputs, read_costs, read_inputs
from stalwart.plan.inputs import Costs, Fleet, Job, Strategy, Tier, Tiers
from stalwart.plan.model import plan
from stalwart.plan.result import PlanResult
from stalwart.plan.simulate import simulate

__all__ = [
    "Costs",
    "Fleet",
    "Job",
    "PlanInputs",
    "PlanResult",
    "Strategy",
    "Tier",
    "Tiers",
    "exact_ettr",
    "optimal_interval",
    "plan",
    "read_costs",
    "read_inputs",
    "simulate",
    "young_interval",
]
