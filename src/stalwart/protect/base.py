"""What a protection is: something attached to a model for a forward pass, that may
rewrite the fault list (bits covered by ECC) or act after a fault lands (scrubbing), and
that states its cost.

The built-in protections subclass :class:`Protection` and so inherit its defaults for the
steps they do not take (no hooks, the faults as they are, nothing after a fault); a
user-written one may do the same, or only match the protocol. A protection calibrated on data
records the batch it saw (:func:`batch_size`) and each sample's digest
(:func:`row_fingerprints`), with which :func:`~stalwart.protect.evaluate` refuses to score it
on those samples.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn

from stalwart.vulnerability import FaultList

__all__ = ["Protection", "batch_size", "row_fingerprints"]


class Protection(Protocol):
    """A mitigation evaluated on a replayed fault list."""

    name: str
    basis: str
    """``measured`` (the mechanism runs and is timed) or ``modelled`` (simulated; its
    runtime is not measured)."""

    def attach(self, model: nn.Module) -> AbstractContextManager[Any]:
        """Hooks active for the ``with`` block (default: none)."""
        return contextlib.nullcontext()

    def filter(self, model: nn.Module, faults: FaultList) -> FaultList:
        """The faults as the protected storage sees them (default: as they are; ECC that
        corrects on use lets them land whole and acts in :meth:`after_fault`)."""
        return faults

    def after_fault(self, model: nn.Module) -> None:
        """Runs after a fault lands and before the forward pass (default: nothing)."""
        return None

    def false_alarms(self, model: nn.Module, inputs: Sequence[Any]) -> float:
        """Share of clean ``inputs`` (or of checks, for storage checks) that the detector
        flags on the fault-free model: score it on inputs it was not calibrated on."""
        ...

    def cost(self, model: nn.Module) -> dict[str, float]:
        """Static costs: extra bytes, protected bits, share of storage."""
        ...


def batch_size(inputs: Sequence[Any], default: int = 0) -> int:
    """Rows of the first input tensor with a batch dimension (``default`` when none has)."""
    first = next((x for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0), None)
    return int(first.shape[0]) if first is not None else default


def row_fingerprints(inputs: Sequence[Any]) -> frozenset[bytes]:
    """A digest per sample: the bytes of row ``i`` of every input tensor, hashed together.

    Empty when the inputs are not tensors sharing dim 0 (nothing to compare row by row).
    """
    tensors = [x for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not tensors or len({x.shape[0] for x in tensors}) != 1:
        return frozenset()
    n = tensors[0].shape[0]
    # the raw bytes through a uint8 view: NumPy has no bfloat16 (nor float8), a byte view
    # hashes every dtype, and the bytes (so the digests) of the others are as they were
    rows = [x.detach().cpu().reshape(n, -1).contiguous().view(torch.uint8).numpy() for x in tensors]
    out = set()
    for i in range(n):
        h = hashlib.blake2b(digest_size=16)
        for r in rows:
            h.update(r[i].tobytes())
        out.add(h.digest())
    return frozenset(out)
