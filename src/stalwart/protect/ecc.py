"""Selective bit protection: ECC on the bits that matter (sign and exponent, or chosen bits)
of chosen tensors (e.g. the most vulnerable by PVF).

Modelled: the whole fault lands in the model's weights, then an SECDED code is simulated
in software on the protected bits, which are grouped into codewords of at most
64 data bits (``64 // bits per element`` consecutive elements; 7 fp32 elements for sign and
exponent): a codeword with one flipped protected bit is corrected from the copy of the
protected bits taken when the protection was attached (what the check bits would rebuild);
one with two or more is detected, not corrected, and left as it is. Unprotected bits are
never touched. Not simulated: faults in the check bits themselves, and miscorrection of
three or more flips (counted as detected). The cost is the protected share of storage and
8 check bits per codeword, counted, not stored; no time is measured (the decode would run in
the memory controller). :class:`stalwart.protect.ShadowBitProtection` is the measured
counterpart: its redundancy is stored and checked in software on every forward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import nn

from stalwart.errors import ConfigError
from stalwart.inject.bits import layout_of, signed_mask
from stalwart.inject.targets import Pattern, matches
from stalwart.protect.base import Protection
from stalwart.vulnerability import PVFReport

__all__ = ["SelectiveBitProtection", "bit_mask", "chosen_bits"]


def chosen_bits(
    bits: Sequence[str] | Sequence[int], tensors: Pattern
) -> tuple[list[str | int], list[str]]:
    """A bit protection's ``bits`` and tensor globs as lists.

    Raises:
        ConfigError: ``bits`` is empty.
    """
    if not bits:
        raise ConfigError("protect at least one bit or field")
    return list(bits), [tensors] if isinstance(tensors, str) else list(tensors)


def bit_mask(bits: Sequence[str | int], dtype: torch.dtype) -> int:
    """The mask of ``bits`` (field names, or positions: those past the word are ignored) in
    ``dtype``'s storage word."""
    layout = layout_of(dtype)
    if all(isinstance(b, str) for b in bits):
        return layout.field_mask(*[str(b) for b in bits])
    return sum(1 << b for b in bits if isinstance(b, int) and 0 <= b < layout.bits)


SECDED_CHECK_BITS = 8
"""Check bits of an SECDED code over up to 64 data bits (Hsiao (72, 64))."""
CODEWORD_DATA_BITS = 64


class SelectiveBitProtection(Protection):
    """Protect ``bits`` (a field list like ``("sign", "exponent")`` or bit positions) of the
    tensors matching ``tensors`` with a simulated SECDED code.

    Attributes:
        corrected: codewords corrected since the protection was made.
        uncorrectable: codewords found with two or more flipped protected bits (detected,
            not corrected).
    """

    basis = "modelled"
    method = (
        "modelled: SECDED simulated per codeword of protected bits (1 flip corrected, "
        ">= 2 detected, not corrected); check bits counted, not stored; runtime: ECC "
        "decodes in the memory controller, not timed"
    )

    def __init__(
        self,
        bits: Sequence[str] | Sequence[int] = ("sign", "exponent"),
        tensors: Pattern = "*",
        *,
        name: str = "sbp",
    ) -> None:
        self.bits, self.tensors = chosen_bits(bits, tensors)
        self.name = name
        self.corrected = 0
        self.uncorrectable = 0
        self._golden: dict[str, tuple[torch.Tensor, torch.Tensor, int, int]] = {}

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
        return matches(name, self.tensors)

    def mask(self, dtype: object) -> int:
        return bit_mask(self.bits, dtype)  # type: ignore[arg-type]

    def per_codeword(self, dtype: torch.dtype) -> int:
        """Elements whose protected bits share one codeword."""
        return max(1, CODEWORD_DATA_BITS // max(bin(self.mask(dtype)).count("1"), 1))

    @contextlib.contextmanager
    def attach(self, model: nn.Module) -> Iterator[None]:
        """Take the protected bits of the (clean) covered tensors, as the check bits would."""
        self._golden = {}
        for n, p in model.named_parameters():
            if not self._covers(n) or not p.dtype.is_floating_point:
                continue
            lay = layout_of(p.dtype)
            raw = p.detach().view(lay.storage).view(-1)
            mask = signed_mask(self.mask(p.dtype), lay)
            self._golden[n] = (raw, raw.clone(), mask, self.per_codeword(p.dtype))
        try:
            yield
        finally:
            self._golden = {}

    def after_fault(self, model: nn.Module) -> None:
        """Decode every covered tensor: correct single-bit codewords, count the others."""
        with torch.no_grad():
            for raw, clean, mask, per in self._golden.values():
                diff = (raw ^ clean) & mask
                idx = diff.nonzero().view(-1)
                if len(idx) == 0:
                    continue
                flips = np.bitwise_count(diff[idx].numpy().view(f"u{raw.element_size()}"))
                words, inverse = torch.unique(idx // per, return_inverse=True)
                per_word = torch.zeros(len(words), dtype=torch.long)
                per_word.index_add_(0, inverse, torch.from_numpy(flips.astype(np.int64)))
                fix = idx[per_word[inverse] == 1]
                raw[fix] = (raw[fix] & ~mask) | (clean[fix] & mask)
                self.corrected += int((per_word == 1).sum())
                self.uncorrectable += int((per_word > 1).sum())

    def false_alarms(self, model: nn.Module, inputs: Sequence[object]) -> float:
        """1.0 if decoding the clean model corrects or flags any codeword (it never should)."""
        before = self.corrected + self.uncorrectable
        with self.attach(model):
            self.after_fault(model)
        return float(self.corrected + self.uncorrectable > before)

    def cost(self, model: nn.Module) -> dict[str, float]:
        total = prot = check = 0
        for n, p in model.named_parameters():
            lay = layout_of(p.dtype)
            total += p.numel() * lay.bits
            if self._covers(n):
                prot += p.numel() * bin(self.mask(p.dtype)).count("1")
                check += -(-p.numel() // self.per_codeword(p.dtype)) * SECDED_CHECK_BITS
        return {
            "protected_bits_share": prot / max(total, 1),
            "extra_bytes": check / 8,
            "storage_overhead": check / max(total, 1),
        }
