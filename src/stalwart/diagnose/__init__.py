"""Root-cause analysis over structured logs: which combinations of attribute values single out
the failures (``analyze``) or explain a KPI's deviation from its forecast (``localize``).

    load ─► clean ─► pre-aggregate (DuckDB GROUP BY) ─► mine failures (weighted FP-Growth)
         ─► count and score (lift, Wilson interval) ─► prune ─► select ─► report

Depends on no other stalwart package but ``stalwart.errors``.
"""

from __future__ import annotations

from stalwart.diagnose.analyze import analyze, localize
from stalwart.diagnose.options import DiagnoseOptions
from stalwart.diagnose.result import Diagnosis, Finding, Neighbour

__all__ = ["Diagnosis", "DiagnoseOptions", "Finding", "Neighbour", "analyze", "localize"]
