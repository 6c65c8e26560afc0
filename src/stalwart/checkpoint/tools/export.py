"""Export a step to one safetensors or torch file, and import such files or a DCP checkpoint.

Export writes the consolidated view (every tensor whole, as one process would load it with
``Checkpointer.load(None, step)``) to a temporary file next to ``out``, fsyncs it and renames it
into place, so ``out`` is either absent or complete, and an existing ``out`` is never replaced
unless asked. A safetensors export keys tensors by FQN and keeps the whole tree structure (the
skeleton, with every non-tensor value) in the header metadata under ``stalwart.skeleton``, so
importing it back rebuilds the same tree.

Import recognises, by content rather than by name:

* a **safetensors** file (``safetensors.safe_open``; no code can run);
* a **DCP checkpoint** folder (it has a ``.metadata`` file), read without a process group;
* a **torch.save** file, loaded with ``torch.load(weights_only=True)``.

Trust: no pickle from the source runs by default. DCP's ``.metadata`` is read with an
unpickler that resolves only DCP's metadata classes, and its non-tensor entries and torch.save
files with ``torch.load(weights_only=True)`` (see :mod:`stalwart.checkpoint.tools.dcp_import`);
a DCP folder that needs more is refused unless ``trust_pickle=True`` (``--trust-pickle``), and a
torch.save file that needs more is rejected with a hint to re-save it as plain tensors.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import struct
import uuid
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stalwart.checkpoint.durable.checkpointer import Checkpointer
from stalwart.checkpoint.durable.results import SaveResult
from stalwart.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError
from stalwart.storage.local import fsync_dir
from stalwart.tree import flatten, unflatten

__all__ = [
    "FORMATS",
    "ExportResult",
    "ImportResult",
    "export_step",
    "import_file",
    "load_subtree",
    "model_subtree",
    "unshared",
]

log = logging.getLogger(__name__)

FORMATS = ("safetensors", "torch")


def unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` contiguous, each with memory of its own, for ``safetensors.save_file``.

    A load with no target gives tensors that were views of one another at save time (tied
    embeddings, ``w`` and ``w[1]``) their shared memory back; safetensors refuses shared
    memory, so every tensor after the first on a storage is copied.
    """
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for fqn, t in tensors.items():
        ptr = t.untyped_storage().data_ptr()
        out[fqn] = t.clone() if ptr in seen and t.numel() else t.contiguous()
        seen.add(ptr)
    return out


