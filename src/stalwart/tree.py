"""The state tree: flatten to named tensor leaves plus a JSON skeleton, and back.

A state tree is a nested structure of dicts, lists and tuples whose leaves are tensors
(plain, DTensor, any dtype), numpy arrays, and small Python values (None, bool, int, float,
str, bytes, torch.dtype). Objects with ``state_dict()`` / ``load_state_dict()`` (modules,
optimizers, LR schedulers, :class:`stalwart.TrainingState`) are *stateful*: they are replaced
by their ``state_dict()`` on save and handed the loaded sub-tree on load.

Tensor leaves are named by their fully qualified name (FQN): the path's keys joined with
``.`` (``model.layers.0.weight``, ``optim.state.0.exp_avg``). The skeleton records the exact
path structure (key types, list vs tuple) so that ``unflatten(flatten(x)) == x`` even when
keys contain dots; two paths that would produce the same FQN are rejected.

The skeleton is plain JSON: loading it can never run code (no pickle anywhere). Plain-data
objects travel as the node of their data plus an ``"as"`` tag, so a reader that does not know
the tag still gets the data: ``argparse.Namespace`` and dataclasses as dicts, ``set`` and
``frozenset`` as lists, ``pathlib`` paths as str, ``Enum`` members by value. Rebuilding an
Enum or a dataclass needs its class, which is never imported by name from a checkpoint: only
classes passed to :func:`allow_types` in the loading process are rebuilt; any other raises
an error that says so.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from stalwart.errors import CorruptCheckpointError, UnsupportedValueError
from stalwart.values import allow_types, decimal_text, plain_object, plain_scalar, rebuild

__all__ = [
    "FlatTree",
    "Leaf",
    "allow_types",
    "flatten",
    "is_stateful",
    "iter_skeleton_tensors",
    "unflatten",
]

Path = tuple[Any, ...]

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}


# A specific way out for dtypes people meet; others get the generic advice.
_DTYPE_HINTS = {
    torch.complex32: "convert it with .to(torch.complex64)",
    torch.uint16: "convert it with .to(torch.int32), or .view(torch.int16) to keep the bits",
    torch.uint32: "convert it with .to(torch.int64), or .view(torch.int32) to keep the bits",
    torch.uint64: "view it as .view(torch.int64) to keep the bits",
}

# numpy dtypes stored as tensors, by name (the name ignores byte order).
_NUMPY_DTYPES = frozenset(
    {"float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool"}
    | {"complex64", "complex128"}
)
_NUMPY_HINTS = {
    "O": "convert it to a numeric array (np.asarray(x, dtype=np.float64)) or a list of values",
    "U": "store it as a list of str",
    "S": "store it as a list of bytes",
    "M": "store x.astype(np.int64) and its unit",
    "m": "store x.astype(np.int64) and its unit",
    "V": "store each field as an array of its own",
    "f": "convert it with x.astype(np.float64) (long double is not portable)",
    "c": "convert it with x.astype(np.complex128) (long double is not portable)",
    "u": "view it as the signed type of the same width (x.view(np.int32)), view back after load",
}


def dtype_name(dtype: torch.dtype) -> str:
    """Return the format's name for ``dtype`` (``float32``, ``bfloat16``, ...)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise UnsupportedValueError(
            f"tensors of dtype {dtype} cannot be stored; supported dtypes: {sorted(_DTYPES)}"
        )
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; raises CorruptCheckpointError for unknown names."""
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise CorruptCheckpointError(f"unknown dtype {name!r} in manifest") from None


def is_stateful(obj: Any) -> bool:
    """True for objects that save and restore themselves through state_dict methods."""
    return (
        not isinstance(obj, (torch.Tensor, Mapping))
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


@dataclass
class Leaf:
    """A tensor leaf of a flattened tree.

    Attributes:
        fqn: fully qualified name.
        tensor: the tensor (a DTensor stays a DTensor; numpy arrays become tensors).
        path: the exact key path from the root.
    """

    fqn: str
    tensor: torch.Tensor
    path: Path
    source: np.ndarray | None = None
    """The caller's numpy array when ``tensor`` is a copy of it (negative or uneven strides,
    non-native byte order, read-only): an in-place load writes back into it."""

    def check_writable(self) -> None:
        """Raise UnsupportedValueError when an in-place load cannot write this leaf."""
        if self.source is not None and not self.source.flags.writeable:
            raise UnsupportedValueError(
                f"numpy array {self.fqn!r} is read-only (flags.writeable is False), so load "
                "cannot write into it; put a writable copy (arr.copy()) in the state, or load "
                "without a target and take the array from the returned tree"
            )

    def write_back(self) -> None:
        """After an in-place load: copy the tensor into :attr:`source`, if there is one."""
        if self.source is not None:
            np.copyto(self.source, self.tensor.numpy())


@dataclass
class FlatTree:
    """The result of :func:`flatten`.

    Attributes:
        skeleton: JSON-serialisable structure with tensor leaves replaced by references.
        leaves: tensor leaves by FQN, in tree order.
        statefuls: ``(path, object)`` for every stateful object met, outermost first.
    """

    skeleton: dict[str, Any]
    leaves: dict[str, Leaf] = field(default_factory=dict)
    statefuls: list[tuple[Path, Any]] = field(default_factory=list)


def _fqn(path: Path) -> str:
    return ".".join(str(k) for k in path)


def _encode_key(key: Any) -> list[Any]:
    if isinstance(key, bool):
        return ["b", key]
    if isinstance(key, int):
        return ["i", key]
    if isinstance(key, str):
        return ["s", key]
    if key is None:
        return ["n", None]
    raise UnsupportedValueError(
        f"dict key {key!r} of type {type(key).__name__} cannot be stored; "
        "use str, int, bool or None keys"
    )


def _decode_key(enc: Any) -> Any:
    if not (isinstance(enc, list) and len(enc) == 2 and enc[0] in ("b", "i", "s", "n")):
        raise CorruptCheckpointError(f"malformed dict key {enc!r} in manifest skeleton")
    return enc[1]


def _encode_value(value: Any, path: Path) -> dict[str, Any]:
    tagged = plain_scalar(value)  # an Enum member or a path: its value plus an "as" tag
    if tagged is not None:
        node = _encode_value(tagged[0], path)
        if node["k"] in ("tensor", "dict", "list", "tuple"):  # pragma: no cover (scalar only)
            raise UnsupportedValueError(f"enum member at {_fqn(path)!r} has a non-scalar value")
        return {**node, **tagged[1]}
    if value is None:
        return {"k": "none"}
    if isinstance(value, bool):
        return {"k": "bool", "v": value}
    if isinstance(value, int):
        return {"k": "int", "v": decimal_text(value, _fqn(path))}
    if isinstance(value, float):
        return {"k": "float", "v": repr(value) if not math.isfinite(value) else value}
    if isinstance(value, str):
        return {"k": "str", "v": value}
    if isinstance(value, (bytes, bytearray)):
        return {"k": "bytes", "v": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, torch.dtype):
        return {"k": "dtype", "v": dtype_name(value)}
    if isinstance(value, np.generic) and not isinstance(value.item(), np.generic):
        return _encode_value(value.item(), path)  # np.longdouble.item() stays numpy
    raise UnsupportedValueError(
        f"value at {_fqn(path) or '<root>'!r} has type {type(value).__name__}, which stalwart "
        "cannot store without pickle; convert it to a tensor, a dict/list of tensors and "
        "numbers/strings, a dataclass, an Enum, a set or an argparse.Namespace, or give it "
        "state_dict()/load_state_dict() methods"
    )


def _tensor_problem(t: torch.Tensor) -> str | None:
    """Why the format cannot hold ``t`` and what to do instead; None when it can."""
    if t.is_nested:
        return "is a nested tensor; store t.unbind() (a list of tensors) or t.to_padded_tensor(0)"
    if t.layout != torch.strided:
        return (
            f"is sparse ({t.layout}); stalwart stores dense tensors: use t.to_dense(), or "
            "store its indices and values as tensors of their own"
        )
    if t.is_quantized:
        return (
            f"is quantized ({t.dtype}); store t.dequantize(), or t.int_repr() with "
            "t.q_scale() and t.q_zero_point()"
        )
    if t.device.type == "meta":
        return (
            "is on the meta device and holds no data; materialize it first (e.g. "
            "module.to_empty(device='cpu'), then initialize or load weights)"
        )
    if str(t.dtype).removeprefix("torch.") not in _DTYPES:
        hint = _DTYPE_HINTS.get(
            t.dtype,
            "convert it with .to(), or .view() it as an integer dtype of the same width",
        )
        return f"has dtype {t.dtype}, which the format cannot store ({sorted(_DTYPES)}); {hint}"
    return None


def _numpy_tensor(arr: np.ndarray, fqn: str) -> tuple[torch.Tensor, np.ndarray | None]:
    """``arr`` as a tensor sharing its memory, or as a copy plus ``arr`` to write back into."""
    if arr.dtype.name not in _NUMPY_DTYPES:
        hint = _NUMPY_HINTS.get(arr.dtype.kind, f"convert it to one of {sorted(_NUMPY_DTYPES)}")
        raise UnsupportedValueError(
            f"numpy array {fqn!r} has dtype {arr.dtype}, which stalwart cannot store; {hint}"
        )
    if arr.flags.writeable and arr.dtype.isnative:
        try:
            return torch.from_numpy(arr), None  # shares memory: a load writes into arr
        except ValueError:  # negative strides, or strides not a multiple of the item size
            pass
    copy = np.array(arr, dtype=arr.dtype.newbyteorder("="), order="C")
    return torch.from_numpy(copy), arr


def flatten(state: Any) -> FlatTree:
    """Flatten ``state`` into a JSON skeleton plus named tensor leaves.

    Raises:
        UnsupportedValueError: an object that cannot be stored without pickle (also meta,
            sparse, nested or quantized tensors, and numpy arrays of object or long double
            dtype), a cycle, or two paths with the same FQN.
    """
    flat = FlatTree(skeleton={})
    seen: set[int] = set()

    def visit(obj: Any, path: Path) -> dict[str, Any]:
        if isinstance(obj, torch.Tensor):
            return add_leaf(obj, path, numpy=False)
        if isinstance(obj, np.ndarray):
            tensor, source = _numpy_tensor(obj, _fqn(path))
            return add_leaf(tensor, path, numpy=True, source=source)
        plain = plain_object(obj)
        if plain is not None:
            tag, fields, extra = plain
            return {**visit(fields, path), "as": tag, **extra}
        if isinstance(obj, (set, frozenset)):
            nodes = [visit(v, (*path, i)) for i, v in enumerate(obj)]
            _no_tensors_in_set(nodes, path)
            nodes.sort(key=lambda n: json.dumps(n, sort_keys=True))  # same set, same bytes
            tag = "set" if isinstance(obj, set) else "frozenset"
            return {"k": "list", "v": nodes, "as": tag}
        if isinstance(obj, (Mapping, list, tuple)) or is_stateful(obj):
            if id(obj) in seen:
                raise UnsupportedValueError(f"state tree has a cycle at {_fqn(path)!r}")
            seen.add(id(obj))
            try:
                if is_stateful(obj):
                    flat.statefuls.append((path, obj))
                    return {"k": "stateful", "v": visit(obj.state_dict(), path)}
                if isinstance(obj, Mapping):
                    items = [[_encode_key(k), visit(v, (*path, k))] for k, v in obj.items()]
                    return {"k": "dict", "v": items}
                kind = "list" if isinstance(obj, list) else "tuple"
                return {"k": kind, "v": [visit(v, (*path, i)) for i, v in enumerate(obj)]}
            finally:
                seen.discard(id(obj))
        return _encode_value(obj, path)

    def add_leaf(
        tensor: torch.Tensor, path: Path, numpy: bool, source: np.ndarray | None = None
    ) -> dict[str, Any]:
        fqn = _fqn(path)
        if fqn in flat.leaves:
            raise UnsupportedValueError(
                f"two tensors map to the same name {fqn!r} (paths {flat.leaves[fqn].path!r} "
                f"and {path!r}); rename one of the keys"
            )
        problem = _tensor_problem(tensor)
        if problem:
            raise UnsupportedValueError(f"tensor {fqn!r} {problem}")
        flat.leaves[fqn] = Leaf(fqn=fqn, tensor=tensor, path=path, source=source)
        node: dict[str, Any] = {"k": "tensor", "v": fqn}
        if numpy:
            node["numpy"] = True
        return node

    flat.skeleton = visit(state, ())
    return flat


def _no_tensors_in_set(nodes: list[dict[str, Any]], path: Path) -> None:
    if any(fqn for n in nodes for fqn in iter_skeleton_tensors(n)):
        raise UnsupportedValueError(
            f"the set at {_fqn(path) or '<root>'!r} holds tensors; a set has no stable order "
            "to name them by, so store them in a list or a dict"
        )


def iter_skeleton_tensors(skeleton: dict[str, Any]) -> Iterator[str]:
    """Yield the FQN of every tensor referenced by ``skeleton``."""
    stack = [skeleton]
    while stack:
        node = stack.pop()
        kind = node.get("k") if isinstance(node, dict) else None
        if kind == "tensor":
            yield node["v"]
        elif kind == "dict":
            stack.extend(item[1] for item in node["v"])
        elif kind in ("list", "tuple"):
            stack.extend(node["v"])
        elif kind == "stateful":
            stack.append(node["v"])


def unflatten(skeleton: dict[str, Any], tensor_for: Callable[[str], torch.Tensor]) -> Any:
    """Rebuild a tree from ``skeleton``, asking ``tensor_for(fqn)`` for each tensor leaf.

    Stateful markers are dropped: the returned tree holds plain dicts where the saved tree
    held stateful objects (the caller hands those sub-trees to ``load_state_dict``).

    Raises:
        CorruptCheckpointError: the skeleton is malformed.
    """

    def build(node: Any) -> Any:
        value = build_plain(node)
        if "as" not in node:
            return value
        try:
            return rebuild(node, value)
        except (TypeError, ValueError) as e:
            if isinstance(e, (CorruptCheckpointError, UnsupportedValueError)):
                raise
            raise CorruptCheckpointError(f"cannot rebuild node {node!r} in manifest ({e})") from e

    def build_plain(node: Any) -> Any:
        if not isinstance(node, dict) or "k" not in node:
            raise CorruptCheckpointError(f"malformed skeleton node {node!r} in manifest")
        kind = node["k"]
        v: Any = node.get("v")
        try:
            if kind == "tensor":
                t = tensor_for(v)
                return t.numpy() if node.get("numpy") else t
            if kind == "dict":
                return {_decode_key(k): build(child) for k, child in v}
            if kind == "list":
                return [build(child) for child in v]
            if kind == "tuple":
                return tuple(build(child) for child in v)
            if kind == "stateful":
                return build(v)
            if kind == "none":
                return None
            if kind == "bool":
                return bool(v)
            if kind == "int":
                return int(v)
            if kind == "float":
                return float(v)
            if kind == "str":
                return str(v)
            if kind == "bytes":
                return base64.b64decode(v, validate=True)
            if kind == "dtype":
                return dtype_from_name(v)
        except (TypeError, ValueError) as e:
            if isinstance(e, (CorruptCheckpointError, UnsupportedValueError)):
                raise
            raise CorruptCheckpointError(f"malformed {kind} node {node!r} in manifest") from e
        raise CorruptCheckpointError(f"unknown skeleton node kind {kind!r} in manifest")

    try:
        return build(skeleton)
    except RecursionError:  # a skeleton from an untrusted file, nested past the stack
        raise CorruptCheckpointError(
            "skeleton nested too deeply to rebuild; the file is damaged or hostile"
        ) from None


def get_path(tree: Any, path: Path) -> Any:
    """Return the sub-tree at ``path`` (a tuple of keys and list indices)."""
    for key in path:
        tree = tree[key]
    return tree
