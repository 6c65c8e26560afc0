"""Every exception stalwart raises, in one tree.

Each class also subclasses the builtin a caller would naturally catch, so
``except FileNotFoundError`` keeps working for code that does not know stalwart.
Foreign errors (``OSError`` from the disk, botocore errors from S3, ...) are translated
once, at the storage boundary, with ``raise ... from``.

    StalwartError
    ├── ConfigError (ValueError)                   bad argument or option
    ├── StorageError (OSError)                     a byte store failed
    │   ├── ObjectNotFoundError (FileNotFoundError)    a key is not in the store
    │   ├── StorageFullError                           no space left on the device
    │   ├── StoragePermissionError (PermissionError)   read-only or forbidden location
    │   │   └── UnsafePathError                         a path leaves the root (a link, ..)
    │   └── TransientStorageError                      worth retrying (throttled, timeout)
    ├── CheckpointError
    │   ├── CheckpointNotFoundError (FileNotFoundError) no such root or step
    │   ├── CorruptCheckpointError (ValueError)         hash mismatch, truncated, missing chunk
    │   │   └── UnsafeManifestError                     manifest points outside the store
    │   ├── StateMismatchError (ValueError)             keys, shapes or dtypes differ
    │   ├── StepExistsError (FileExistsError)           saving would replace a committed step
    │   ├── StepRetiredError (FileNotFoundError)        a step was deleted while being read
    │   └── UnsupportedValueError (TypeError)           an object the format cannot hold
    ├── DistributedError (RuntimeError)            another rank failed or disagreed
    └── MissingDependencyError (ImportError)       an optional extra is not installed

Messages say what was expected, what was found, and what to do next. :func:`require`
imports an optional engine (DuckDB, SciPy, ...) at the point of use, or raises
:class:`MissingDependencyError` naming the extra that provides it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "ConfigError",
    "CorruptCheckpointError",
    "DistributedError",
    "MissingDependencyError",
    "ObjectNotFoundError",
    "StalwartError",
    "StateMismatchError",
    "StepExistsError",
    "StepRetiredError",
    "StorageError",
    "StorageFullError",
    "StoragePermissionError",
    "TransientStorageError",
    "UnsafeManifestError",
    "UnsafePathError",
    "UnsupportedValueError",
    "require",
]


class StalwartError(Exception):
    """Root of every error stalwart raises."""


class ConfigError(StalwartError, ValueError):
    """An argument or option is invalid; the message names it and the accepted values."""


class StorageError(StalwartError, OSError):
    """A byte store failed to read, write, list or delete."""


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """A key that was expected in the store is not there."""


class StorageFullError(StorageError):
    """The device or bucket has no space left; free space or point at another location."""


class StoragePermissionError(StorageError, PermissionError):
    """The location is read-only or access was denied."""


class UnsafePathError(StoragePermissionError):
    """A path under the root is, or passes through, a symbolic link or leaves the root.

    stalwart never reads, writes or deletes outside a root: a link could make a checkpoint's
    garbage collection delete another root's files, or make a manifest read any file.
    """


class TransientStorageError(StorageError):
    """A failure that may succeed if retried (throttling, timeouts, connection resets)."""


class CheckpointError(StalwartError):
    """A checkpoint could not be saved, found or loaded."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The root holds no checkpoint, or not the requested step."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """Stored bytes do not match their recorded hash, are truncated or missing.

    Attributes:
        damaged: human-readable descriptions of every damaged piece found (may be empty when
            the error was raised at the first problem).
    """

    def __init__(self, message: str, damaged: list[str] | None = None) -> None:
        super().__init__(message)
        self.damaged = list(damaged or [])


class UnsafeManifestError(CorruptCheckpointError):
    """A manifest names a location outside its store (``..``, an absolute path, a URL)."""


class StateMismatchError(CheckpointError, ValueError):
    """The state given to ``load`` does not match the checkpoint (keys, shapes or dtypes)."""


class StepExistsError(CheckpointError, FileExistsError):
    """Saving would replace a committed step; pass ``overwrite=True`` to replace it on purpose."""


class StepRetiredError(CheckpointNotFoundError):
    """A step was deleted (retention, ``ckpt rm``, gc) while it was being read."""


class UnsupportedValueError(CheckpointError, TypeError):
    """The state tree holds an object the format cannot store without pickle."""


class DistributedError(StalwartError, RuntimeError):
    """Ranks disagreed, or another rank failed during a collective operation."""


class MissingDependencyError(StalwartError, ImportError):
    """A feature needs a package from an optional extra that is not installed."""


# Names people know the import names by, for the message.
_PACKAGES = {
    "duckdb": "DuckDB",
    "pyarrow": "PyArrow",
    "matplotlib": "matplotlib",
    "sklearn": "scikit-learn",
    "scipy": "SciPy",
    "pyeclib": "PyECLib",
    "pyspark": "PySpark",
    "s3fs": "s3fs",
    "lightning": "Lightning 2.x",
    "transformers": "transformers",
}


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import ``module`` for ``feature``, or say which extra installs it.

    Optional engines are imported where they are used (never by ``import stalwart``), so a
    container that only checkpoints needs none of them.

    Args:
        module: import name, e.g. ``"duckdb"`` or ``"scipy.special"``.
        extra: the ``stalwart[...]`` extra that provides it, e.g. ``"rca"``.
        feature: what needs it, for the message, e.g. ``"stalwart.diagnose"``.

    Raises:
        MissingDependencyError: the import failed; the message names the install command.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.partition(".")[0]
        raise MissingDependencyError(
            f"{feature} needs {_PACKAGES.get(top, top)}, which is not installed ({e}): "
            f"pip install 'stalwart[{extra}]'"
        ) from e
