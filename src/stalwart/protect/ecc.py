"""Selective bit protection: ECC on the bits that matter (sign and exponent, or chosen bits)
of chosen tensors (e.g. the most vulnerable by PVF). A fault's covered bits are corrected,
so the replayed fault list loses them; the cost is the protected share of storage and the
check bits an SECDED code adds (8 per 64 protected bits)."""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Sequence
from dataclasses import replace

from torch import nn

from stalwart.errors import ConfigError
from stalwart.inject import Fault, layout_of
from stalwart.inject.targets import Pattern
from stalwart.vulnerability import FaultList, PVFReport

__all__ = ["SelectiveBitProtection"]

SECDED_BITS_PER_64 = 8


class SelectiveBitProtection:
    """Protect ``bits`` (a field list like ``("sign", "exponent")`` or bit positions) of the
    tensors matching ``tensors``."""

    def __init__(
        self,
        bits: Sequence[str] | Sequence[int] = ("sign", "exponent"),
        tensors: Pattern = "*",
        *,
        name: str = "sbp",
    ) -> None:
        self.bits, self.name = list(bits), name
        self.tensors = [tensors] if isinstance(tensors, str) else list(tensors)
        if not self.bits:
            raise ConfigError("protect at least one bit or field")

    @classmethod
    def top_pvf(
        cls, report: PVFReport, k: int, bits: Sequence[str] | Sequence[int] = ("sign", "exponent")
    ) -> SelectiveBitProtection:
        """Protect the ``k`` tensors with the highest PVF in a by-tensor report."""
        if report.by != "tensor":
            raise ConfigError(f"top_pvf needs a report by tensor, got by={report.by!r}")
        rows = sorted(
            (r for r in report.rows if r.criterion == report.criteria[0]), key=lambda r: -r.pvf
        )
        return cls(bits, [r.group for r in rows[:k]], name=f"sbp-top{k}")

    def _covers(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.tensors)

    def mask(self, dtype: object) -> int:
        layout = layout_of(dtype)  # type: ignore[arg-type]
        if all(isinstance(b, str) for b in self.bits):
            return layout.field_mask(*[str(b) for b in self.bits])
        return sum(1 << b for b in self.bits if isinstance(b, int) and b < layout.bits)

    def filter(self, model: nn.Module, faults: FaultList) -> FaultList:
        dtypes = {n: p.dtype for n, p in model.named_parameters()}
        out: list[Fault] = []
        for f in faults:
            if (
                f.kind == "param"
                and f.op != "assign"
                and f.target in dtypes
                and self._covers(f.target)
            ):
                f = replace(f, mask=f.mask & ~self.mask(dtypes[f.target]))
            out.append(f)
        return FaultList(out, faults.seed, faults.error, faults.population)

    def attach(self, model: nn.Module) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def after_fault(self, model: nn.Module) -> None:
        return None

    def cost(self, model: nn.Module) -> dict[str, float]:
        total = prot = 0
        for n, p in model.named_parameters():
            lay = layout_of(p.dtype)
            total += p.numel() * lay.bits
            if self._covers(n):
                prot += p.numel() * bin(self.mask(p.dtype)).count("1")
        return {
            "protected_bits_share": prot / max(total, 1),
            "extra_bytes": prot * SECDED_BITS_PER_64 / 64 / 8,
            "storage_overhead": prot * SECDED_BITS_PER_64 / 64 / max(total, 1),
        }
