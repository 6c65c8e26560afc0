"""Storage bit layouts per dtype, and raw (integer) views of tensors for exact bit edits.

A fault acts on the bits a tensor really stores: a float32 element is viewed as an int32,
a bfloat16 as an int16, an fp8 as a uint8, through ``Tensor.view(dtype)``, so no value is
ever rounded or re-quantized. Bit 0 is the least significant bit of the storage word.
Masks are kept as non-negative Python ints (bit ``b`` is ``1 << b``) and converted to the
storage dtype's two's-complement value only at the tensor boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stalwart.errors import ConfigError, UnsupportedValueError

__all__ = [
    "BitLayout",
    "layout_of",
    "raw_view",
    "signed_mask",
    "supported_dtypes",
    "unsigned",
]


@dataclass(frozen=True)
class BitLayout:
    """Where sign, exponent and mantissa bits sit in one storage word of a dtype."""

    dtype: torch.dtype
    bits: int
    """Width of one element's storage word, in bits."""
    storage: torch.dtype
    """Integer dtype of the same width that the tensor is viewed as."""
    sign: int | None
    """Bit index of the sign bit (two's-complement MSB for signed ints); None when unsigned."""
    exponent: tuple[int, int] | None = None
    """Lowest and highest exponent bit, inclusive; None for integers."""
    mantissa: tuple[int, int] | None = None
    """Lowest and highest mantissa bit, inclusive; None for integers."""

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def field(self, bit: int) -> str:
        """``sign``, ``exponent``, ``mantissa`` (floats) or ``value`` (integers) of ``bit``."""
        self.check_bit(bit)
        if bit == self.sign and self.exponent is not None:
            return "sign"
        if self.exponent and self.exponent[0] <= bit <= self.exponent[1]:
            return "exponent"
        if self.mantissa and self.mantissa[0] <= bit <= self.mantissa[1]:
            return "mantissa"
        return "sign" if bit == self.sign else "value"

    def field_mask(self, *fields: str) -> int:
        """The mask of every bit whose field is one of ``fields``."""
        return sum(1 << b for b in range(self.bits) if self.field(b) in fields)

    def check_bit(self, bit: int) -> None:
        if not isinstance(bit, int) or isinstance(bit, bool) or not 0 <= bit < self.bits:
            raise ConfigError(
                f"bit {bit!r} is outside {self.name}, whose storage bits are 0..{self.bits - 1} "
                f"(bit 0 is the least significant); pick a bit in that range"
            )

    def check_mask(self, mask: int) -> None:
        if not 0 <= mask < (1 << self.bits):
            raise ConfigError(
                f"bit mask {mask:#x} does not fit {self.name}'s {self.bits} storage bits"
            )


def _f(dtype: torch.dtype, bits: int, storage: torch.dtype, exp: int, man: int) -> BitLayout:
    return BitLayout(dtype, bits, storage, bits - 1, (man, man + exp - 1), (0, man - 1))


_LAYOUTS: dict[torch.dtype, BitLayout] = {
    torch.float64: _f(torch.float64, 64, torch.int64, 11, 52),
    torch.float32: _f(torch.float32, 32, torch.int32, 8, 23),
    torch.float16: _f(torch.float16, 16, torch.int16, 5, 10),
    torch.bfloat16: _f(torch.bfloat16, 16, torch.int16, 8, 7),
    torch.float8_e4m3fn: _f(torch.float8_e4m3fn, 8, torch.uint8, 4, 3),
    torch.float8_e5m2: _f(torch.float8_e5m2, 8, torch.uint8, 5, 2),
    torch.int64: BitLayout(torch.int64, 64, torch.int64, 63),
    torch.int32: BitLayout(torch.int32, 32, torch.int32, 31),
    torch.int16: BitLayout(torch.int16, 16, torch.int16, 15),
    torch.int8: BitLayout(torch.int8, 8, torch.int8, 7),
    torch.uint8: BitLayout(torch.uint8, 8, torch.uint8, None),
}


def supported_dtypes() -> list[str]:
    """Names of the dtypes whose bits can be corrupted."""
    return [layout.name for layout in _LAYOUTS.values()]


def layout_of(dtype: torch.dtype, what: str = "tensor") -> BitLayout:
    """The bit layout of ``dtype``.

    Raises:
        UnsupportedValueError: no layout for this dtype (complex, bool, quantized, ...).
    """
    try:
        return _LAYOUTS[dtype]
    except KeyError:
        raise UnsupportedValueError(
            f"{what} has dtype {dtype}, whose bits stalwart cannot address; supported: "
            f"{', '.join(supported_dtypes())}. A torch quantized tensor is addressed by name "
            "(NAME, NAME:scale, NAME:zero_point; see stalwart.inject.quantized)"
        ) from None


def raw_view(tensor: torch.Tensor, what: str = "tensor") -> torch.Tensor:
    """A flat integer view sharing ``tensor``'s storage: writes to it change ``tensor``.

    Raises:
        UnsupportedValueError: the dtype has no layout, or the tensor is not contiguous
            (a flat view would not address its elements in order).
    """
    layout = layout_of(tensor.dtype, what)
    data = tensor.detach()
    if not data.is_contiguous():
        raise UnsupportedValueError(
            f"{what} is not contiguous, so its elements have no flat storage order; "
            "make the parameter contiguous (p.data = p.data.contiguous()) first"
        )
    return data.view(layout.storage).view(-1)


def signed_mask(mask: int, layout: BitLayout) -> int:
    """``mask`` as a value of ``layout.storage`` (two's complement for signed storage)."""
    if layout.storage is not torch.uint8 and mask >= 1 << (layout.bits - 1):
        return mask - (1 << layout.bits)
    return mask


def unsigned(value: int, layout: BitLayout) -> int:
    """A storage value as the non-negative integer of its bits."""
    return value & ((1 << layout.bits) - 1)
