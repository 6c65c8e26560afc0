"""What a protection is: something attached to a model for a forward pass, that may
rewrite the fault list (bits covered by ECC) or act after a fault lands (scrubbing), and
that states its cost."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from torch import nn

from stalwart.vulnerability import FaultList

__all__ = ["Protection"]


class Protection(Protocol):
    """A mitigation evaluated on a replayed fault list."""

    name: str
    basis: str
    """``measured`` (the mechanism runs and is timed) or ``modelled`` (simulated; its
    runtime is not measured)."""

    def attach(self, model: nn.Module) -> AbstractContextManager[Any]:
        """Hooks active for the ``with`` block (a null context when not needed)."""
        ...

    def filter(self, model: nn.Module, faults: FaultList) -> FaultList:
        """The faults as the protected storage sees them (ECC removes covered bits)."""
        ...

    def after_fault(self, model: nn.Module) -> None:
        """Runs after a fault lands and before the forward pass (scrubbing)."""
        ...

    def false_alarms(self, model: nn.Module, inputs: Sequence[Any]) -> float:
        """Share of clean ``inputs`` (or of checks, for storage checks) that the detector
        flags on the fault-free model: score it on inputs it was not calibrated on."""
        ...

    def cost(self, model: nn.Module) -> dict[str, float]:
        """Static costs: extra bytes, protected bits, share of storage."""
        ...
