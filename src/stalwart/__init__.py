"""stalwart keeps PyTorch training and inference alive through faults, and explains them.

The front door holds what a user calls (a test keeps it small and honest): the checkpointers
(:class:`Checkpointer`, :class:`TieredCheckpointer` with its :class:`Tier`), their options,
:class:`TrainingState`, :class:`PreemptionGuard`, and the save and retention policies. The
exception tree is :mod:`stalwart.errors`; what operations return is
:mod:`stalwart.checkpoint.results`; the other packages (``stalwart.diagnose``,
``stalwart.vulnerability``, ``stalwart.elastic``, ...) have front doors of their own.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from stalwart.moved import find_moved

if TYPE_CHECKING:
    from stalwart.checkpoint import *  # noqa: F403 - the names of __all__, for type checkers

__version__ = "0.1.0"

FROM_CHECKPOINT = "stalwart.checkpoint"
"""Where every public name but ``__version__`` lives: ``__all__`` is that package's
``__all__`` and ``__version__``, read on first use so that ``import stalwart`` needs no torch
(one list of names, kept by ``stalwart.checkpoint``)."""

MOVED = {
    **dict.fromkeys(
        (
            "CheckpointError",
            "CheckpointNotFoundError",
            "CorruptCheckpointError",
            "StalwartError",
            "StateMismatchError",
        ),
        "stalwart.errors",
    ),
    **dict.fromkeys(
        ("CheckpointEvent", "LoadResult", "PendingSave", "RecoveryReport", "SaveResult"),
        "stalwart.checkpoint.results",
    ),
}
"""Names the front door held before 0.2, and where they live now (still found here, with a
DeprecationWarning, until the next release)."""


def __getattr__(name: str) -> object:
    """The public names, imported on first use so ``import stalwart`` (and
    ``import stalwart.diagnose``, which needs no torch) stays light; ``stalwart.elastic``; and
    the names that left the front door, found where they moved, with a warning."""
    if name == "elastic":
        return importlib.import_module("stalwart.elastic")
    if name in MOVED or not (name == "__all__" or name[:1].isupper()):
        return find_moved("stalwart", MOVED, name, stacklevel=3)  # or AttributeError
    checkpoint = importlib.import_module(FROM_CHECKPOINT)
    if name == "__all__":
        value: object = sorted([*checkpoint.__all__, "__version__"])
    elif name in checkpoint.__all__:
        value = getattr(checkpoint, name)
    else:
        return find_moved("stalwart", MOVED, name, stacklevel=3)  # AttributeError
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__getattr__("__all__")})  # type: ignore[misc]
