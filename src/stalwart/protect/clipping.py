"""Activation clipping (range restriction): clamp module outputs to per-module bounds
profiled on clean data; NaN becomes 0. Cheap, and it stops a flipped exponent from
carrying a 1e38 value through the rest of the network (Ranger; Terrorch)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from stalwart.inject.targets import Pattern, forward_with_hooks, select_modules
from stalwart.protect.base import Protection, batch_size, row_fingerprints

__all__ = ["ActivationClipping"]

_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv2d, nn.EmbeddingBag, nn.Embedding)


class ActivationClipping(Protection):
    """Clamp outputs of the matching modules to bounds seen on clean inputs.

    Args:
        model: the model to profile.
        inputs: clean inputs (a tuple of ``model``'s positional arguments); keep them apart
            from the inputs the protection is scored on (:func:`stalwart.protect.split_inputs`).
        modules: module-name glob(s); default every Linear/Conv2d/Embedding(Bag) but the
            last module (the output itself is not clipped).
        margin: widen bounds by this share of their range.
    """

    def __init__(
        self,
        model: nn.Module,
        inputs: Sequence[Any],
        modules: Pattern | None = None,
        *,
        margin: float = 0.0,
    ) -> None:
        self.name, self.basis = "clip", "measured"
        if modules is None:
            names = [n for n, m in model.named_modules() if isinstance(m, _TYPES)]
            names = names[:-1]
        else:
            names = list(select_modules(model, modules))
        self.bounds: dict[str, tuple[float, float]] = {}
        mods = dict(model.named_modules())
        seen: dict[str, list[float]] = {}

        def grab(name: str) -> Any:
            def hook(m: nn.Module, a: Any, out: Any) -> None:
                if isinstance(out, torch.Tensor):
                    lo, hi = float(out.min()), float(out.max())
                    old = seen.get(name, [lo, hi])
                    seen[name] = [min(old[0], lo), max(old[1], hi)]

            return hook

        forward_with_hooks(model, inputs, {n: mods[n] for n in names}, grab)
        for n, (lo, hi) in seen.items():
            pad = (hi - lo) * margin
            self.bounds[n] = (lo - pad, hi + pad)
        self.calibration_samples = batch_size(inputs)
        self.calibration_rows = row_fingerprints(inputs)
        self.method = f"measured; bounds calibrated on {self.calibration_samples} inputs"

    @contextlib.contextmanager
    def attach(self, model: nn.Module) -> Iterator[None]:
        mods = dict(model.named_modules())

        def clip(lo: float, hi: float) -> Any:
            def hook(m: nn.Module, a: Any, out: torch.Tensor) -> torch.Tensor:
                return torch.nan_to_num(out, nan=0.0).clamp(lo, hi)

            return hook

        handles = [mods[n].register_forward_hook(clip(*b)) for n, b in self.bounds.items()]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def false_alarms(self, model: nn.Module, inputs: Sequence[Any]) -> float:
        """Share of the (clean) ``inputs`` with any clipped module output outside its bounds
        (or NaN): on inputs not used for calibration, how often clipping alters a clean
        activation."""
        n = batch_size(inputs, default=1)
        flagged = torch.zeros(n, dtype=torch.bool)
        mods = dict(model.named_modules())

        def grab(name: str) -> Any:
            lo, hi = self.bounds[name]

            def hook(m: nn.Module, a: Any, out: Any) -> None:
                if isinstance(out, torch.Tensor):
                    out_ = (out < lo) | (out > hi) | out.isnan()
                    rows = out_.reshape(n, -1).any(1) if out.shape[0] == n else out_.any()
                    flagged.logical_or_(rows)

            return hook

        forward_with_hooks(model, inputs, {k: mods[k] for k in self.bounds}, grab)
        return float(flagged.float().mean())

    def cost(self, model: nn.Module) -> dict[str, float]:
        return {"extra_bytes": 8.0 * len(self.bounds), "clipped_modules": float(len(self.bounds))}
