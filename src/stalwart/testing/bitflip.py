"""Silent data corruption on demand: flip one bit of one element of a member's state.

A :class:`BitFlip` names a worker, the committed step after which its bit flips (once per
process: a rollback that recomputes the step does not flip it again), and either the exact
target (tensor FQN in the flattened ``state_dict()``, flat element index, bit) or a seed and a
bit class to draw it from:

* ``sign``: the sign bit;
* ``exponent``: a bit of the exponent (a low one changes the value by a power of two, the
  highest makes it huge or tiny, still finite unless it was 0);
* ``mantissa``: any bit of the mantissa;
* ``low-mantissa``: one of the lower half of the mantissa's bits: the value stays finite and
  changes by less than 2**-11 of itself (float32), so the loss changes only slightly.

The flip is done in place on the live tensor's bytes (:func:`flip_bit`); the state's
``state_dict()`` must alias the live tensors, as ``nn.Module`` and ``torch.optim`` state dicts
do. It rides in ``STALWART_CHAOS`` with the other faults (:class:`stalwart.testing.KillSchedule`
``flips``) and fires from the ``commit`` point of :func:`stalwart.testing.chaos.install`.

A :class:`GradFlip` (``grad_flips``) instead writes a value (NaN, or a large finite one) into
one element of one parameter's local gradient, or flips one bit of it drawn from a bit class,
after backward, before the commit's all-reduce (chaos point ``collective-enter``): the
in-reduction signals of :mod:`stalwart.elastic.commit` may see it; a parity digest cannot, the
reduction spreads it to every replica alike.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

import torch

from stalwart.errors import ConfigError
from stalwart.tree import flatten

__all__ = [
    "BIT_CLASSES",
    "BitFlip",
    "GradFlip",
    "bit_range",
    "flip_bit",
    "flip_grad",
    "flip_in_state",
]

log = logging.getLogger(__name__)

BIT_CLASSES = ("sign", "exponent", "mantissa", "low-mantissa")
_MANTISSA = {torch.float64: 52, torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
_INT_OF = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def bit_range(dtype: torch.dtype, bit_class: str) -> range:
    """The bits of ``dtype`` (0: the lowest) a flip of ``bit_class`` draws from."""
    if dtype not in _MANTISSA:
        raise ConfigError(f"bit flips need a floating tensor ({sorted(map(str, _MANTISSA))})")
    bits, mant = torch.finfo(dtype).bits, _MANTISSA[dtype]
    ranges = {
        "sign": range(bits - 1, bits),
        "exponent": range(mant, bits - 1),
        "mantissa": range(0, mant),
        "low-mantissa": range(0, mant // 2),
    }
    if bit_class not in ranges:
        raise ConfigError(f"bit class {bit_class!r}: use one of {BIT_CLASSES}")
    return ranges[bit_class]


def flip_bit(t: torch.Tensor, index: int, bit: int) -> tuple[float, float]:
    """Flip bit ``bit`` of flat element ``index`` of ``t`` in place; returns (before, after).

    Raises:
        ConfigError: ``t`` is not contiguous, or ``index`` / ``bit`` out of range.
    """
    if not t.is_contiguous() or not 0 <= index < t.numel():
        raise ConfigError(f"flip at index {index}: need a contiguous tensor of > {index} elements")
    size = t.element_size()
    if not 0 <= bit < 8 * size:
        raise ConfigError(f"bit {bit} out of range for {t.dtype} ({8 * size} bits)")
    flat = t.detach().view(-1)
    before = float(flat[index])
    ints = flat.view(_INT_OF[size])
    mask = 1 << bit
    if size > 1 and bit == 8 * size - 1:
        mask = -(1 << bit)  # the sign bit of the signed view
    with torch.no_grad():
        ints[index : index + 1].bitwise_xor_(torch.tensor(mask, dtype=ints.dtype))
    return before, float(flat[index])


@dataclass(frozen=True)
class BitFlip:
    """Flip one bit of worker ``worker``'s state right after it commits step ``step``.

    Attributes:
        worker: the original worker id.
        step: the committed step after which the bit flips.
        tensor: the tensor's FQN in the flattened ``state_dict()`` (``model.0.weight``,
            ``optimizer.state.0.exp_avg``); empty: drawn from ``seed`` among the floating
            tensors whose FQN starts with ``prefix``.
        index: the flat element index (-1: drawn from ``seed``).
        bit: the bit (0: the lowest; -1: drawn from ``bit_class`` with ``seed``).
        bit_class: one of :data:`BIT_CLASSES`, when ``bit`` is drawn.
        prefix: where a drawn tensor comes from (``model.``: parameters and buffers,
            ``optimizer.``: optimizer state).
        seed: the seed of every draw.
    """

    worker: int
    step: int
    tensor: str = ""
    index: int = -1
    bit: int = -1
    bit_class: str = "mantissa"
    prefix: str = "model."
    seed: int = 0

    def __post_init__(self) -> None:
        if self.step < 1 or self.bit_class not in BIT_CLASSES:
            raise ConfigError(f"{self}: step >= 1 and bit_class in {BIT_CLASSES}")

    def resolve(self, leaves: dict[str, torch.Tensor]) -> tuple[str, int, int]:
        """The (tensor, index, bit) this flip hits among ``leaves`` (FQN -> tensor)."""
        rng = random.Random(self.seed)
        name = self.tensor
        if not name:
            names = sorted(
                n
                for n, t in leaves.items()
                if n.startswith(self.prefix) and t.dtype in _MANTISSA and t.numel()
            )
            if not names:
                raise ConfigError(f"{self}: no floating tensor whose name starts {self.prefix!r}")
            name = rng.choice(names)
        if name not in leaves:
            raise ConfigError(f"{self}: no tensor {name!r} in the state ({sorted(leaves)[:8]}...)")
        t = leaves[name]
        index = self.index if self.index >= 0 else rng.randrange(t.numel())
        bit = self.bit if self.bit >= 0 else rng.choice(bit_range(t.dtype, self.bit_class))
        return name, index, bit


def _local(t: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s local shard (sharing its storage: the flip lands in this rank's shard)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def flip_in_state(state: Any, flip: BitFlip) -> tuple[str, int, int, float, float]:
    """Apply ``flip`` to ``state`` (its ``state_dict()`` must alias the live tensors; a
    ``DTensor``: this rank's local shard).

    Returns:
        The tensor, index, bit, and the element's value before and after.
    """
    leaves = {n: _local(leaf.tensor) for n, leaf in flatten(state.state_dict()).leaves.items()}
    name, index, bit = flip.resolve(leaves)
    before, after = flip_bit(leaves[name], index, bit)
    log.warning("chaos: worker %s flipped bit %d of %s[%d]: %r -> %r", flip.worker, bit, name,
                index, before, after)  # fmt: skip
    return name, index, bit, before, after


@dataclass(frozen=True)
class GradFlip:
    """Corrupt one element of worker ``worker``'s local gradient while it attempts step ``step``.

    Either writes ``value`` into the element, or (``bit_class`` given) flips one bit of it,
    drawn from that class with ``seed`` (as :class:`BitFlip` draws).

    Attributes:
        worker: the original worker id.
        step: the step being attempted (committed steps so far); once per process, so the
            retried step computes clean.
        param: the parameter's name in ``state.model.named_parameters()`` (empty: the first;
            with ``bit_class``, drawn from ``seed``).
        index: the flat element index (with ``bit_class``, -1: drawn from ``seed``).
        value: what the element becomes (NaN, inf, or a large finite value); unused with
            ``bit_class``.
        bit_class: empty: write ``value``; else one of :data:`BIT_CLASSES`, a bit flipped.
        seed: the seed of every draw.
    """

    worker: int
    step: int
    param: str = ""
    index: int = 0
    value: float = float("nan")
    bit_class: str = ""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.bit_class and self.bit_class not in BIT_CLASSES:
            raise ConfigError(f"{self}: bit_class empty (write value) or in {BIT_CLASSES}")


def flip_grad(state: Any, flip: GradFlip) -> str:
    """Apply ``flip`` to the gradient of ``state.model``'s parameter; returns its name."""
    params = dict(getattr(state, "model", state).named_parameters())
    if flip.bit_class:
        grads = {n: _local(p.grad) for n, p in params.items() if p.grad is not None}
        as_bit = BitFlip(flip.worker, max(flip.step, 1), flip.param, flip.index,
                         bit_class=flip.bit_class, prefix="", seed=flip.seed)  # fmt: skip
        name, index, bit = as_bit.resolve(grads)
        before, after = flip_bit(grads[name], index, bit)
        log.warning("chaos: worker %s flipped bit %d of %s.grad[%d]: %r -> %r", flip.worker,
                    bit, name, index, before, after)  # fmt: skip
        return name
    name = flip.param or next(iter(params), "")
    if name not in params or params[name].grad is None:
        raise ConfigError(f"{flip}: no parameter {name!r} with a gradient ({sorted(params)})")
    with torch.no_grad():
        _local(params[name].grad).view(-1)[flip.index] = flip.value
    log.warning("chaos: worker %s set %s.grad[%d] to %r", flip.worker, name, flip.index,
                flip.value)  # fmt: skip
    return name
