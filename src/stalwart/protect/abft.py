"""Algorithm-based fault tolerance: checksums for Linear, Conv2d and EmbeddingBag outputs.

For ``y = x W^T + b`` the output row sum must equal ``x · colsum(W) + sum(b)``, with the
column sums taken from the *clean* weights when the protection is made; Conv2d checks the
sum over output channels against a convolution with the summed kernel; EmbeddingBag checks
each bag's sum against the clean row sums of the rows it read. The detection threshold
comes only from fault-free quantities (never from the faulty output, whose overflow would
hide the fault): ``factor`` x the largest residual seen on clean data, relative to
``|x| · colsum(|W|)``. On an alarm the module's damaged weights are restored from the clean
copy (found by per-row checksums) and the output is recomputed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stalwart.inject.targets import Pattern, select_modules
from stalwart.protect.base import Protection, batch_size, row_fingerprints

__all__ = ["ABFT"]

_TYPES = (nn.Linear, nn.Conv2d, nn.EmbeddingBag)


def _check(
    m: Any,
    x: torch.Tensor,
    y: torch.Tensor,
    ref: dict[str, torch.Tensor],
    extra: tuple[Any, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual and fault-free scale per output row (Linear/EmbeddingBag) or pixel (Conv)."""
    y = y.float()
    if isinstance(m, nn.Linear):
        x = x.float()
        pred = x @ ref["colsum"] + ref["bsum"]
        return (y.sum(-1) - pred).abs(), x.abs() @ ref["abscol"] + ref["absb"]
    if isinstance(m, nn.Conv2d):
        x = x.float()
        pred = m._conv_forward(x, ref["colsum"], None)[:, 0] + ref["bsum"]
        scale = m._conv_forward(x.abs(), ref["abscol"], None)[:, 0] + ref["absb"]
        return (y.sum(1) - pred).abs(), scale
    offsets = extra[0] if extra else None
    rows, abs_rows = ref["rowsum"], ref["absrow"]
    pred = F.embedding_bag(x, rows[:, None], offsets, mode=m.mode)[:, 0]
    scale = F.embedding_bag(x, abs_rows[:, None], offsets, mode=m.mode)[:, 0]
    return (y.sum(-1) - pred).abs(), scale


