"""Selective bit protection as real stored redundancy: a shadow copy of the protected bits
of every protected word, plus one parity bit per word, checked and corrected before every
forward pass.

Layout per protected tensor (``n`` words, protected bits ``lo..hi``, ``w = hi - lo + 1``):

* ``shadow``: the protected field of each word, ``(word & mask) >> lo``, in the narrowest
  integer dtype that holds it (fp32 sign + exponent: 9 bits in an int16, 2 bytes a word);
* ``parity``: the parity of those bits, one bit per word, packed 8 to a byte.

The check (a forward pre-hook on the model, so its time is part of every measured forward)
compares each word's protected field with its shadow. Where they differ, the parity bit
arbitrates: a word whose field no longer matches the parity is restored from the shadow; a
shadow that no longer matches it is refreshed from the word; when both still match (an even
number of flips in one copy) the word is restored from the shadow and the case is counted as
``ambiguous``; when neither matches both copies are damaged: detected, left as they are
(``uncorrectable``). Unprotected bits are never read or written.

Unlike :class:`stalwart.protect.SelectiveBitProtection` (which models an SECDED code and
times nothing), every byte of this redundancy exists, and its cost is measured.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stalwart.errors import ConfigError
from stalwart.inject.bits import layout_of, signed_mask
from stalwart.inject.targets import Pattern, matches
from stalwart.protect.base import Protection
from stalwart.protect.ecc import bit_mask, chosen_bits

__all__ = ["ShadowBitProtection"]


def _parity(field: torch.Tensor, width: int) -> torch.Tensor:
    """Parity (0/1, int64) of the low ``width`` bits of each value (a signed field's
    sign-extension bits are masked off first: they are not stored bits)."""
    v = field.to(torch.int64)
    if width < 64:
        v = v & ((1 << width) - 1)
    for s in (32, 16, 8, 4, 2, 1):
        v = v ^ (v >> s)
    return v & 1


def _narrow(width: int, signed: bool) -> torch.dtype:
    """The narrowest integer dtype holding a ``width``-bit field (signed: two's complement)."""
    need = width if signed else width + 1
    for dt, bits in ((torch.int8, 8), (torch.int16, 16), (torch.int32, 32)):
        if need <= bits:
            return dt
    return torch.int64


@dataclass
class _Store:
    """The redundancy kept for one tensor."""

    raw: torch.Tensor
    """Integer view of the live parameter's words (writes go to the parameter)."""
    mask: int
    """Protected bits as a value of the storage dtype."""
    keep: int
    """Unprotected bits as a value of the storage dtype."""
    lo: int
    width: int
    shadow: torch.Tensor
    parity: torch.Tensor
    """One bit per word, packed little-endian into uint8."""

    def field(self, words: torch.Tensor) -> torch.Tensor:
        return ((words & self.mask) >> self.lo).to(self.shadow.dtype)

    def parity_of(self, idx: torch.Tensor) -> torch.Tensor:
        return (self.parity[idx >> 3].to(torch.int64) >> (idx & 7)) & 1

    def nbytes(self) -> int:
        return self.shadow.numel() * self.shadow.element_size() + self.parity.numel()


def _pack(bits: torch.Tensor) -> torch.Tensor:
    pad = (-bits.numel()) % 8
    b = torch.cat([bits.to(torch.uint8), bits.new_zeros(pad, dtype=torch.uint8)]).view(-1, 8)
    weights = (1 << torch.arange(8, device=b.device)).to(torch.int64)
    return (b.to(torch.int64) * weights).sum(1).to(torch.uint8)


class ShadowBitProtection(Protection):
    """Protect ``bits`` (fields like ``("sign", "exponent")`` or bit positions) of the
    floating-point tensors matching ``tensors`` with a stored shadow copy and parity.

    The redundancy is built from ``model`` now, so build it from the clean model.

    Attributes:
        checks: forward passes checked since the protection was made.
        alarms: checks that found at least one word differing from its shadow.
        corrected: words restored from the shadow.
        shadow_repaired: shadow entries refreshed from their (intact) word.
        ambiguous: corrections where both copies passed parity (even flips in one copy).
        uncorrectable: words where both copies failed parity (left as they are).
    """

    basis = "measured"

    def __init__(
        self,
        model: nn.Module,
        bits: Sequence[str] | Sequence[int] = ("sign", "exponent"),
        tensors: Pattern = "*",
        *,
        name: str = "sbp-shadow",
    ) -> None:
        self.bits, self.tensors = chosen_bits(bits, tensors)
        self.name = name
        self.stores: dict[str, _Store] = {}
        self._total_bits = 0
        self._protected_bits = 0
        for n, p in model.named_parameters():
            self._total_bits += p.numel() * p.element_size() * 8
            if p.dtype.is_floating_point and matches(n, self.tensors):
                self.stores[n] = self._store(p)
        if not self.stores:
            raise ConfigError(
                f"no floating-point parameter matches {self.tensors}; pass a pattern like "
                "'top.*' that names the tensors to protect"
            )
        self.checks = self.alarms = self.corrected = 0
        self.shadow_repaired = self.ambiguous = self.uncorrectable = 0
        self.method = (
            "measured: stored shadow of the protected bits + 1 parity bit a word, checked "
            "and corrected before every forward (its time is in the runtime column)"
        )

    def _mask(self, dtype: torch.dtype) -> int:
        return bit_mask(self.bits, dtype)

    def _store(self, p: torch.Tensor) -> _Store:
        lay = layout_of(p.dtype)
        mask = self._mask(p.dtype)
        if mask == 0:
            raise ConfigError(f"bits {self.bits} select no bit of {lay.name}")
        lo, hi = (mask & -mask).bit_length() - 1, mask.bit_length() - 1
        unsigned = lay.storage is torch.uint8
        # A field that reaches a signed word's top bit comes out sign-extended by >>.
        signed = not unsigned and hi == lay.bits - 1
        sdt = torch.uint8 if unsigned else _narrow(hi - lo + 1, signed)
        full = (1 << lay.bits) - 1
        raw = p.detach().view(lay.storage).view(-1)
        store = _Store(
            raw,
            signed_mask(mask, lay),
            signed_mask(full ^ mask, lay),
            lo,
            hi - lo + 1,
            torch.empty(0, dtype=sdt),
            torch.empty(0),
        )
        store.shadow = store.field(raw).clone()
        self._protected_bits += p.numel() * bin(mask).count("1")
        store.parity = _pack(_parity(store.shadow, store.width))
        return store

    def check(self) -> int:
        """Compare every protected word with its shadow and repair; returns the number of
        words found differing."""
        found = 0
        with torch.no_grad():
            for s in self.stores.values():
                cur = s.field(s.raw)
                idx = (cur != s.shadow).nonzero().view(-1)
                if len(idx) == 0:
                    continue
                found += len(idx)
                self._repair(s, idx, cur[idx])
        self.checks += 1
        self.alarms += found > 0
        return found

    def _repair(self, s: _Store, idx: torch.Tensor, cur: torch.Tensor) -> None:
        stored = s.parity_of(idx)
        word_ok = _parity(cur, s.width) == stored
        shadow_ok = _parity(s.shadow[idx], s.width) == stored
        fix_word = shadow_ok
        fix_shadow = word_ok & ~shadow_ok
        w = idx[fix_word]
        s.raw[w] = (s.raw[w] & s.keep) | (s.shadow[w].to(s.raw.dtype) << s.lo)
        s.shadow[idx[fix_shadow]] = cur[fix_shadow]
        self.corrected += int(fix_word.sum())
        self.shadow_repaired += int(fix_shadow.sum())
        self.ambiguous += int((word_ok & shadow_ok).sum())
        self.uncorrectable += int((~word_ok & ~shadow_ok).sum())

    @contextlib.contextmanager
    def attach(self, model: nn.Module) -> Iterator[None]:
        """Check (and correct) the protected words before every forward of ``model``."""

        def hook(module: nn.Module, args: Any) -> None:
            self.check()

        handle = model.register_forward_pre_hook(hook)
        try:
            yield
        finally:
            handle.remove()

    def false_alarms(self, model: nn.Module, inputs: Sequence[Any]) -> float:
        """Share of checks of the clean model that found a difference (0 unless the model
        changed since the shadow was taken)."""
        before = self.alarms
        self.check()
        return float(self.alarms - before)

    def cost(self, model: nn.Module) -> dict[str, float]:
        extra = sum(s.nbytes() for s in self.stores.values())
        return {
            "protected_bits_share": self._protected_bits / max(self._total_bits, 1),
            "extra_bytes": float(extra),
            "storage_overhead": extra * 8 / max(self._total_bits, 1),
        }
