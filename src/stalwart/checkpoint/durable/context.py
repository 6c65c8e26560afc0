"""What the saver, the loader and the async saver of one root share: the store, the options,
the process group, the I/O threads and the manifest cache.

One :class:`CheckpointContext` per :class:`~stalwart.checkpoint.durable.checkpointer.Checkpointer`;
its collaborators each hold it and talk to it through these methods only. It opens the store
lazily (a root is created by the first save), resolves the group at each use, and reads
manifests as stored now (see ``manifest_cache``).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from stalwart.checkpoint.collective import Group, resolve_group
from stalwart.checkpoint.durable.manifest import Manifest, committed_manifests
from stalwart.checkpoint.durable.manifest_cache import ManifestCache
from stalwart.checkpoint.options import CheckpointOptions
from stalwart.errors import CheckpointNotFoundError, ObjectNotFoundError
from stalwart.storage import open_storage
from stalwart.storage.base import ObjectInfo, Storage
from stalwart.storage.local import LocalStorage

__all__ = ["CheckpointContext", "short_steps"]

log = logging.getLogger(__name__)


class CheckpointContext:
    """The root, its store, options, group, threads and manifest cache of one checkpointer.

    Args:
        root: a local folder, an fsspec URL or a :class:`Storage`.
        options: the checkpointer's options.
        process_group: the ranks that save and load together (resolved at each use).
        storage_options: passed to fsspec for remote roots.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Storage,
        options: CheckpointOptions,
        *,
        process_group: Any = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.root = root
        self.options = options
        self.process_group = process_group
        self.storage_options = storage_options
        self.opened: Storage | None = None
        self.io_pool = ThreadPoolExecutor(options.io_threads, thread_name_prefix="stalwart-io")
        self.tensor_pool = ThreadPoolExecutor(
            options.io_threads, thread_name_prefix="stalwart-tensor"
        )
        self.cache = ManifestCache()  # parses, each checked against the store before use

    @property
    def group(self) -> Group:
        """The group, resolved now: a checkpointer made before ``init_process_group`` still
        coordinates the ranks (and does not race them as independent one-rank jobs)."""
        return resolve_group(self.process_group)

    @property
    def url(self) -> str:
        """Where the checkpoints live."""
        return self.store(create=False).url if self.exists() else str(self.root)

    def exists(self) -> bool:
        """True when the root is open, remote, or an existing local folder."""
        if self.opened is not None or not isinstance(self.root, (str, os.PathLike)):
            return True
        s = os.fspath(self.root)
        return ("://" in s and not s.startswith("file://")) or Path(
            s.removeprefix("file://")
        ).is_dir()

    def store(self, *, create: bool) -> Storage:
        """The store under the root, opened on first use (``create``: make the root)."""
        gone = isinstance(self.opened, LocalStorage) and not Path(self.opened.root).is_dir()
        if create and gone:
            # Deleted under us (by a person or a cleanup job): a save recreates it, loudly.
            log.warning(
                "checkpoint root %s was deleted while this Checkpointer was open; recreating "
                "it (the checkpoints it held are gone)",
                self.opened.url,  # type: ignore[union-attr]
            )
            os.makedirs(self.opened.root, exist_ok=True)  # type: ignore[union-attr]
            self.cache.clear()
        if self.opened is None:
            if not create and not self.exists():
                raise CheckpointNotFoundError(
                    f"checkpoint root {os.fspath(self.root)!r} does not exist; check the path "  # type: ignore[arg-type]
                    "(it is created by the first save)"
                )
            self.opened = open_storage(self.root, storage_options=self.storage_options, create=True)
        return self.opened

    def steps(self) -> list[int]:
        """Committed steps, ascending (empty when the root holds none or does not exist)."""
        if not self.exists():
            return []
        return list(committed_manifests(self.store(create=False)))

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def manifest(self, step: int, listed: ObjectInfo | None = None) -> Manifest:
        """``step``'s manifest as stored now, never an older copy.

        Another process may have replaced or deleted the step, and retention, dedup and load
        must act on what is there (see manifest_cache). ``listed``: the step's entry in a
        listing made before this call.

        Raises:
            CheckpointNotFoundError: the step was never committed (or was deleted).
            CorruptCheckpointError: the manifest is damaged.
        """
        store = self.store(create=False)
        try:
            return self.cache.get(store, step, listed=listed)
        except ObjectNotFoundError:
            steps = self.steps()
            raise CheckpointNotFoundError(
                f"step {step} is not a committed checkpoint in {store.url}; committed steps: "
                f"{short_steps(steps)}" + ("" if steps else " (none yet)")
            ) from None

    def close(self) -> None:
        """Release the threads and the store's connections."""
        self.tensor_pool.shutdown(wait=True)
        self.io_pool.shutdown(wait=True)
        if self.opened is not None:
            self.opened.close()


def short_steps(steps: list[int]) -> str:
    """A list of steps for a message: whole when short, else its ends and its count."""
    if len(steps) <= 8:
        return str(steps)
    return f"[{steps[0]}, {steps[1]}, …, {steps[-2]}, {steps[-1]}] ({len(steps)} in all)"