class ABFT(Protection):
    """Checksum-protect the matching Linear/Conv2d/EmbeddingBag modules.

    Args:
        model: the clean model (checksums and the clean copy are taken now).
        inputs: clean inputs to calibrate the thresholds on; keep them apart from the inputs
            the protection is scored on (:func:`stalwart.protect.split_inputs`).
        modules: name glob(s); default every supported module.
        factor: threshold = factor x the largest clean relative residual.
    """

    def __init__(
        self,
        model: nn.Module,
        inputs: Sequence[Any],
        modules: Pattern | None = None,
        *,
        factor: float = 8.0,
    ) -> None:
        self.name, self.basis = "abft", "measured"
        mods = (
            select_modules(model, modules) if modules is not None else dict(model.named_modules())
        )
        self.modules = {
            n: m
            for n, m in mods.items()
            if isinstance(m, _TYPES) and (not isinstance(m, nn.Conv2d) or m.groups == 1)
        }
        self.refs: dict[str, dict[str, torch.Tensor]] = {}
        self.clean: dict[str, dict[str, torch.Tensor]] = {}
        for n, m_ in self.modules.items():
            m: Any = m_
            w = m.weight.detach().float()
            b = m.bias.detach().float() if getattr(m, "bias", None) is not None else None
            if isinstance(m, nn.EmbeddingBag):
                ref = {"rowsum": w.sum(1), "absrow": w.abs().sum(1)}
            elif isinstance(m, nn.Conv2d):
                ref = {
                    "colsum": w.sum(0, keepdim=True),
                    "abscol": w.abs().sum(0, keepdim=True),
                    "bsum": b.sum() if b is not None else torch.tensor(0.0, dtype=torch.float32),
                    "absb": b.abs().sum()
                    if b is not None
                    else torch.tensor(0.0, dtype=torch.float32),
                }
            else:
                ref = {
                    "colsum": w.sum(0),
                    "abscol": w.abs().sum(0),
                    "bsum": b.sum() if b is not None else torch.tensor(0.0, dtype=torch.float32),
                    "absb": b.abs().sum()
                    if b is not None
                    else torch.tensor(0.0, dtype=torch.float32),
                }
            self.refs[n] = ref
            self.clean[n] = {k: p.detach().clone() for k, p in m.named_parameters(recurse=False)}
        self.threshold: dict[str, float] = {}
        worst: dict[str, float] = {}

        def grab(n: str, rel: torch.Tensor) -> None:
            worst[n] = max(worst.get(n, 0.0), float(rel.max()))

        with self._hooks(model, observe=grab), torch.no_grad():
            model(*inputs)
        self.threshold = {n: max(factor * worst.get(n, 0.0), 1e-12) for n in self.modules}
        self.calibration_samples = batch_size(inputs)
        self.calibration_rows = row_fingerprints(inputs)
        self.method = f"measured; thresholds calibrated on {self.calibration_samples} inputs"
        self.alarms = 0
        self.repairs = 0

    @contextlib.contextmanager
    def _hooks(
        self, model: nn.Module, observe: Callable[[str, torch.Tensor], None] | None = None
    ) -> Iterator[None]:
        """Check every module's output; with ``observe``, hand it each module's relative
        residuals instead (calibration, false alarms) and never repair."""

        def make(n: str, m: nn.Module) -> Any:
            def hook(mod: nn.Module, args: Any, y: torch.Tensor) -> torch.Tensor | None:
                x = args[0]
                resid, scale = _check(mod, x, y, self.refs[n], args[1:])
                rel = torch.nan_to_num(resid / (scale + 1e-30), nan=torch.inf)
                if observe is not None:
                    observe(n, rel)
                    return None
                if bool((rel > self.threshold[n]).any()):
                    self.alarms += 1
                    return self._repair(n, mod, args)
                return None

            return hook

        handles = [m.register_forward_hook(make(n, m)) for n, m in self.modules.items()]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _repair(self, n: str, m: Any, args: Any) -> torch.Tensor:
        """Restore rows whose values differ from the clean copy, then recompute."""
        with torch.no_grad():
            for k, p in m.named_parameters(recurse=False):
                good = self.clean[n][k]
                bad = (p.view(p.shape[0], -1) != good.view(good.shape[0], -1)).any(1)
                if bool(bad.any()):
                    p[bad] = good[bad]
                    self.repairs += 1
            if isinstance(m, nn.Linear):
                return F.linear(args[0], m.weight, m.bias)
            if isinstance(m, nn.Conv2d):
                return m._conv_forward(args[0], m.weight, m.bias)
            offsets = args[1] if len(args) > 1 else None
            return F.embedding_bag(args[0], m.weight, offsets, mode=m.mode)

    def attach(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return self._hooks(model)

    def false_alarms(self, model: nn.Module, inputs: Sequence[Any]) -> float:
        """Share of the (clean) ``inputs`` whose residual crosses a threshold in any
        module: on inputs not used for calibration, the detector's false-alarm rate."""
        n = batch_size(inputs)
        flagged = torch.zeros(max(n, 1), dtype=torch.bool)

        def flag(name: str, rel: torch.Tensor) -> None:
            over = rel > self.threshold[name]
            rows = over.reshape(n, -1).any(1) if rel.dim() and rel.shape[0] == n else over.any()
            flagged.logical_or_(rows)

        with self._hooks(model, observe=flag), torch.no_grad():
            model(*inputs)
        return float(flagged.float().mean())

    def cost(self, model: nn.Module) -> dict[str, float]:
        clean = sum(t.numel() * t.element_size() for d in self.clean.values() for t in d.values())
        sums = sum(t.numel() * t.element_size() for d in self.refs.values() for t in d.values())
        return {
            "extra_bytes": float(sums),
            "clean_copy_bytes": float(clean),
            "modules": float(len(self.modules)),
        }
