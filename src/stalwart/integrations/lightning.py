"""Lightning: a ``CheckpointIO`` plugin that writes stalwart checkpoints into one root.

Adopting it is one argument::

    from stalwart.integrations.lightning import StalwartCheckpointIO
    trainer = Trainer(plugins=[StalwartCheckpointIO()])   # or StalwartCheckpointIO("s3://b/run")

**Layout.** Lightning names and manages checkpoints by file path (``epoch=0-step=10.ckpt``,
``last.ckpt``, top-k removal, ``ckpt_path="last"``). The data goes into one stalwart root, so
consecutive checkpoints share every unchanged chunk; at Lightning's path the plugin writes a
small *pointer* file naming the root (relative to the pointer's folder, so a copied or renamed
run folder still loads) and the step (format: :mod:`~stalwart.integrations.lightning_pointer`).
The root is ``root`` when given, else ``stalwart/`` inside the checkpoint's folder. Steps in
the root count saves (1, 2, 3, ...) rather than repeat ``global_step``: Lightning may save
twice at one global step (``last.ckpt`` beside a top-k file) and remove either, so a save never
replaces a committed step. Each manifest's metadata records
``lightning.global_step``, ``lightning.epoch`` and ``lightning.path``.

**Lifecycle.** A pointer is written only after its step is committed, so a pointer never names
a missing step. Removing a checkpoint (top-k rotation) deletes its pointer, and its step unless
another pointer in the same folder names it (a copied ``last.ckpt``); ``teardown`` collects the
packs no step uses any more. With ``async_save=True`` saves return once the tensors are staged
(``Checkpointer.save_async``), and the pointer follows the commit in the background.

**Loading.** ``Trainer.fit(ckpt_path=...)`` goes through the plugin. Lightning's
``LightningModule.load_from_checkpoint`` (and a plain ``Trainer`` without the plugin) bypasses
plugins and ``torch.load``-s the path through one function, ``lightning.fabric.utilities.
cloud_io._load``; :func:`install_loader` (run by every :class:`StalwartCheckpointIO`, or called
once in a process that only loads) wraps it so that a stalwart pointer is read from its root and
anything else goes to Lightning's loader unchanged. Without it, ``torch.load`` of a pointer
fails with a message that says to call :func:`install_loader` (the pointer's guard line, not
torch's advice to pass ``weights_only=False``). :func:`read_checkpoint` gives the plain dict.
A path holding an ordinary ``torch.save`` checkpoint still loads, through Lightning's own
loader, so an old run can resume under the plugin.

Hyper-parameters (``argparse.Namespace``, dataclasses, Enums, sets, paths) travel as plain data
(see :mod:`stalwart.tree`); nothing is unpickled on load. Enum and dataclass classes are rebuilt
only when listed with :func:`stalwart.tree.allow_types`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from stalwart.checkpoint import Checkpointer, CheckpointOptions, KeepAll
from stalwart.checkpoint.results import PendingSave
from stalwart.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    require,
)
from stalwart.integrations.lightning_pointer import (
    is_pointer,
    missing_root,
    read_pointer,
    write_pointer,
)

plugins_io = require("lightning.fabric.plugins.io", "lightning", "stalwart.integrations.lightning")
CheckpointIO: Any = plugins_io.CheckpointIO  # Any: a class of a module require() returned
TorchCheckpointIO = plugins_io.TorchCheckpointIO

__all__ = ["StalwartCheckpointIO", "install_loader", "load_from_checkpoint", "read_checkpoint"]

log = logging.getLogger(__name__)


def _root_url(root: str | os.PathLike[str]) -> str:
    text = os.fspath(root)
    return text if "://" in text else os.path.abspath(text)


_LOCAL_GROUP: list[tuple[Any, Any]] = []  # (the default group it belongs to, the group)


def _local_group() -> Any:
    """A group of this process alone when torch.distributed runs (Lightning saves on rank 0).

    One per process and default group: every pointer load asks for it, and a new group each
    time left one more set of sockets in torch's registry per load.
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    world = dist.group.WORLD
    if _LOCAL_GROUP and _LOCAL_GROUP[0][0] is world:
        return _LOCAL_GROUP[0][1]
    group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    _LOCAL_GROUP[:] = [(world, group)]
    return group


