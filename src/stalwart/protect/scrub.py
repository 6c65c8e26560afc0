"""Parameter scrubbing: compare every protected tensor with its checksum and restore the
damaged ones from the last good checkpoint (via :class:`stalwart.Checkpointer`) or, without
one, from an in-memory copy."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stalwart.checkpoint import Checkpointer
from stalwart.inject.targets import Pattern, select_tensors
from stalwart.protect.base import Protection

__all__ = ["ParameterScrubber"]


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().contiguous().view(torch.uint8).numpy())


class ParameterScrubber(Protection):
    """Checksums of the matching tensors, and a good copy to restore them from.

    Args:
        model: the clean model.
        pattern: which parameters to guard.
        root: a checkpoint root; the clean tensors are saved there as ``step`` and
            restored with ``Checkpointer.load``. None keeps a copy in memory.
    """

    def __init__(
        self,
        model: nn.Module,
        pattern: Pattern = "*",
        *,
        root: str | Path | None = None,
        step: int = 0,
    ) -> None:
        self.name = "scrub"
        self.basis = "measured"
        self.tensors = select_tensors(model, pattern)
        self.sums = {n: _crc(t) for n, t in self.tensors.items()}
        self.step = step
        self.ckpt: Checkpointer | None = None
        self.copy: dict[str, torch.Tensor] = {}
        if root is not None:
            self.ckpt = Checkpointer(root)
            self.ckpt.save(step, {n: t.detach().clone() for n, t in self.tensors.items()})
        else:
            self.copy = {n: t.detach().clone() for n, t in self.tensors.items()}
        self.repaired: list[str] = []

    def damaged(self) -> list[str]:
        """Names whose bytes no longer match their checksum."""
        return [n for n, t in self.tensors.items() if _crc(t) != self.sums[n]]

    def scrub(self) -> list[str]:
        """Restore every damaged tensor; returns their names."""
        bad = self.damaged()
        if not bad:
            return []
        with torch.no_grad():
            if self.ckpt is not None:
                state = {n: self.tensors[n].detach() for n in bad}
                self.ckpt.load(state, self.step, strict=False)
            else:
                for n in bad:
                    self.tensors[n].copy_(self.copy[n])
        self.repaired += bad
        return bad

    def after_fault(self, model: nn.Module) -> None:
        self.scrub()

    def false_alarms(self, model: nn.Module, inputs: Any) -> float:
        """1.0 if a clean model's checksums flag any tensor (they never should)."""
        return float(bool(self.damaged()))

    def cost(self, model: nn.Module) -> dict[str, Any]:
        size = sum(t.numel() * t.element_size() for t in self.tensors.values())
        return {"extra_bytes": float(4 * len(self.tensors)), "good_copy_bytes": float(size)}
