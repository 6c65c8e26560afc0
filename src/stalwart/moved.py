"""Old import paths kept for one release: names a front door held that now live elsewhere.

A package lists what left its front door as ``{name: "new.module"}`` and serves the old paths
with :func:`moved_getattr` as its module ``__getattr__`` (PEP 562): the name is found where it
moved, with a DeprecationWarning that names the new path. This module depends on nothing in
stalwart, so every front door may use it.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable, Mapping

USE_FROM = "{package}.{name} moved to {where}; use `{hint}` (the old path goes in the next release)"
"""The warning for a moved name; ``hint`` is ``from {where} import {name}`` unless the package
gives one of its own."""


def find_moved(
    package: str,
    moved: Mapping[str, str],
    name: str,
    *,
    hints: Mapping[str, str] | None = None,
    message: str = USE_FROM,
    stacklevel: int = 2,
) -> object:
    """The moved name ``name`` of ``package``, imported from where it lives now, with a warning.

    Args:
        package: the front door's dotted name, e.g. ``"stalwart.checkpoint"``.
        moved: old name -> the dotted module it lives in now.
        name: the attribute asked for.
        hints: name -> what to write instead, where ``from <module> import <name>`` is not it.
        message: the warning, formatted with ``package``, ``name``, ``where`` and ``hint``.
        stacklevel: as for :func:`warnings.warn`, counted from this function (2: its caller).

    Raises:
        AttributeError: ``name`` is not a moved name of ``package``.
    """
    where = moved.get(name)
    if where is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    hint = (hints or {}).get(name, f"from {where} import {name}")
    warnings.warn(
        message.format(package=package, name=name, where=where, hint=hint),
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    return getattr(importlib.import_module(where), name)


def moved_getattr(
    package: str,
    moved: Mapping[str, str],
    *,
    hints: Mapping[str, str] | None = None,
    message: str = USE_FROM,
) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package`` that serves only its moved names.

    A :func:`functools.partial` adds no frame, so the warning points at the importing line.
    """
    return functools.partial(find_moved, package, moved, hints=hints, message=message)
