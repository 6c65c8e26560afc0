"""Applying faults to tensors and undoing them bit for bit.

Every function here returns an :class:`Injection`: the record of what changed (tensor,
element, storage word before and after) and a context manager whose exit writes the old
words back in reverse order, also when the body raised. Edits go through an integer view
of the storage (:func:`stalwart.inject.bits.raw_view`), never through float arithmetic.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np
import torch
from torch import nn

from stalwart.errors import ConfigError
from stalwart.inject.bits import BitLayout, layout_of, raw_view, signed_mask, unsigned
from stalwart.inject.error_models import Fault, draw_ber
from stalwart.inject.quantized import QuantizedSlot, find_slot, plain_slot
from stalwart.inject.targets import Pattern, resolve, select_tensors

__all__ = [
    "Change",
    "Injection",
    "apply_faults",
    "ber",
    "bitflip",
    "edit_raw",
    "random_value",
    "stuck_at",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Change:
    """One storage word that an injection changed (words as non-negative ints)."""

    target: str
    kind: str
    index: int
    before: int
    after: int


def edit_raw(raw: torch.Tensor, index: torch.Tensor, op: str, mask: torch.Tensor) -> torch.Tensor:
    """New storage words for ``raw[index]`` under ``op``; ``mask`` already in storage dtype."""
    old = raw[index]
    if op == "xor":
        return old ^ mask
    if op == "set":
        return old | mask
    if op == "clear":
        return old & ~mask
    return mask.expand_as(old).clone()


class Injection(AbstractContextManager["Injection"]):
    """Faults applied to live tensors; ``restore()`` (or leaving ``with``) undoes them."""

    def __init__(self) -> None:
        # (label, kind, layout, flat raw view, indices, old words, new words) per applied batch;
        # the new words are kept, since a later edit of the same element changes the live one
        self._edits: list[
            tuple[str, str, BitLayout, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
        ] = []
        # per edit: what else undoes it (a quantized tensor edited through a copy)
        self._undo: dict[int, Callable[[], None]] = {}
        self._active = True

    def _record(
        self,
        label: str,
        kind: str,
        layout: BitLayout,
        raw: torch.Tensor,
        index: torch.Tensor,
        op: str,
        masks: Sequence[int],
    ) -> None:
        if len(index) == 0:
            return
        if len(torch.unique(index)) != len(index):  # repeated element: apply one at a time
            for i, m in zip(index.tolist(), masks, strict=True):
                self._record(label, kind, layout, raw, torch.tensor([i]), op, [m])
            return
        mask = torch.tensor([signed_mask(m, layout) for m in masks], dtype=layout.storage)
        old = raw[index].clone()
        new = edit_raw(raw, index, op, mask)
        raw[index] = new
        self._edits.append((label, kind, layout, raw, index, old, new))

    def record(
        self,
        tensor: torch.Tensor,
        label: str,
        kind: str,
        index: torch.Tensor,
        op: str,
        masks: Sequence[int],
    ) -> None:
        """Edit ``tensor``'s flat elements ``index`` now (one mask each, ``op``: the fault's
        op) and keep the old words for :meth:`restore`; ``label`` names the tensor."""
        layout = layout_of(tensor.dtype, label)
        for i, m in zip(index.tolist(), masks, strict=True):
            _numel_check(tensor, i, label)
            layout.check_mask(m)
        self._record(label, kind, layout, raw_view(tensor, label), index, op, masks)

    def record_quantized(
        self,
        slot: QuantizedSlot,
        part: str,
        label: str,
        index: torch.Tensor,
        op: str,
        masks: Sequence[int],
    ) -> None:
        """Edit a copy of the part's words, rebuild the tensor, put it back; undo puts back
        the original (see :mod:`stalwart.inject.quantized`)."""
        words = slot.component(part)
        before = len(self._edits)
        self.record(words, label, "param", index, op, masks)
        if len(self._edits) == before:
            return
        original = slot.snapshot()
        self._undo[len(self._edits) - 1] = lambda: slot.put(original)
        slot.put(slot.rebuild(part, words))

    @property
    def changes(self) -> list[Change]:
        """Every changed word, in the order the changes were made: each edit's word before
        and the word it wrote (an element edited twice is listed twice; also after
        :meth:`restore`, as the record of what the injection did)."""
        out = []
        for label, kind, layout, _, index, old, new in self._edits:
            for j, i in enumerate(index.tolist()):
                before, after = unsigned(int(old[j]), layout), unsigned(int(new[j]), layout)
                out.append(Change(label, kind, i, before, after))
        return out

    @property
    def active(self) -> bool:
        return self._active

    def restore(self) -> None:
        """Write every old word back, newest first; calling it twice is harmless."""
        if not self._active:
            return
        with torch.no_grad():
            for i in reversed(range(len(self._edits))):
                _, _, _, raw, index, old, _ = self._edits[i]
                raw[index] = old
                if i in self._undo:
                    self._undo[i]()
        self._active = False

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.restore()

    def __len__(self) -> int:
        return sum(len(e[4]) for e in self._edits)

    def __repr__(self) -> str:
        state = "active" if self._active else "restored"
        return f"Injection({len(self)} words, {state})"


def _numel_check(tensor: torch.Tensor, index: int, what: str) -> None:
    if not 0 <= index < tensor.numel():
        raise ConfigError(
            f"index {index} is outside {what}, which has {tensor.numel()} elements "
            f"(shape {tuple(tensor.shape)}); use a flat index in 0..{tensor.numel() - 1}"
        )


def _record_target(
    inj: Injection,
    model: nn.Module,
    target: str,
    kind: str,
    index: torch.Tensor,
    op: str,
    masks: Sequence[int],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    state: str = "",
) -> None:
    """Edit ``target``'s elements ``index``: in place, or through a quantized tensor's copy."""
    found = find_slot(model, target) if kind == "param" else None
    if found is None:
        tensor = resolve(model, target, kind, optimizer=optimizer, state=state)
        inj.record(tensor, target, kind, index, op, masks)
    else:
        inj.record_quantized(*found, target, index, op, masks)


def apply_faults(
    model: nn.Module,
    faults: Iterable[Fault],
    *,
    optimizer: torch.optim.Optimizer | None = None,
) -> Injection:
    """Apply parameter, buffer, gradient or optimizer-state faults now.

    Activation faults need a forward pass; use :func:`stalwart.inject.activation_faults`.

    Returns:
        The :class:`Injection`; use it as a context manager to undo on exit.
    """
    inj = Injection()
    groups: dict[tuple[str, str, str, str], list[Fault]] = {}
    for f in faults:
        if f.kind == "activation":
            raise ConfigError("activation faults act during forward; use activation_faults()")
        groups.setdefault((f.kind, f.target, f.state, f.op), []).append(f)
    try:
        with torch.no_grad():
            for (kind, target, state, op), fs in groups.items():
                index = torch.tensor([f.index for f in fs], dtype=torch.long)
                _record_target(
                    inj,
                    model,
                    target,
                    kind,
                    index,
                    op,
                    [f.mask for f in fs],
                    optimizer=optimizer,
                    state=state,
                )
    except BaseException:
        inj.restore()
        raise
    return inj


def _target(
    model: nn.Module | torch.Tensor, name: str | None
) -> tuple[torch.Tensor, str, tuple[QuantizedSlot, str] | None]:
    """The tensor (for a quantized target: a copy of its words), label and quantized slot."""
    if isinstance(model, torch.Tensor):
        if not model.is_quantized:
            return model, name or "tensor", None
        part = name or "values"
        slot = plain_slot("tensor", model)
        return slot.component(part), f"tensor:{part}", (slot, part)
    if name is None:
        raise ConfigError("name the parameter to corrupt, e.g. bitflip(model, 'fc1.weight', ...)")
    found = find_slot(model, name)
    if found is not None:
        return found[0].component(found[1]), name, found
    return resolve(model, name), name, None


def _flat(tensor: torch.Tensor, index: int | Sequence[int], what: str) -> int:
    if isinstance(index, int):
        _numel_check(tensor, index, what)
        return index
    idx = tuple(index)
    if len(idx) != tensor.dim() or any(
        not 0 <= i < s for i, s in zip(idx, tensor.shape, strict=True)
    ):
        raise ConfigError(f"index {idx} does not fit {what} of shape {tuple(tensor.shape)}")
    return int(np.ravel_multi_index(idx, tuple(tensor.shape)))


def _single(
    model: nn.Module | torch.Tensor,
    name: str | None,
    index: int | Sequence[int],
    op: str,
    mask_of: Any,
) -> Injection:
    tensor, label, quantized = _target(model, name)
    layout = layout_of(tensor.dtype, label)
    flat = _flat(tensor, index, label)
    mask = mask_of(layout)
    layout.check_mask(mask)
    inj = Injection()
    with torch.no_grad():
        if quantized is not None:
            inj.record_quantized(*quantized, label, torch.tensor([flat]), op, [mask])
        else:
            inj.record(tensor, label, "param", torch.tensor([flat]), op, [mask])
    return inj


def _mask(layout: BitLayout, bit: int | Sequence[int]) -> int:
    bits = [bit] if isinstance(bit, int) else list(bit)
    if not bits:
        raise ConfigError("give at least one bit to flip")
    for b in bits:
        layout.check_bit(b)
    return sum(1 << b for b in set(bits))


def bitflip(
    model: nn.Module | torch.Tensor,
    name: str | None = None,
    *,
    index: int | Sequence[int],
    bit: int | Sequence[int],
) -> Injection:
    """Flip ``bit`` (or several bits) of one element of a parameter, buffer or tensor.

    Example:
        >>> with inject.bitflip(model, "fc1.weight", index=123, bit=30):
        ...     out = model(x)        # weights are exact again after the block

    Args:
        model: a module (then ``name`` picks the parameter or buffer) or a tensor.
        name: parameter or buffer name.
        index: flat element index, or one index per dimension.
        bit: storage bit(s), 0 = least significant; 31 is fp32's sign, 30 its exponent MSB.
    """
    return _single(model, name, index, "xor", lambda lay: _mask(lay, bit))


def stuck_at(
    model: nn.Module | torch.Tensor,
    name: str | None = None,
    *,
    index: int | Sequence[int],
    bit: int | Sequence[int],
    value: int,
) -> Injection:
    """Force ``bit`` of one element to ``value`` (0 or 1)."""
    if value not in (0, 1):
        raise ConfigError(f"stuck-at value must be 0 or 1, got {value!r}")
    return _single(model, name, index, "set" if value else "clear", lambda lay: _mask(lay, bit))


def random_value(
    model: nn.Module | torch.Tensor,
    name: str | None = None,
    *,
    index: int | Sequence[int],
    value: float,
) -> Injection:
    """Overwrite one element with ``value`` (rounded to the tensor's dtype)."""

    def word(layout: BitLayout) -> int:
        raw = torch.tensor([value], dtype=layout.dtype).view(layout.storage)
        return unsigned(int(raw[0]), layout)

    return _single(model, name, index, "assign", word)


def ber(
    model: nn.Module,
    rate: float,
    pattern: Pattern = "*",
    *,
    seed: int = 0,
    buffers: bool = False,
) -> Injection:
    """Flip every stored bit of the matching tensors independently with probability ``rate``.

    Example:
        >>> with inject.ber(model, 1e-4, "*.weight", seed=3) as inj:
        ...     auc = evaluate(model)     # len(inj) words were corrupted
    """
    rng = np.random.default_rng(seed)
    inj = Injection()
    try:
        with torch.no_grad():
            tensors = select_tensors(model, pattern, buffers=buffers, quantized=True)
            for name, tensor in tensors.items():
                layout = layout_of(tensor.dtype, name)
                index, masks = draw_ber(layout, tensor.numel(), rate, rng)
                _record_target(inj, model, name, "param", torch.from_numpy(index), "xor", masks)
    except BaseException:
        inj.restore()
        raise
    log.info("ber %.3g: %d words corrupted", rate, len(inj))
    return inj
