"""Faults in module outputs (activations), applied by forward hooks during a forward pass.

A batch of B inputs can carry B independent faults (one per sample: ``Fault.sample``), so
one forward pass runs B trials. The hook edits a copy of the module's output, so nothing
the module keeps (and no other consumer of its input) is touched; removing the hooks on
exit is the undo.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any

import torch
from torch import nn

from stalwart.errors import ConfigError, UnsupportedValueError
from stalwart.inject.bits import layout_of, signed_mask
from stalwart.inject.error_models import Fault
from stalwart.inject.injector import edit_raw

__all__ = ["ActivationInjector", "activation_faults"]


class ActivationInjector(AbstractContextManager["ActivationInjector"]):
    """Forward hooks that corrupt module outputs; a context manager that removes them."""

    def __init__(self, model: nn.Module, faults: Iterable[Fault]) -> None:
        self.faults: dict[str, list[Fault]] = {}
        for f in faults:
            if f.kind != "activation":
                raise ConfigError(f"{f} is not an activation fault; use apply_faults()")
            self.faults.setdefault(f.target, []).append(f)
        modules = dict(model.named_modules())
        self._handles = []
        self.calls = 0
        for name in self.faults:  # every target checked before any hook goes on: a refusal
            if name not in modules:  # must not leave a fault-injecting hook on the model
                raise ConfigError(
                    f"{type(model).__name__} has no module {name!r}; modules: "
                    + ", ".join(n for n in list(modules)[1:9] if n)
                )
        for name in self.faults:
            self._handles.append(modules[name].register_forward_hook(self._hook(name)))

    def _hook(self, name: str) -> Any:
        faults = self.faults[name]

        def hook(module: nn.Module, args: Any, output: Any) -> torch.Tensor:
            if not isinstance(output, torch.Tensor):
                raise UnsupportedValueError(
                    f"module {name} returns {type(output).__name__}, not a tensor; target a "
                    "submodule that returns one"
                )
            self.calls += 1
            layout = layout_of(output.dtype, f"output of {name}")
            out = output.detach().clone().contiguous()
            raw = out.view(layout.storage).view(out.shape[0] if out.dim() else 1, -1)
            per = raw.shape[1]
            for f in faults:
                rows = range(raw.shape[0]) if f.sample < 0 else [f.sample]
                if f.index >= per or (f.sample >= raw.shape[0]):
                    raise ConfigError(
                        f"activation fault at sample {f.sample}, index {f.index} is outside "
                        f"the output of {name} (batch {raw.shape[0]}, {per} values per sample)"
                    )
                mask = torch.tensor([signed_mask(f.mask, layout)], dtype=layout.storage)
                for r in rows:
                    raw[r, f.index] = edit_raw(raw[r], torch.tensor([f.index]), f.op, mask)[0]
            if output.requires_grad:  # keep the graph: gradient flows as if unfaulted
                return _StraightThrough.apply(output, out)
            return out

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()


def activation_faults(model: nn.Module, faults: Iterable[Fault]) -> ActivationInjector:
    """Corrupt module outputs during the forward passes inside the ``with`` block.

    Example:
        >>> faults = [Fault("fc1", index=i, mask=1 << 30, kind="activation", sample=s)
        ...           for s, i in enumerate(sites)]
        >>> with inject.activation_faults(model, faults):
        ...     out = model(batch)       # sample s carries its own fault
    """
    return ActivationInjector(model, faults)


class _StraightThrough(torch.autograd.Function):
    """Forward: the faulted values exactly (``output + (out - output)`` rounds, and an
    exponent flip loses the value); backward: the gradient passes as if unfaulted."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, faulted: torch.Tensor) -> torch.Tensor:
        return faulted.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None
