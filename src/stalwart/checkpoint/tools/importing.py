"""Import a safetensors file, a torch.save file or a DCP checkpoint as a step of a root.

Import recognises, by content rather than by name:

* a **safetensors** file (``safetensors.safe_open``; no code can run);
* a **DCP checkpoint** folder (it has a ``.metadata`` file), read without a process group;
* a **torch.save** file, loaded with ``torch.load(weights_only=True)``.

Trust: no pickle from the source runs by default. DCP's ``.metadata`` is read with an
unpickler that resolves only DCP's metadata classes, and its non-tensor entries and torch.save
files with ``torch.load(weights_only=True)`` (see :mod:`stalwart.checkpoint.tools.dcp_import`);
a DCP folder that needs more is refused unless ``trust_pickle=True`` (``--trust-pickle``), and a
torch.save file that needs more is rejected with a hint to re-save it as plain tensors.

A safetensors file written by :func:`~stalwart.checkpoint.tools.export.export_step` keeps the
whole tree in its header metadata under :data:`SKELETON_KEY`; importing it rebuilds that tree.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stalwart.checkpoint.durable.checkpointer import Checkpointer
from stalwart.checkpoint.durable.results import SaveResult
from stalwart.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError
from stalwart.tree import flatten, unflatten

__all__ = ["SKELETON_KEY", "ImportResult", "detect_kind", "import_file", "numpy_to_tensors"]

SKELETON_KEY = "stalwart.skeleton"
_ACCEPTED = "a safetensors file, a torch.save file, or a DCP checkpoint folder (with .metadata)"


@dataclass(frozen=True)
class ImportResult:
    """What :func:`import_file` read and saved.

    Attributes:
        kind: ``safetensors``, ``dcp`` or ``torch``.
        tensors: number of tensors saved.
        save: the checkpointer's result for the new step.
    """

    kind: str
    tensors: int
    save: SaveResult


# A legacy (pre-zip) torch.save file opens with its magic number pickled at protocol 2; a
# bare b"\x80" matched 1 in 256 random files and sent them to the pickle refusal instead.
_LEGACY_TORCH_HEAD = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)[:-1]


def detect_kind(src: Path) -> str:
    """``safetensors``, ``dcp`` or ``torch`` for ``src``, judged by its content.

    Raises:
        CheckpointNotFoundError: ``src`` does not exist.
        ConfigError: it is none of the accepted kinds.
    """
    if not src.exists():
        raise CheckpointNotFoundError(f"{src} does not exist; check the path to import")
    if src.is_dir():
        if (src / ".metadata").is_file():
            return "dcp"
        raise ConfigError(
            f"{src} is a folder without a .metadata file, so not a DCP checkpoint; "
            f"import accepts {_ACCEPTED}"
        )
    with open(src, "rb") as f:
        head = f.read(len(_LEGACY_TORCH_HEAD))
    size = src.stat().st_size
    if len(head) >= 9 and head[8:9] == b"{":
        (n,) = struct.unpack("<Q", head[:8])
        if n > size - 8:
            raise CorruptCheckpointError(
                f"{src} looks like a safetensors file whose header ({n} bytes) is longer than "
                f"the file ({size} bytes): it is truncated; copy or export it again"
            )
        return "safetensors"
    if head[:4] == b"PK\x03\x04" or head == _LEGACY_TORCH_HEAD:  # zip (torch>=1.6) or legacy
        return "torch"
    raise ConfigError(f"{src} is not a format stalwart can import; import accepts {_ACCEPTED}")


def import_file(
    src: str | os.PathLike[str],
    ckpt: Checkpointer,
    *,
    step: int,
    overwrite: bool = False,
    metadata: dict[str, str] | None = None,
    trust_pickle: bool = False,
) -> ImportResult:
    """Read a safetensors file, a torch.save file or a DCP checkpoint and save it as ``step``.

    No pickle from ``src`` runs unless ``trust_pickle`` (see the module docstring).

    Args:
        src: the file or DCP folder to import.
        ckpt: the checkpointer of the root to save into.
        step: the step to save as.
        overwrite: replace ``step`` when it is already committed.
        metadata: string metadata for the new manifest (``stalwart.source`` is added).
        trust_pickle: let a DCP folder's pickles (``.metadata``, non-tensor values) run
            unrestricted; only for folders from a source you trust.

    Raises:
        CheckpointNotFoundError: ``src`` does not exist.
        ConfigError: unknown format, no tensors in ``src``, the step exists, or the source
            needs unsafe pickle (a DCP folder: unless ``trust_pickle``).
        CorruptCheckpointError: ``src`` is truncated or damaged.
    """
    path = Path(src)
    kind = detect_kind(path)
    if not overwrite and step in ckpt.steps():
        raise ConfigError(
            f"step {step} already exists in {ckpt.url}; pick another --step or pass "
            "overwrite=True (--overwrite) to replace it"
        )
    if kind == "dcp":
        from stalwart.checkpoint.tools.dcp_import import read_dcp  # loads torch's DCP

        tree = read_dcp(path, trust_pickle=trust_pickle)
    else:
        tree = {"safetensors": _read_safetensors, "torch": _read_torch}[kind](path)
    meta = {**(metadata or {}), "stalwart.source": f"{kind}:{path.name}"}
    n = len(flatten(tree).leaves)
    if n == 0:
        raise ConfigError(
            f"{path} holds no tensors, so there is nothing to import; check that it is the "
            "file you meant (a model's state_dict saved with torch.save or safetensors)"
        )
    return ImportResult(kind, n, ckpt.save(step, tree, metadata=meta, overwrite=overwrite))


def _read_safetensors(path: Path) -> Any:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError, ValueError) as e:
        raise CorruptCheckpointError(
            f"{path} is not a readable safetensors file ({e}); it may be truncated — copy or "
            "export it again"
        ) from e
    skeleton = meta.get(SKELETON_KEY)
    if skeleton is None:
        return tensors
    try:
        return unflatten(json.loads(skeleton), tensors.__getitem__)
    except (ValueError, KeyError) as e:
        raise CorruptCheckpointError(
            f"{path}: its {SKELETON_KEY} metadata does not match its tensors ({e!r}); "
            "remove that metadata entry to import the tensors as a flat dict"
        ) from e


def _read_torch(path: Path) -> Any:
    try:
        tree = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights_only" in str(e) or "Weights only" in str(e):
            raise ConfigError(
                f"{path} holds objects that torch.load(weights_only=True) refuses, and stalwart "
                "does not run untrusted pickle. Re-save it with plain tensors, e.g. "
                "torch.save(model.state_dict(), path), and import that"
            ) from e
        raise CorruptCheckpointError(f"{path} is damaged or truncated ({e})") from e
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as e:
        raise CorruptCheckpointError(
            f"{path} is not a readable torch.save file ({e}); it may be truncated — save or "
            "copy it again"
        ) from e
    return numpy_to_tensors(tree)


def numpy_to_tensors(tree: Any) -> Any:
    if isinstance(tree, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(tree))
    if isinstance(tree, dict):
        return {k: numpy_to_tensors(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(numpy_to_tensors(v) for v in tree)
    return tree
