"""Error models: how a fault changes the storage bits of one element, and the fault record.

A :class:`Fault` is concrete and replayable: which tensor, which flat element, which bit
operation with which mask. Error models (:class:`BitFlip`, :class:`MultiBitFlip`,
:class:`BurstFlip`, :class:`StuckAt`, :class:`RandomValue`) draw faults from a
``numpy.random.Generator``, so a seed fixes the whole fault list; :func:`draw_ber` draws the
set of flips of a bit-error-rate trial (every stored bit flips with probability ``p``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import torch

from stalwart.errors import ConfigError
from stalwart.inject.bits import BitLayout

__all__ = [
    "BitFlip",
    "BurstFlip",
    "ErrorModel",
    "Fault",
    "MultiBitFlip",
    "OPS",
    "RandomValue",
    "StuckAt",
    "draw_ber",
    "error_model",
]

Op = Literal["xor", "set", "clear", "assign"]
OPS: tuple[str, ...] = ("xor", "set", "clear", "assign")
KINDS: tuple[str, ...] = ("param", "activation", "grad", "optim")


@dataclass(frozen=True)
class Fault:
    """One corruption of one element, exact enough to replay bit for bit.

    The new storage word is ``old ^ mask`` (``xor``), ``old | mask`` (``set``, stuck-at-1),
    ``old & ~mask`` (``clear``, stuck-at-0) or ``mask`` itself (``assign``, a random value).
    """

    target: str
    """Parameter or buffer name (``fc1.weight``); module name for activations."""
    index: int
    """Flat element index in the target tensor (for activations: in one sample's output)."""
    mask: int
    """Bits touched, as a non-negative int; for ``assign`` the raw word written."""
    op: Op = "xor"
    kind: str = "param"
    """``param`` (parameters and buffers), ``activation``, ``grad`` or ``optim``."""
    sample: int = -1
    """Activations: the batch element the fault hits (-1: every element)."""
    state: str = ""
    """Optimizer state key (``exp_avg``) for ``kind="optim"``."""

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ConfigError(f"fault op {self.op!r} is not one of {', '.join(OPS)}")
        if self.kind not in KINDS:
            raise ConfigError(f"fault kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.index < 0 or self.mask < 0:
            raise ConfigError(f"fault index and mask must be >= 0, got {self.index}, {self.mask}")

    @property
    def bits(self) -> list[int]:
        """Bit positions in the mask (empty for ``assign``)."""
        return (
            []
            if self.op == "assign"
            else [b for b in range(self.mask.bit_length()) if self.mask >> b & 1]
        )


class ErrorModel(Protocol):
    """Draws ``n`` single-element faults for a tensor of ``numel`` elements."""

    @property
    def name(self) -> str:
        """Short name for tables and manifests."""
        ...

    def draw(
        self, layout: BitLayout, numel: int, n: int, rng: np.random.Generator
    ) -> tuple[np.ndarray, list[int], Op]:
        """Element indices (int64, shape (n,)), masks and the op."""
        ...


_WIDEST = 64
"""Storage bits of the widest dtype: a listed bit at or past it is in no tensor at all."""


def _bits(layout: BitLayout, bits: Sequence[int] | None, field_: str | None) -> np.ndarray:
    """The bits of ``layout`` a random flip may pick: those of ``bits`` (default all) that
    the dtype has, in ``field_`` if given.

    A list of bits is kept per dtype, as ``field_`` is: one error model then serves a model
    holding float32 and float16 tensors (bits 16..31 exist only in the float32 ones), as
    when :func:`~stalwart.vulnerability.pvf` narrows a round to the bits still too wide.
    """
    if bits is not None:
        for b in bits:
            if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < _WIDEST:
                raise ConfigError(
                    f"bit {b!r} is in no dtype: storage bits are 0..{_WIDEST - 1} at most "
                    "(bit 0 is the least significant); pick bits in that range"
                )
        allowed = sorted(b for b in set(bits) if b < layout.bits)
    else:
        allowed = list(range(layout.bits))
    if field_ is not None:
        allowed = [b for b in allowed if layout.field(b) == field_]
    if not allowed:
        raise ConfigError(
            f"no bit of {layout.name} (storage bits 0..{layout.bits - 1}) matches bits={bits} "
            f"field={field_!r}; pick bits this dtype has, or leave its tensors out of targets"
        )
    return np.asarray(allowed, dtype=np.int64)


class _UniformElement(ABC):
    """An error model whose fault hits a uniformly drawn element: :meth:`draw` draws the
    elements, then :meth:`masks` says what happens to each (in that order, so a seed gives
    the same faults as it always has)."""

    def draw(
        self, layout: BitLayout, numel: int, n: int, rng: np.random.Generator
    ) -> tuple[np.ndarray, list[int], Op]:
        """Element indices (int64, shape (n,)), masks and the op (see :class:`ErrorModel`)."""
        idx = rng.integers(0, numel, n)
        masks, op = self.masks(layout, n, rng)
        return idx, masks, op

    @abstractmethod
    def masks(self, layout: BitLayout, n: int, rng: np.random.Generator) -> tuple[list[int], Op]:
        """The ``n`` drawn elements' masks and the op that applies them."""


@dataclass(frozen=True)
class BitFlip(_UniformElement):
    """Flip one bit: ``bit`` if given, else uniform over ``bits`` (default all) or ``field``.

    ``bits`` hold per dtype: a tensor draws among those of them its dtype has (a float16
    tensor ignores bits 16..31), and only a tensor that has none of them is refused.
    """

    bit: int | None = None
    bits: Sequence[int] | None = None
    field: str | None = None
    """Restrict random bits to ``sign``, ``exponent``, ``mantissa`` or ``value``."""
    name: str = "bitflip"

    def masks(self, layout: BitLayout, n: int, rng: np.random.Generator) -> tuple[list[int], Op]:
        if self.bit is not None:
            layout.check_bit(self.bit)
            return [1 << self.bit] * n, "xor"
        pick = rng.choice(_bits(layout, self.bits, self.field), n)
        return [1 << int(b) for b in pick], "xor"


@dataclass(frozen=True)
class MultiBitFlip(_UniformElement):
    """Flip ``count`` distinct bits of one element, chosen uniformly among ``bits``."""

    count: int = 2
    bits: Sequence[int] | None = None
    name: str = "multibit"

    def masks(self, layout: BitLayout, n: int, rng: np.random.Generator) -> tuple[list[int], Op]:
        allowed = _bits(layout, self.bits, None)
        if not 1 <= self.count <= len(allowed):
            raise ConfigError(f"count={self.count} must be in 1..{len(allowed)} for {layout.name}")
        masks = [
            sum(1 << int(b) for b in rng.choice(allowed, self.count, replace=False))
            for _ in range(n)
        ]
        return masks, "xor"


@dataclass(frozen=True)
class BurstFlip(_UniformElement):
    """Flip ``length`` adjacent bits of one element, starting at a uniform position."""

    length: int = 2
    name: str = "burst"

    def masks(self, layout: BitLayout, n: int, rng: np.random.Generator) -> tuple[list[int], Op]:
        if not 1 <= self.length <= layout.bits:
            raise ConfigError(f"burst length {self.length} must be in 1..{layout.bits}")
        start = rng.integers(0, layout.bits - self.length + 1, n)
        return [((1 << self.length) - 1) << int(s) for s in start], "xor"


@dataclass(frozen=True)
class StuckAt(_UniformElement):
    """Force one bit to ``value`` (0 or 1): ``bit`` if given, else uniform over the word."""

    value: int = 1
    bit: int | None = None
    name: str = "stuck_at"

    def __post_init__(self) -> None:
        if self.value not in (0, 1):
            raise ConfigError(f"stuck-at value must be 0 or 1, got {self.value!r}")

    def masks(self, layout: BitLayout, n: int, rng: np.random.Generator) -> tuple[list[int], Op]:
        masks, _ = BitFlip(self.bit).masks(layout, n, rng)
        return masks, "set" if self.value else "clear"


@dataclass(frozen=True)
class RandomValue(_UniformElement):
    """Replace an element by a random value: uniform in [low, high] when given (floats),
    else a uniformly random storage word (any bit pattern, NaN and Inf included)."""

    low: float | None = None
    high: float | None = None
    name: str = "random_value"

    def masks(self, layout: BitLayout, n: int, rng: np.random.Generator) -> tuple[list[int], Op]:
        if self.low is None or self.high is None:
            words = rng.integers(0, 1 << min(layout.bits, 63), n, dtype=np.uint64)
            if layout.bits == 64:  # numpy cannot draw 64-bit words in one call
                words |= rng.integers(0, 2, n, dtype=np.uint64) << np.uint64(63)
            return [int(w) for w in words], "assign"
        vals = torch.tensor(rng.uniform(self.low, self.high, n), dtype=layout.dtype)
        raw = vals.view(layout.storage).tolist()
        return [int(v) & ((1 << layout.bits) - 1) for v in raw], "assign"


def draw_ber(
    layout: BitLayout, numel: int, p: float, rng: np.random.Generator
) -> tuple[np.ndarray, list[int]]:
    """Every stored bit flips independently with probability ``p``.

    Returns:
        Distinct element indices (sorted) and the XOR mask of each.
    """
    if not 0.0 <= p <= 1.0:
        raise ConfigError(f"bit error rate must be in [0, 1], got {p}")
    total = numel * layout.bits
    k = int(rng.binomial(total, p))
    if k == 0:
        return np.zeros(0, dtype=np.int64), []
    pos = np.sort(rng.choice(total, k, replace=False))
    elem, bit = np.divmod(pos, layout.bits)
    uniq = np.unique(elem)
    masks = [0] * len(uniq)
    owner = np.searchsorted(uniq, elem)
    for o, b in zip(owner.tolist(), bit.tolist(), strict=True):
        masks[o] |= 1 << b
    return uniq.astype(np.int64), masks


_MODELS: dict[str, type] = {
    "bitflip": BitFlip,
    "multibit": MultiBitFlip,
    "burst": BurstFlip,
    "stuck_at": StuckAt,
    "random_value": RandomValue,
}


def error_model(spec: str | ErrorModel) -> ErrorModel:
    """An error model from its name (``bitflip``, ``multibit``, ``burst``, ``stuck_at``,
    ``random_value``) or the model itself."""
    if not isinstance(spec, str):
        return spec
    try:
        return _MODELS[spec]()
    except KeyError:
        raise ConfigError(
            f"unknown error model {spec!r}; use one of {', '.join(_MODELS)}"
        ) from None
