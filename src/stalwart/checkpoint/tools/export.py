"""Export a step to one safetensors or torch.save file.

Export writes the consolidated view (every tensor whole, as one process would load it with
``Checkpointer.load(None, step)``) to a temporary file next to ``out``, fsyncs it and renames it
into place, so ``out`` is either absent or complete, and an existing ``out`` is never replaced
unless asked. A safetensors export keys tensors by FQN and keeps the whole tree structure (the
skeleton, with every non-tensor value) in the header metadata under ``stalwart.skeleton``, so
importing it back rebuilds the same tree.

Import lives in :mod:`stalwart.checkpoint.tools.importing`; its names stay importable from here.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stalwart.checkpoint.durable.checkpointer import Checkpointer
from stalwart.checkpoint.tools.importing import (  # import_file, ImportResult: the old path
    SKELETON_KEY,
    ImportResult,
    import_file,
    numpy_to_tensors,
)
from stalwart.errors import CheckpointNotFoundError, ConfigError, StorageFullError
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
# A file's suffix names its format; a name no format claims is written as safetensors.
SUFFIXES = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch"}


def format_for(path: Path, format: str | None) -> str:
    """The format to write ``path`` in: ``format``, else the one its suffix names.

    Raises:
        ConfigError: ``format`` is unknown, or contradicts the format ``path``'s suffix names
            (``model.pt`` written as safetensors would fail ``torch.load`` later).
    """
    named = SUFFIXES.get(path.suffix.lower())
    if format is None:
        return named or "safetensors"
    if format not in FORMATS:
        raise ConfigError(f"export format {format!r} is not supported; use one of {FORMATS}")
    if named is not None and named != format:
        raise ConfigError(
            f"{path.name} names a {named} file but the format asked is {format}; rename it "
            f"(e.g. {path.stem}{'.pt' if format == 'torch' else '.safetensors'}) or drop the format"
        )
    return format


def unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` contiguous, each with memory of its own, for ``safetensors.save_file``.

    A load with no target gives tensors that were views of one another at save time (tied
    embeddings, ``w`` and ``w[1]``, ``w`` and ``w.t()``) their shared memory back; safetensors
    refuses shared memory and non-contiguous strides, so every tensor after the first on a
    storage is copied into contiguous memory of its own (a plain ``clone()`` keeps the strides
    of a transposed view).
    """
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for fqn, t in tensors.items():
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():
            out[fqn] = t.clone(memory_format=torch.contiguous_format)
        else:
            out[fqn] = t.contiguous()
        seen.add(ptr)
    return out


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


def export_step(
    ckpt: Checkpointer,
    out: str | os.PathLike[str],
    *,
    step: int | None = None,
    format: str | None = None,
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
            loads with ``torch.load(weights_only=True)``); None: the one ``out``'s suffix
            names (``.pt``, ``.pth``, ``.bin``: torch), else safetensors.
        overwrite: replace ``out`` when it exists.
        subtree: export only this model state dict of the tree (``model`` in a
            ``TrainingState``), its prefix stripped, as ``from_pretrained`` and
            ``load_state_dict`` expect; see :func:`model_subtree`.

    Raises:
        ConfigError: unknown format or one ``out``'s suffix contradicts, ``out`` exists and
            ``overwrite`` is False, or ``subtree`` is not a state dict of tensors.
        CheckpointNotFoundError: no such root or step.
        CorruptCheckpointError: the step's data is damaged.
    """
    path = Path(out)
    format = format_for(path, format)
    _check_out(path, overwrite)
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
    nbytes = sum(t.nbytes for t in tensors.values())
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
        _atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta), nbytes)
    else:
        plain = numpy_to_tensors(tree)
        _atomic_write(path, lambda tmp: torch.save(plain, tmp), nbytes)
    return ExportResult(path, step, format, len(tensors), path.stat().st_size)


def _check_out(path: Path, overwrite: bool) -> None:
    """Refuse an ``out`` that exists (unless ``overwrite``), is a folder, or has no folder."""
    if path.exists() and not overwrite:
        raise ConfigError(
            f"{path} already exists; pass overwrite=True (--overwrite) to replace it, or "
            "choose another path"
        )
    if path.is_dir():
        raise ConfigError(f"{path} is a folder; give a file name to export to")
    if path.parent.exists() and not path.parent.is_dir():
        raise ConfigError(f"{path.parent} is a file, not a folder; give a file in a folder")
    if not path.parent.is_dir():
        raise ConfigError(f"folder {path.parent} does not exist; create it first")


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


def _atomic_write(path: Path, write: Callable[[Path], None], nbytes: int) -> None:
    """Run ``write(tmp)`` for a temp file next to ``path``, fsync it, rename it onto ``path``.

    A failure removes the temp file; one that a full disk caused becomes a
    :class:`StorageFullError` (safetensors and ``torch.save`` report it without an errno, as
    ``SafetensorError`` or "enforce fail at inline_container.cc", so the folder's free space
    decides: too little left for the ``nbytes`` of tensors)."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as e:
        full = isinstance(e, Exception) and _disk_full(e, tmp, nbytes)
        tmp.unlink(missing_ok=True)
        if full:
            raise StorageFullError(
                f"no space left on the device writing {path} ({nbytes:,} bytes of tensors); "
                f"free space there or export to another disk ({path} is unchanged)"
            ) from e
        raise
    with contextlib.suppress(OSError):  # some platforms cannot open folders; still atomic
        fsync_dir(str(path.parent))


def _disk_full(e: Exception, tmp: Path, nbytes: int) -> bool:
    if isinstance(e, OSError) and e.errno is not None:
        return e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
    try:
        free = shutil.disk_usage(tmp.parent).free
        written = tmp.stat().st_size if tmp.exists() else 0
    except OSError:
        return False
    return free < 1 << 20 or free + written < nbytes
