"""Torch quantized tensors as fault targets: stored integers, scale and zero point.

A quantized tensor (``torch.quantize_per_tensor`` / ``quantize_per_channel``, or the weight
that ``torch.ao.quantization`` packs into a ``Dynamic``/static quantized ``Linear`` or
``Conv``) stores three things a fault can hit, each a target of its own:

* ``NAME`` — the stored integers (int8 for ``qint8``, uint8 for ``quint8``, int32 for
  ``qint32``): the words ``int_repr()`` shows;
* ``NAME:scale`` — the scale(s) as torch stores them (float64: one per tensor, or one per
  channel);
* ``NAME:zero_point`` — the zero point(s) (int64).

For a packed module weight ``NAME`` is ``<module>.weight``. ``int_repr()`` and the qparams
are copies, so an edit is applied by rebuilding the quantized tensor from the edited copy
and putting it back: ``copy_`` into a plain quantized parameter or buffer (same object, same
storage), ``set_weight_bias`` into a packed module (which re-packs it). The undo puts back
the original tensor, so it is exact bit for bit. A float16 packed weight (``quantize_dynamic``
with ``dtype=torch.float16``) has only its values as a target.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from stalwart.errors import ConfigError

__all__ = [
    "PARTS",
    "QuantizedSlot",
    "find_slot",
    "part_of",
    "plain_slot",
    "quantized_slots",
    "quantized_targets",
]

PARTS: tuple[str, ...] = ("values", "scale", "zero_point")
"""What a target name addresses: ``values`` (no suffix), ``:scale``, ``:zero_point``."""


def part_of(name: str) -> tuple[str, str]:
    """``("fc1.weight", "scale")`` for ``"fc1.weight:scale"``; ``(name, "values")`` else."""
    base, sep, part = name.rpartition(":")
    if not sep:
        return name, "values"
    if part not in PARTS[1:]:
        raise ConfigError(
            f"{name!r}: a quantized target ends in ':scale' or ':zero_point', not ':{part}'"
        )
    return base, part


@dataclass(frozen=True)
class QuantizedSlot:
    """Where one quantized (or packed) tensor lives, and how to read and replace it."""

    name: str
    module: nn.Module
    """The module that owns the tensor (for module-type filters)."""
    get: Callable[[], torch.Tensor]
    put: Callable[[torch.Tensor], None]
    packed: bool
    """True for a packed module weight (``put`` re-packs), False for a plain tensor."""

    def parts(self) -> tuple[str, ...]:
        return PARTS if self.get().is_quantized else PARTS[:1]

    def component(self, part: str) -> torch.Tensor:
        """A contiguous copy of ``part``'s stored words (int_repr, scales or zero points)."""
        q = self.get()
        if part not in self.parts():
            raise ConfigError(
                f"{self.name} ({q.dtype}) has no {part}; its targets are "
                + ", ".join(_name(self.name, p) for p in self.parts())
            )
        if part == "values":
            return (q.int_repr() if q.is_quantized else q.detach()).clone().contiguous()
        per_channel = q.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric)
        if part == "scale":
            if per_channel:
                return q.q_per_channel_scales().to(torch.float64).clone().contiguous()
            return torch.tensor([q.q_scale()], dtype=torch.float64)
        if per_channel:
            return q.q_per_channel_zero_points().to(torch.int64).clone().contiguous()
        return torch.tensor([q.q_zero_point()], dtype=torch.int64)

    def rebuild(
        self, part: str, new: torch.Tensor, original: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The tensor with ``part`` replaced by ``new`` (a :meth:`component`-shaped tensor);
        ``original``: the current tensor when the caller holds it (saves unpacking it)."""
        q = self.get() if original is None else original
        if not q.is_quantized:
            return new
        values = new if part == "values" else q.int_repr()
        if q.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
            scales = new if part == "scale" else q.q_per_channel_scales().to(torch.float64)
            zps = new if part == "zero_point" else q.q_per_channel_zero_points().to(torch.int64)
            return torch._make_per_channel_quantized_tensor(
                values, scales, zps, q.q_per_channel_axis()
            )
        scale = float(new[0]) if part == "scale" else q.q_scale()
        zp = int(new[0]) if part == "zero_point" else q.q_zero_point()
        return torch._make_per_tensor_quantized_tensor(values, scale, zp)

    def snapshot(self) -> torch.Tensor:
        """What :meth:`put` needs to undo every later edit exactly."""
        q = self.get()
        return q if self.packed else q.clone()


def _name(base: str, part: str) -> str:
    return base if part == "values" else f"{base}:{part}"


def _packed(module: nn.Module) -> bool:
    return callable(getattr(module, "set_weight_bias", None)) and callable(
        getattr(module, "_weight_bias", None)
    )


def plain_slot(name: str, tensor: torch.Tensor, module: nn.Module | None = None) -> QuantizedSlot:
    """The slot of a quantized tensor edited in place (``copy_`` keeps the object)."""

    def put(w: torch.Tensor) -> None:
        with torch.no_grad():
            tensor.copy_(w)  # copies the words and the quantizer

    return QuantizedSlot(name, module or nn.Module(), lambda: tensor, put, False)


def quantized_slots(model: nn.Module) -> dict[str, QuantizedSlot]:
    """Every quantized parameter or buffer, and every packed module weight, by name."""
    slots: dict[str, QuantizedSlot] = {}
    packed_owners: list[str] = []
    for mod_name, module in model.named_modules():
        if any(mod_name.startswith(p + ".") for p in packed_owners):
            continue  # the packed-params submodule of a module already listed
        prefix = f"{mod_name}." if mod_name else ""
        if _packed(module):
            packed_owners.append(mod_name)

            def put(w: torch.Tensor, m: nn.Module = module) -> None:
                m.set_weight_bias(w, m._weight_bias()[1])  # type: ignore[operator]

            def get(m: nn.Module = module) -> torch.Tensor:
                return m._weight_bias()[0]  # type: ignore[operator]

            slots[prefix + "weight"] = QuantizedSlot(prefix + "weight", module, get, put, True)
            continue
        tensors = list(module.named_parameters(recurse=False))
        tensors += list(module.named_buffers(recurse=False))
        for leaf, t in tensors:
            if t is not None and t.is_quantized:
                slots[prefix + leaf] = plain_slot(prefix + leaf, t, module)
    return slots


def quantized_targets(
    model: nn.Module, slots: dict[str, QuantizedSlot] | None = None
) -> dict[str, torch.Tensor]:
    """Every quantized target name with a copy of its words (for dtype, shape and numel)."""
    out: dict[str, torch.Tensor] = {}
    for name, slot in (quantized_slots(model) if slots is None else slots).items():
        for part in slot.parts():
            out[_name(name, part)] = slot.component(part)
    return out


def find_slot(model: nn.Module, name: str) -> tuple[QuantizedSlot, str] | None:
    """The slot and part a target name addresses, or None when it is not quantized."""
    base, part = part_of(name)
    slot = quantized_slots(model).get(base)
    if slot is None:
        if part != "values":
            raise ConfigError(
                f"{base!r} is not a quantized tensor of {type(model).__name__}, so it has no "
                f"{part}; quantized targets: {', '.join(quantized_targets(model)) or 'none'}"
            )
        return None
    return slot, part
