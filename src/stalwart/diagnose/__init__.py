"""Root-cause analysis over structured logs: which combinations of attribute values single out
the failures (``analyze``) or explain a KPI's deviation from its forecast (``localize``), and,
over a folder of runs' fleet logs, each kind of fault (``analyze_fleet``).

    load ─► clean ─► pre-aggregate (DuckDB GROUP BY) ─► mine failures (weighted FP-Growth)
         ─► count and score (lift, Wilson interval) ─► prune ─► select ─► report

Depends on no other stalwart package but ``stalwart.errors``. Needs the ``rca`` extra
(DuckDB, PyArrow; matplotlib for the HTML report's plot): importing this package without it
raises :class:`stalwart.errors.MissingDependencyError` with the install command.
"""

from __future__ import annotations

from stalwart.errors import require

# Before the submodules, which import these at their top: one clear error, not a bare
# ModuleNotFoundError from deep inside.
require("duckdb", "rca", "stalwart.diagnose")
require("pyarrow", "rca", "stalwart.diagnose")

from stalwart.diagnose.analyze import analyze, localize  # noqa: E402
from stalwart.diagnose.fleet import analyze_fleet  # noqa: E402
from stalwart.diagnose.options import DiagnoseOptions  # noqa: E402
from stalwart.diagnose.report import write_html  # noqa: E402
from stalwart.diagnose.result import Diagnosis, Finding, FleetDiagnosis, Neighbour  # noqa: E402

__all__ = [
    "DiagnoseOptions",
    "Diagnosis",
    "Finding",
    "FleetDiagnosis",
    "Neighbour",
    "analyze",
    "analyze_fleet",
    "localize",
    "write_html",
]
