"""Plain-data objects in the state tree: the ``"as"`` tags and the classes a load may rebuild.

``argparse.Namespace`` and dataclasses travel as dicts, ``set``/``frozenset`` as lists,
``pathlib`` paths as str, ``Enum`` members by value (``tree.py`` encodes them). Rebuilding an
Enum or a dataclass needs its class, which is never imported by a name read from storage:
only classes passed to :func:`allow_types` in the loading process are rebuilt.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import pathlib
import sys
from typing import Any

from stalwart.errors import ConfigError, CorruptCheckpointError, UnsupportedValueError

__all__ = ["allow_types", "decimal_text", "plain_object", "plain_scalar", "rebuild", "type_name"]

# Classes that unflatten may rebuild, by "module:qualname"; filled only by allow_types().
_ALLOWED_TYPES: dict[str, type] = {}
_PATH_TYPES = {
    c.__name__: c
    for c in (pathlib.PurePath, pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.Path)
}


def type_name(cls: type) -> str:
    """How a checkpoint names a class: ``"module:qualname"``."""
    return f"{cls.__module__}:{cls.__qualname__}"


def allow_types(*types: type) -> None:
    """Let loads rebuild these Enum and dataclass types (saving never needs this).

    A checkpoint names the class of each Enum member and dataclass it holds, but loading
    never imports a module by a name read from storage (importing runs code). Pass the
    classes you trust, already imported, once per process before loading.

    Raises:
        ConfigError: an argument is not an Enum or dataclass class.
    """
    for cls in types:
        if not (isinstance(cls, type) and (issubclass(cls, enum.Enum) or _is_dataclass(cls))):
            raise ConfigError(
                f"allow_types takes Enum and dataclass classes; got {cls!r}. Give other "
                "objects state_dict()/load_state_dict() methods, or convert them to plain data"
            )
        _ALLOWED_TYPES[type_name(cls)] = cls


def _is_dataclass(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj)


def _allowed(name: Any, what: str) -> type:
    cls = _ALLOWED_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        module, _, qual = str(name).partition(":")
        raise UnsupportedValueError(
            f"the checkpoint holds {what} of type {name!r}, and stalwart rebuilds only classes "
            "allowed in this process, so that loading never imports or runs code named by a "
            f"file; if you trust it, call stalwart.tree.allow_types({qual}) (from {module}) "
            "before loading"
        )
    return cls


def plain_object(obj: Any) -> tuple[str, dict[str, Any], dict[str, Any]] | None:
    """``(tag, fields, extra node attributes)`` for a plain-data object, else None."""
    if isinstance(obj, argparse.Namespace):
        return "namespace", dict(vars(obj)), {}
    if _is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        return "dataclass", fields, {"type": type_name(type(obj))}
    return None


def plain_scalar(value: Any) -> tuple[Any, dict[str, str]] | None:
    """``(plain value, tag attributes)`` for an Enum member (by value) or a ``pathlib`` path (as
    str), else None; the node of the plain value plus the attributes is what a checkpoint holds."""
    if isinstance(value, enum.Enum):
        return value.value, {"as": "enum", "type": type_name(type(value))}
    if isinstance(value, pathlib.PurePath):
        kind = type(value).__name__ if type(value).__name__ in _PATH_TYPES else "Path"
        kind = "Path" if kind in ("PosixPath", "WindowsPath") else kind
        return str(value), {"as": "path", "type": kind}
    return None


def decimal_text(n: int, where: str) -> str:
    """``str(n)``; an int past Python's int/str conversion limit (4,300 digits by default) is
    refused with a way out. Readers keep that limit: it guards their parse of a manifest
    against a number that takes quadratic time to read, so the format keeps it too."""
    try:
        return str(n)
    except ValueError:
        raise UnsupportedValueError(
            f"the int at {where!r} has more than {sys.get_int_max_str_digits()} digits, "
            "Python's int/str conversion limit, which every reader of a checkpoint keeps; "
            "store it as bytes (n.to_bytes(...)) or as a str"
        ) from None


def rebuild(node: dict[str, Any], value: Any) -> Any:
    """Apply a node's ``"as"`` tag to the plain ``value`` built from it."""
    tag = node["as"]
    if tag == "namespace" and isinstance(value, dict):
        return argparse.Namespace(**{str(k): v for k, v in value.items()})
    if tag in ("set", "frozenset") and isinstance(value, list):
        return set(value) if tag == "set" else frozenset(value)
    if tag == "path" and isinstance(value, str) and node.get("type") in _PATH_TYPES:
        return _PATH_TYPES[node["type"]](value)
    if tag == "enum":
        return _allowed(node.get("type"), "an Enum member")(value)
    if tag == "dataclass" and isinstance(value, dict):
        cls = _allowed(node.get("type"), "a dataclass")
        fields = dataclasses.fields(cls)
        obj = cls(**{f.name: value[f.name] for f in fields if f.init and f.name in value})
        for f in fields:
            if not f.init and f.name in value:
                object.__setattr__(obj, f.name, value[f.name])  # frozen ones too
        return obj
    raise CorruptCheckpointError(f"malformed {tag!r} node {node!r} in manifest")