def install_loader() -> None:
    """Let Lightning's own loaders read stalwart pointers (idempotent).

    ``LightningModule.load_from_checkpoint``, ``LightningDataModule.load_from_checkpoint`` and
    ``TorchCheckpointIO`` all load through ``cloud_io._load``, imported by name into
    ``core.saving`` and ``plugins.io.torch_io``; the three names get one wrapper. A path that
    is not a stalwart pointer (a ``torch.save`` file, a URL, a file object) goes to the
    original unchanged.
    """
    import lightning.fabric.plugins.io.torch_io as torch_io
    import lightning.fabric.utilities.cloud_io as cloud_io
    import lightning.pytorch.core.saving as saving

    original = cloud_io._load
    if getattr(original, "_stalwart", False):
        return

    def load(path_or_url: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        if isinstance(path_or_url, (str, os.PathLike)) and is_pointer(path_or_url):
            tree = read_checkpoint(path_or_url)
            if isinstance(map_location, (str, torch.device)):
                tree = _to_device(tree, torch.device(map_location))
            return tree
        return original(path_or_url, map_location=map_location, weights_only=weights_only)

    load._stalwart = True  # type: ignore[attr-defined]
    cloud_io._load = saving.pl_load = torch_io.pl_load = load


class StalwartCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that stores checkpoints in a stalwart root (see module doc).

    Args:
        root: folder or fsspec URL of the stalwart root; ``None`` puts it in ``stalwart/``
            next to each checkpoint file.
        options: the stalwart checkpoint options (chunking, compression, threads).
        async_save: return from a save once its tensors are staged; the write and the commit
            run in the background (``load``, ``remove`` and ``teardown`` wait for them).
        storage_options: fsspec options for a remote root (credentials, endpoint).
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        options: CheckpointOptions | None = None,
        async_save: bool = False,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if options is not None and not isinstance(options.keep, KeepAll):
            raise ConfigError(
                f"StalwartCheckpointIO(options=...) has keep={options.keep!r}, which would "
                "delete steps Lightning's files point to; leave keep at KeepAll() and let "
                "ModelCheckpoint(save_top_k=...) decide what to keep"
            )
        self.root = None if root is None else _root_url(root)
        self.options = options
        self.async_save = async_save
        self.storage_options = storage_options
        self._checkpointers: dict[str, Checkpointer] = {}
        self._next_step: dict[str, int] = {}
        self._pending: dict[str, Future[None]] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._group: Any = None
        install_loader()

    def _root_for(self, path: str) -> str:
        return self.root or os.path.join(os.path.dirname(os.path.abspath(path)), "stalwart")

    def checkpointer(self, root: str) -> Checkpointer:
        """The (cached) :class:`Checkpointer` of ``root``."""
        with self._lock:
            ck = self._checkpointers.get(root)
            if ck is None:
                if self._group is None:
                    self._group = _local_group()
                ck = Checkpointer(
                    root,
                    self.options,
                    process_group=self._group,
                    storage_options=self.storage_options,
                )
                self._checkpointers[root] = ck
            return ck

    def _allocate_step(self, root: str, ck: Checkpointer) -> int:
        with self._lock:
            if root not in self._next_step:
                self._next_step[root] = max(ck.steps(), default=0) + 1
            step = self._next_step[root]
            self._next_step[root] = step + 1
            return step

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Save Lightning's ``checkpoint`` dict as the next step of the root; point ``path`` to it.

        Raises:
            TypeError: ``storage_options`` was given (pass them to the constructor instead).
            UnsupportedValueError: the dict holds a value stalwart cannot store safely.
        """
        if storage_options is not None:
            raise TypeError(
                "StalwartCheckpointIO takes fsspec options once, as "
                "StalwartCheckpointIO(root, storage_options=...), not per save"
            )
        path = os.path.abspath(os.fspath(path))
        self._wait(path)  # a second save to one path lands after the first
        root = self._root_for(path)
        ck = self.checkpointer(root)
        step = self._allocate_step(root, ck)
        meta = {
            "lightning.path": path,
            "lightning.global_step": str(checkpoint.get("global_step", "")),
            "lightning.epoch": str(checkpoint.get("epoch", "")),
        }
        ptr = {
            "root": root,
            "step": step,
            "global_step": checkpoint.get("global_step"),
            "epoch": checkpoint.get("epoch"),
        }
        if not self.async_save:
            ck.save(step, checkpoint, metadata=meta)
            self._publish(path, ptr, ck)
            return
        pending = ck.save_async(step, checkpoint, metadata=meta)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="stalwart-lightning")
        self._pending[path] = self._executor.submit(self._finish, pending, path, ptr, ck)

    def _finish(
        self, pending: PendingSave, path: str, ptr: dict[str, Any], ck: Checkpointer
    ) -> None:
        pending.wait()
        self._publish(path, ptr, ck)

    def _publish(self, path: str, ptr: dict[str, Any], ck: Checkpointer) -> None:
        """Point ``path`` at the committed step; drop the step it pointed at before."""
        old = read_pointer(path) if os.path.exists(path) else None
        write_pointer(path, ptr)
        if old is not None and old["root"] == ptr["root"] and old["step"] != ptr["step"]:
            self._drop_step(path, old, ck)

    def _drop_step(self, path: str, ptr: dict[str, Any], ck: Checkpointer) -> None:
        """Delete ``ptr``'s step unless another pointer in ``path``'s folder still names it."""
        folder = os.path.dirname(path)
        for name in os.listdir(folder):
            other = os.path.join(folder, name)
            if other == path or not os.path.isfile(other):
                continue
            with contextlib.suppress(CheckpointNotFoundError, CorruptCheckpointError, OSError):
                o = read_pointer(other)
                if o and (o["root"], o["step"]) == (ptr["root"], ptr["step"]):
                    return
        with contextlib.suppress(CheckpointNotFoundError):  # already gone: nothing to do
            ck.delete(ptr["step"])

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load the checkpoint ``path`` points to (a torch.save file loads the usual way).

        ``map_location`` may be a device or a device string; tensors load on the CPU otherwise.
        ``weights_only`` is accepted for Lightning's sake: a stalwart checkpoint never unpickles.
        """
        path = os.fspath(path)
        self._wait()
        ptr = read_pointer(path)
        if ptr is None:
            return TorchCheckpointIO().load_checkpoint(path, weights_only=weights_only)
        _require_root(path, ptr)
        tree = self.checkpointer(ptr["root"]).load(None, ptr["step"])
        if isinstance(map_location, (str, torch.device)):
            tree = _to_device(tree, torch.device(map_location))
        return tree

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the pointer ``path`` and its step (unless another pointer names it)."""
        path = os.path.abspath(os.fspath(path))
        self._wait(path)
        if not os.path.lexists(path):
            return
        ptr = None
        with contextlib.suppress(CorruptCheckpointError):
            ptr = read_pointer(path) if os.path.isfile(path) else None
        os.remove(path)
        if ptr is not None:
            self._drop_step(path, ptr, self.checkpointer(ptr["root"]))

    def _wait(self, path: str | None = None) -> None:
        """Wait for the background save of ``path`` (of every path when None)."""
        futures = [self._pending.pop(path, None)] if path else list(self._pending.values())
        if path is None:
            self._pending.clear()
        for fut in futures:
            if fut is not None:
                fut.result()

    def teardown(self) -> None:
        """Wait for every save, collect unused packs, close the checkpointers."""
        try:
            self._wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            for ck in self._checkpointers.values():
                with contextlib.suppress(CheckpointNotFoundError):
                    ck.gc()
                ck.close()
            self._checkpointers.clear()


def _to_device(tree: Any, device: torch.device) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: _to_device(v, device) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_device(v, device) for v in tree)
    return tree


def read_checkpoint(path: str | os.PathLike[str], *, root: str | None = None) -> dict[str, Any]:
    """Lightning's checkpoint dict behind the pointer ``path``.

    Args:
        path: a pointer file written by :class:`StalwartCheckpointIO`.
        root: read from this root instead of the one the pointer names (a moved root).

    Raises:
        CheckpointNotFoundError: no such file or step.
        CorruptCheckpointError: ``path`` is not a stalwart pointer, or the data is damaged.
    """
    ptr = read_pointer(os.fspath(path))
    if ptr is None:
        raise CorruptCheckpointError(
            f"{path} is not a stalwart pointer file; load it with "
            "LightningModule.load_from_checkpoint as usual"
        )
    if root is None:
        _require_root(path, ptr)
    with Checkpointer(root or ptr["root"], process_group=_local_group()) as ck:
        return ck.load(None, ptr["step"])


def _require_root(path: str | os.PathLike[str], ptr: dict[str, Any]) -> None:
    """Raise when the root ``ptr`` names is gone, saying the path came from ``path``."""
    problem = missing_root(path, ptr)
    if problem is not None:
        raise CheckpointNotFoundError(problem)


def load_from_checkpoint(cls: Any, checkpoint_path: str | os.PathLike[str], **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint(checkpoint_path, **kwargs)`` with :func:`install_loader` done.

    Kept for code written before Lightning's own ``load_from_checkpoint`` read pointers.

    Args:
        cls: the ``LightningModule`` (or ``LightningDataModule``) class.
        checkpoint_path: the pointer file (``trainer.checkpoint_callback.best_model_path``).
        **kwargs: passed on (``map_location``, ``strict``, hyper-parameter overrides).
    """
    install_loader()
    return cls.load_from_checkpoint(checkpoint_path, **kwargs)
