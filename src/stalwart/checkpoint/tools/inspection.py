"""What a committed step holds, as data: one row per tensor and the step's totals.

:func:`inspect_manifest` reads nothing but the manifest; ``Inspection`` converts to JSON,
Arrow, pandas and polars and renders in notebooks. Defined in
:mod:`stalwart.checkpoint.durable.summary` (so that ``Manifest._repr_html_`` renders without
importing the tools); this is the path users import.
"""

from __future__ import annotations

from stalwart.checkpoint.durable.summary import Inspection, TensorRow, inspect_manifest

__all__ = ["Inspection", "TensorRow", "inspect_manifest"]
