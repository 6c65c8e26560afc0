"""Read a DCP (``torch.distributed.checkpoint``) folder without running the code it may carry.

A DCP folder keeps its index in ``.metadata``, a pickle, and every non-tensor value as a
``torch.save`` pickle; unpickling either can run any code the folder's author chose. By default
this module runs neither:

* ``.metadata`` is read by an unpickler that resolves only the DCP metadata classes, ``torch``
  dtypes and ``torch.Size``, path objects, and the layout lookup DCP itself pickles; any other
  global (``os.system``, ``builtins.eval``, ...) refuses the folder before anything runs;
* non-tensor values are read with ``torch.load(weights_only=True)`` (tensors always were);
* data files must lie directly in the folder (a ``relative_path`` with a separator or ``..``
  is refused).

``trust_pickle=True`` (CLI ``--trust-pickle``) lifts the first two rules, for DCP folders that
hold arbitrary Python objects and come from a source the caller trusts.

Module imported on first DCP import only (it loads ``torch.distributed.checkpoint``).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import (
    _EmptyStateDictLoadPlanner,
    _load_state_dict,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from stalwart.errors import ConfigError, CorruptCheckpointError

__all__ = ["read_dcp"]

_META = "torch.distributed.checkpoint.metadata"
_ALLOWED = frozenset(
    {
        (_META, name)
        for name in (
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a lookup of torch.strided & co. by name
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }
)
_TRUST_HINT = (
    "stalwart does not run a DCP folder's pickles by default, since they can run any code. "
    "If you trust where this folder came from, pass trust_pickle=True (CLI: --trust-pickle)"
)


class _Refused(pickle.UnpicklingError):
    """The pickle names a global outside the allow-list."""


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only what DCP's own ``.metadata`` needs; everything else raises ``_Refused``."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name}")


class _MetadataReader(FileSystemReader):
    """A FileSystemReader that hands DCP the metadata read (safely) beforehand."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(str(path))
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return self._metadata


class _WeightsOnlyPlanner(_EmptyStateDictLoadPlanner):
    """DCP's planner for an empty state dict, but non-tensor values load weights-only."""

    refused: str | None = None

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            self.refused = f"the value {fqn!r} ({str(e).splitlines()[0][:200]})"
            raise
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def read_metadata(path: Path, *, trust_pickle: bool = False) -> Metadata:
    """The ``.metadata`` of the DCP folder ``path``, unpickled safely unless trusted.

    Raises:
        ConfigError: it needs a class outside the allow-list and ``trust_pickle`` is False.
        CorruptCheckpointError: it is not a readable DCP metadata file.
    """
    where = path / ".metadata"
    try:
        data = where.read_bytes()
    except OSError as e:
        raise CorruptCheckpointError(
            f"{where} is not a readable DCP metadata file ({type(e).__name__}: {e}); the "
            "checkpoint may be incomplete or damaged — copy or save it again"
        ) from e
    return parse_metadata(data, where, trust_pickle=trust_pickle)


def parse_metadata(data: bytes, where: Any, *, trust_pickle: bool = False) -> Metadata:
    """DCP ``.metadata`` bytes (read from ``where``, a path or URL) unpickled safely.

    Raises:
        ConfigError: they need a class outside the allow-list and ``trust_pickle`` is False.
        CorruptCheckpointError: they are not a readable DCP metadata file.
    """
    try:
        f = io.BytesIO(data)
        md = pickle.load(f) if trust_pickle else _MetadataUnpickler(f).load()
    except _Refused as e:
        raise ConfigError(
            f"{where} needs {e} to unpickle, which is not part of DCP's metadata. {_TRUST_HINT}"
        ) from None
    except Exception as e:  # a damaged pickle raises any of a dozen types
        raise CorruptCheckpointError(
            f"{where} is not a readable DCP metadata file ({type(e).__name__}: {e}); the "
            "checkpoint may be incomplete or damaged — copy or save it again"
        ) from e
    if not isinstance(md, Metadata):
        raise CorruptCheckpointError(f"{where} holds a {type(md).__name__}, not DCP Metadata")
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or rel in ("", ".", "..") or "/" in rel or "\\" in rel:
            raise CorruptCheckpointError(
                f"{where} names a data file {rel!r} outside its folder; DCP writes its data "
                "files next to .metadata, so this folder was altered — do not import it"
            )
    return md


def read_dcp(path: Path, *, trust_pickle: bool = False) -> dict[str, Any]:
    """The whole (nested) state dict of the DCP folder ``path``, read by this process alone.

    Raises:
        ConfigError: the folder needs pickle beyond the allow-list and ``trust_pickle`` is
            False (the message names the opt-in).
        CorruptCheckpointError: the folder is incomplete or damaged.
    """
    md = read_metadata(path, trust_pickle=trust_pickle)
    planner = _EmptyStateDictLoadPlanner() if trust_pickle else _WeightsOnlyPlanner()
    sd: dict[str, Any] = {}
    try:
        # The call dcp_to_torch_save makes, minus its round trip through a torch.save file:
        # the planner rebuilds the (nested) state dict from the metadata, one process reads.
        _load_state_dict(
            sd, storage_reader=_MetadataReader(path, md), planner=planner, no_dist=True
        )
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        refused = getattr(planner, "refused", None)
        if refused:
            raise ConfigError(
                f"{path}: {refused} is a pickle that torch.load(weights_only=True) refuses. "
                f"{_TRUST_HINT}"
            ) from None
        # Its message is every rank's traceback; the last line names the root cause.
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        cause = lines[-1].strip() if lines else type(e).__name__
        raise CorruptCheckpointError(
            f"{path} is a DCP checkpoint that could not be read ({cause[:500]}); it may be "
            "incomplete or damaged — copy or save it again"
        ) from e
    return sd
