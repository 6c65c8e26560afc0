"""Dataframes of tabular results: one implementation of ``to_pandas()`` / ``to_polars()``.

A tabular result (a diagnosis, a PVF report, a diff, ...) owns one thing: its Arrow table.
Subclassing :class:`ArrowFrames` and implementing ``to_arrow()`` gives it ``to_pandas()`` and
``to_polars()`` that hold exactly what the table holds. pandas and polars are optional (the
``frames`` extra): a missing one is a :class:`~stalwart.errors.MissingDependencyError` that
names the extra. A result whose table takes an argument (``DiffReport.to_arrow(kind)``) calls
the module functions :func:`to_pandas` / :func:`to_polars` with the table instead, and names
itself in ``feature`` (``"DiffReport.to_pandas"``) for the error a missing library raises.

This module is a leaf: it depends on ``stalwart.errors`` only, so every package may use it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from stalwart.errors import require

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["ArrowFrames", "to_pandas", "to_polars"]


def to_pandas(table: pa.Table, feature: str) -> Any:
    """``table`` as a pandas DataFrame; the error names ``feature`` if pandas is missing."""
    require("pandas", "frames", feature)
    return table.to_pandas()


def to_polars(table: pa.Table, feature: str) -> Any:
    """``table`` as a polars DataFrame; the error names ``feature`` if polars is missing."""
    pl = require("polars", "frames", feature)
    return pl.from_arrow(table)


class ArrowFrames(ABC):
    """A result with one Arrow table; ``to_pandas()`` and ``to_polars()`` follow from it.

    Subclasses implement :meth:`to_arrow` and nothing else here. The frames check for their
    library before building the table, so a missing extra fails fast and says which one.
    """

    __slots__ = ()

    @abstractmethod
    def to_arrow(self) -> pa.Table:
        """The result as a pyarrow Table; the frames hold exactly these columns and rows."""

    def to_pandas(self) -> Any:
        """``to_arrow()`` as a pandas DataFrame (needs pandas: the ``frames`` extra)."""
        feature = f"{type(self).__name__}.to_pandas"
        require("pandas", "frames", feature)
        return to_pandas(self.to_arrow(), feature)

    def to_polars(self) -> Any:
        """``to_arrow()`` as a polars DataFrame (needs polars: the ``frames`` extra)."""
        feature = f"{type(self).__name__}.to_polars"
        require("polars", "frames", feature)
        return to_polars(self.to_arrow(), feature)
