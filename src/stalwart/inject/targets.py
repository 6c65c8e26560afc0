"""Which tensors a fault can hit: parameters and buffers by name glob or module type,
gradients, optimizer state, embedding rows, and module outputs (activations).

Names are the ones ``model.named_parameters()`` / ``named_buffers()`` / ``named_modules()``
give. Every lookup that finds nothing raises a :class:`ConfigError` naming what exists.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from stalwart.errors import ConfigError
from stalwart.inject.quantized import find_slot, quantized_slots, quantized_targets

__all__ = [
    "forward_with_hooks",
    "matches",
    "module_of",
    "resolve",
    "rows_read",
    "select_modules",
    "select_tensors",
]

Pattern = str | Sequence[str]


def _patterns(pattern: Pattern) -> list[str]:
    return [pattern] if isinstance(pattern, str) else list(pattern)


def matches(name: str, pattern: Pattern) -> bool:
    """``name`` matches the glob ``pattern`` (or one of several), case-sensitively."""
    return any(fnmatch.fnmatchcase(name, p) for p in _patterns(pattern))


def _hint(name: str, names: Iterable[str]) -> str:
    names = list(names)
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.4)
    shown = close or names[:8]
    more = "" if close or len(names) <= 8 else f" (and {len(names) - 8} more)"
    return f"{'did you mean' if close else 'available'}: {', '.join(shown)}{more}"


def select_tensors(
    model: nn.Module,
    pattern: Pattern = "*",
    *,
    module_types: Sequence[type[nn.Module]] | None = None,
    buffers: bool = False,
    exclude: Pattern = (),
    quantized: bool = False,
) -> dict[str, torch.Tensor]:
    """Parameters (and buffers with ``buffers=True``) whose names match a glob.

    Args:
        model: the model.
        pattern: one glob or several (``"fc*.weight"``, ``["conv1.*", "*.bias"]``).
        module_types: keep only tensors owned directly by modules of these types.
        buffers: include floating or integer buffers (running stats, quantization scales).
        exclude: globs to drop.
        quantized: list each torch quantized tensor (also packed module weights) as its
            targets ``NAME``, ``NAME:scale`` and ``NAME:zero_point``
            (:mod:`stalwart.inject.quantized`). Their tensors are copies of the stored words,
            for dtype and shape only: edit them through :func:`stalwart.inject.apply_faults`.

    Raises:
        ConfigError: nothing matches; the message lists the names that exist.
    """
    pats, skip = _patterns(pattern), _patterns(exclude)
    found: dict[str, torch.Tensor] = {}
    every: list[str] = []
    slots = quantized_slots(model) if quantized else {}
    for mod_name, module in model.named_modules():
        if module_types is not None and not isinstance(module, tuple(module_types)):
            continue
        items: list[tuple[str, Any]] = list(module.named_parameters(recurse=False))
        if buffers:
            items += list(module.named_buffers(recurse=False))
        prefix = f"{mod_name}." if mod_name else ""
        listed = {prefix + k for k, _ in items}
        owned = {k: s for k, s in slots.items() if s.module is module and (s.packed or k in listed)}
        items = [(k, t) for k, t in items if prefix + k not in slots]
        items += [(k[len(prefix) :], t) for k, t in quantized_targets(model, owned).items()]
        for leaf, tensor in items:
            if tensor is None:
                continue
            name = prefix + leaf
            every.append(name)
            if matches(name, pats) and not matches(name, skip):
                found[name] = tensor
    if not found:
        kind = " of types " + ", ".join(t.__name__ for t in module_types) if module_types else ""
        raise ConfigError(
            f"pattern {pats if len(pats) > 1 else pats[0]!r} matches no parameter{kind} of "
            f"{type(model).__name__}; {_hint(pats[0], every) if every else 'it has none'}"
        )
    return found


def select_modules(model: nn.Module, pattern: Pattern) -> dict[str, nn.Module]:
    """Modules whose names match a glob (for activation faults and protections)."""
    pats = _patterns(pattern)
    names = [n for n, _ in model.named_modules() if n]
    found = {n: m for n, m in model.named_modules() if n and matches(n, pats)}
    if not found:
        raise ConfigError(
            f"pattern {pats[0]!r} matches no module of {type(model).__name__}; "
            + _hint(pats[0], names)
        )
    return found


def module_of(model: nn.Module, tensor_name: str) -> tuple[str, nn.Module, str]:
    """The owning module's name, the module and the leaf attribute of a tensor name."""
    mod_name, _, leaf = tensor_name.rpartition(".")
    try:
        return mod_name, model.get_submodule(mod_name), leaf
    except AttributeError:
        raise ConfigError(
            f"{tensor_name!r} is not a tensor of {type(model).__name__}; "
            + _hint(tensor_name, [n for n, _ in model.named_parameters()])
        ) from None


def resolve(
    model: nn.Module,
    name: str,
    kind: str = "param",
    *,
    optimizer: torch.optim.Optimizer | None = None,
    state: str = "",
) -> torch.Tensor:
    """The tensor a fault on ``name`` edits.

    ``kind`` is ``param`` (a parameter or buffer; for a quantized target, a copy of its
    stored words, which :func:`~stalwart.inject.apply_faults` edits through), ``grad``
    (its ``.grad``, after backward) or ``optim`` (``optimizer.state[param][state]``,
    e.g. ``exp_avg``).

    Raises:
        ConfigError: no such tensor, no gradient yet, no optimizer or no such state.
    """
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    if kind == "param" and (name not in tensors or tensors[name].is_quantized):
        found = find_slot(model, name)
        if found is not None:  # a copy of the words: see stalwart.inject.quantized
            return found[0].component(found[1])
    if name not in tensors:
        raise ConfigError(
            f"{type(model).__name__} has no parameter or buffer {name!r}; " + _hint(name, tensors)
        )
    tensor = tensors[name]
    if kind == "param":
        return tensor
    if kind == "grad":
        if tensor.grad is None:
            raise ConfigError(f"{name} has no .grad yet; inject gradient faults after backward()")
        return tensor.grad
    if kind == "optim":
        if optimizer is None:
            raise ConfigError("optimizer-state faults need optimizer=...")
        slots = optimizer.state.get(tensor, {})
        value = slots.get(state)
        if not isinstance(value, torch.Tensor):
            have = [k for k, v in slots.items() if isinstance(v, torch.Tensor)]
            raise ConfigError(
                f"optimizer holds no tensor state {state!r} for {name}; it has "
                f"{have or 'none (take one optimizer step first)'}"
            )
        return value
    raise ConfigError(f"cannot resolve a tensor for fault kind {kind!r}")


def rows_read(indices: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Sorted distinct embedding rows an input batch reads (ids outside the table dropped)."""
    ids = torch.unique(indices.reshape(-1).long())
    return ids[(ids >= 0) & (ids < num_rows)]


def forward_with_hooks(
    model: nn.Module,
    inputs: Sequence[Any],
    modules: Mapping[str, nn.Module],
    make_hook: Callable[[str], Callable[[nn.Module, Any, Any], None]],
) -> None:
    """Run one no-grad forward with ``make_hook(name)`` on each module; remove them after.

    The hooks observe (profiling shapes, activation ranges); they are removed even when the
    forward raises.
    """
    handles = [m.register_forward_hook(make_hook(name)) for name, m in modules.items()]
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
