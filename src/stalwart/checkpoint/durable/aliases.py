"""Tensors that share memory: the manifest's ``aliases``, checked on parse, shared on load.

A state may hold one tensor under several names (tied weights: ``{"a": w, "b": w}``) or a
view of another leaf (``w[1]``). Every leaf is stored whole, so a reader that ignores
aliasing still gets every value; the optional ``aliases`` member of the manifest records,
for each leaf that is a view of another leaf's memory, which leaf (the *base*, contiguous),
where in it (an element offset) and with which strides. Writers find them with
``plan.find_aliases``; :func:`share_aliases` rebuilds the views on a load that allocates
its tensors, once the bytes read for each view equal the base's bytes it points at, so a
damaged or hostile record can never put one tensor's values under another's name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from stalwart.checkpoint.durable.integrity import brief, uint
from stalwart.errors import CorruptCheckpointError

__all__ = ["TensorAlias", "parse_aliases", "share_aliases"]


@dataclass(frozen=True)
class TensorAlias:
    """A tensor that is a view of another tensor's memory.

    Attributes:
        of: the base tensor's name; its elements hold every element of this one.
        offset: elements from the base's first element to this tensor's first element.
        strides: this tensor's strides, in elements (0 for a broadcast dimension).
    """

    of: str
    offset: int
    strides: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"of": self.of, "offset": self.offset, "strides": list(self.strides)}


def parse_aliases(value: Any, entries: Mapping[str, Any]) -> dict[str, TensorAlias]:
    """The ``aliases`` member of a manifest, each view inside its base and of its dtype.

    Args:
        value: the parsed member (a JSON object; ``{}`` when absent).
        entries: the manifest's tensor entries by name (``dtype``, ``shape``).

    Raises:
        CorruptCheckpointError: a malformed record, an unknown name, a view reaching outside
            its base, or a base that is itself an alias.
    """
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"aliases must be a JSON object, not {brief(value)}")
    out: dict[str, TensorAlias] = {}
    for name, a in value.items():
        of = a.get("of") if isinstance(a, dict) else None
        e, base = entries.get(name), entries.get(of) if isinstance(of, str) else None
        if e is None or base is None or of == name or e.dtype != base.dtype:
            raise CorruptCheckpointError(
                f"alias {brief(name)} of {brief(of)}: both must be tensors of the manifest, "
                "distinct and of one dtype"
            )
        offset = uint(a.get("offset"), f"alias {name!r} offset")
        strides = a.get("strides")
        if not isinstance(strides, list) or len(strides) != len(e.shape):
            raise CorruptCheckpointError(f"alias {name!r}: strides must be one int per dimension")
        strides = tuple(uint(s, f"alias {name!r} strides") for s in strides)
        last = offset + sum((n - 1) * st for n, st in zip(e.shape, strides, strict=True))
        if math.prod(e.shape) == 0 or last >= math.prod(base.shape):
            raise CorruptCheckpointError(
                f"alias {name!r}: a view of shape {list(e.shape)} at offset {offset} with "
                f"strides {list(strides)} does not lie inside {of!r} of shape {list(base.shape)}"
            )
        out[name] = TensorAlias(str(of), offset, strides)  # a str: base was found by it
    if any(a.of in out for a in out.values()):
        raise CorruptCheckpointError("an alias names another alias as its base")
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, row-major (NaNs compare by their bits)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def share_aliases(
    aliases: Mapping[str, TensorAlias],
    tensors: MutableMapping[str, torch.Tensor],
    allocated: set[str],
    where: str,
) -> None:
    """Replace each allocated alias in ``tensors`` by a view of its (allocated) base.

    ``tensors`` holds every tensor as read, each in memory of its own; a tensor and its
    base must both have been allocated by the load (a caller's tensors keep their own
    memory). A view whose layout is exactly its base's becomes the base object itself.

    Raises:
        CorruptCheckpointError: a view's stored values differ from its base's at the place
            the record points to (the record or the bytes are damaged).
    """
    for name, a in aliases.items():
        if name not in allocated or a.of not in allocated:
            continue
        base, read = tensors[a.of], tensors[name]
        view = base.as_strided(read.shape, a.strides, base.storage_offset() + a.offset)
        if not torch.equal(_bits(view), _bits(read)):
            raise CorruptCheckpointError(
                f"{where}: tensor {name!r} is recorded as a view of {a.of!r}, but its stored "
                "values differ from the ones that view holds; the manifest is damaged — load "
                "an earlier step or use fallback=True",
                [name],
            )
        same = view.shape == base.shape and view.stride() == base.stride() and not a.offset
        tensors[name] = base if same else view