SKELETON_KEY = "stalwart.skeleton"
_ACCEPTED = "a safetensors file, a torch.save file, or a DCP checkpoint folder (with .metadata)"


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_step` wrote.

    Attributes:
        path: the file written.
        step: the step exported.
        format: ``safetensors`` or ``torch``.
        tensors: number of tensors.
        bytes: size of the file.
    """

    path: Path
    step: int
    format: str
    tensors: int
    bytes: int


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


def export_step(
    ckpt: Checkpointer,
    out: str | os.PathLike[str],
    *,
    step: int | None = None,
    format: str = "safetensors",
    overwrite: bool = False,
    subtree: str | None = None,
) -> ExportResult:
    """Write the consolidated tensors of ``step`` to the file ``out``.

    Args:
        ckpt: the checkpointer of the root to export from.
        out: the file to write.
        step: the step; the newest committed one when None.
        format: ``safetensors`` (tensors by FQN, the tree in the metadata) or ``torch``
            (``torch.save`` of the nested tree; numpy arrays become tensors so that the file
            loads with ``torch.load(weights_only=True)``).
        overwrite: replace ``out`` when it exists.
        subtree: export only this model state dict of the tree (``model`` in a
            ``TrainingState``), its prefix stripped, as ``from_pretrained`` and
            ``load_state_dict`` expect; see :func:`model_subtree`.

    Raises:
        ConfigError: unknown format, ``out`` exists and ``overwrite`` is False, or
            ``subtree`` is not a state dict of tensors.
        CheckpointNotFoundError: no such root or step.
        CorruptCheckpointError: the step's data is damaged.
    """
    if format not in FORMATS:
        raise ConfigError(f"export format {format!r} is not supported; use one of {FORMATS}")
    path = Path(out)
    if path.exists() and not overwrite:
        raise ConfigError(
            f"{path} already exists; pass overwrite=True (--overwrite) to replace it, or "
            "choose another path"
        )
    if path.is_dir():
        raise ConfigError(f"{path} is a folder; give a file name to export to")
    if not path.parent.is_dir():
        raise ConfigError(f"folder {path.parent} does not exist; create it first")
    if step is None:
        step = ckpt.latest_step()
        if step is None:
            raise CheckpointNotFoundError(
                f"no committed checkpoint under {ckpt.url}; nothing to export"
            )
    # A subtree reads (and verifies) its own tensors alone: damage elsewhere in the step (an
    # optimizer moment, say) does not keep intact weights from being exported.
    tree = ckpt.load(None, step) if subtree is None else load_subtree(ckpt, step, subtree)
    flat = flatten(tree)
    tensors = unshared({fqn: leaf.tensor for fqn, leaf in flat.leaves.items()})
    if format == "safetensors":
        from safetensors.torch import save_file

        for fqn, t in tensors.items():
            if t.dtype == torch.complex128:
                raise ConfigError(
                    f"tensor {fqn!r} is complex128, which safetensors cannot hold; export with "
                    "format='torch' (--format torch) instead"
                )
        meta = {
            "format": "pt",
            "stalwart.step": str(step),
            SKELETON_KEY: json.dumps(flat.skeleton, separators=(",", ":")),
        }
        user = ckpt.manifest(step).metadata
        if user:
            meta["stalwart.metadata"] = json.dumps(user)
        _atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))
    else:
        plain = _numpy_to_tensors(tree)
        _atomic_write(path, lambda tmp: torch.save(plain, tmp))
    return ExportResult(path, step, format, len(tensors), path.stat().st_size)


def load_subtree(ckpt: Checkpointer, step: int, subtree: str | None) -> dict[str, torch.Tensor]:
    """The model state dict at ``subtree`` of ``step`` (see :func:`model_subtree`), reading and
    verifying only its own tensors, so damage elsewhere in the step does not stop it.

    Raises:
        ConfigError: ``subtree`` is not a state dict of tensors (as :func:`model_subtree`).
        CheckpointNotFoundError: no such step.
        CorruptCheckpointError: one of the subtree's own tensors is damaged.
    """
    manifest = ckpt.manifest(step)
    held: dict[int, tuple[torch.Tensor, str]] = {}

    def placeholder(fqn: str) -> torch.Tensor:
        t = torch.empty(0, dtype=torch.uint8)  # stands in for the leaf until it is picked
        held[id(t)] = (t, fqn)
        return t

    picked = model_subtree(
        unflatten(manifest.skeleton, placeholder), subtree, where=f"{ckpt.url} step {step}"
    )
    return {key: ckpt.read_tensor(step, held[id(t)][1])[0] for key, t in picked.items()}


def model_subtree(tree: Any, subtree: str | None, *, where: str) -> dict[str, torch.Tensor]:
    """The flat ``{name: tensor}`` state dict at the dotted path ``subtree`` of ``tree``.

    Raises:
        ConfigError: no such path, or what is there (the whole tree when ``subtree`` is
            None) is not a flat dict of tensors, e.g. a whole training state with optimizer
            and RNG entries; the message names the subtree to pick.
    """
    node = tree
    for key in subtree.split(".") if subtree else []:
        if not isinstance(node, dict) or key not in node:
            keys = sorted(map(str, node)) if isinstance(node, dict) else []
            raise ConfigError(
                f"{where} has no subtree {subtree!r} (no key {key!r}; keys there: {keys}); "
                "pick one with subtree= (--subtree)"
            )
        node = node[key]
    if isinstance(node, dict) and node and all(isinstance(v, torch.Tensor) for v in node.values()):
        return {str(k): v for k, v in node.items()}
    models = sorted(
        str(k)
        for k, v in (node.items() if isinstance(node, dict) else [])
        if isinstance(v, dict) and v and all(isinstance(t, torch.Tensor) for t in v.values())
    )
    hint = f"subtree='{models[0]}' (--subtree {models[0]})" if models else "subtree= (--subtree)"
    held = sorted(map(str, node))[:8] if isinstance(node, dict) else type(node).__name__
    raise ConfigError(
        f"{where}{' at ' + repr(subtree) if subtree else ''} is not a model's state dict of "
        f"tensors (it holds {held}), e.g. a whole training state with optimizer and RNG "
        f"entries; a loader would find only unexpected keys. Pick the model with {hint}"
    )


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Run ``write(tmp)`` for a temp file next to ``path``, fsync it, rename it onto ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # some platforms cannot open folders; still atomic
        fsync_dir(str(path.parent))


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
        ConfigError: unknown format, the step exists, or the source needs unsafe pickle
            (a DCP folder: unless ``trust_pickle``).
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
    return _numpy_to_tensors(tree)


def _numpy_to_tensors(tree: Any) -> Any:
    if isinstance(tree, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(tree))
    if isinstance(tree, dict):
        return {k: _numpy_to_tensors(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_numpy_to_tensors(v) for v in tree)
    return tree
