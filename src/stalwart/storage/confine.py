"""Keep every path that :class:`~stalwart.storage.local.LocalStorage` touches inside its root.

Nothing under a checkpoint root may be a symbolic link: not ``packs/`` or ``manifests/``, not a
folder nested in them, not a single object. A link would let garbage collection of one root
delete another root's packs (two roots whose ``packs/`` point at one shared folder), let a
manifest read any file on the machine (``packs/sub`` pointing at ``/home``), or let ``ckpt rm``
delete what a linked ``manifests/`` holds. The root itself is the user's choice and may be
reached through links; everything below it is checked.

How: a key's folders are opened one at a time, each relative to the descriptor of the one above
(``openat``), with ``O_NOFOLLOW | O_DIRECTORY``; the object is then opened, created, renamed or
unlinked relative to its folder's descriptor, again without following a link. A link anywhere
on the way is refused with :class:`~stalwart.errors.UnsafePathError`; a folder swapped for a
link while we work cannot redirect us, since we hold the descriptor of the folder we checked.
The cost is one ``open`` and ``close`` per folder level (keys are two levels deep): about 3 µs
per call against 1 µs for a plain ``open`` on our disks, noise beside reading a chunk, so no
descriptor is cached (a cached one would outlive a root deleted and created again).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from stalwart.errors import (
    ObjectNotFoundError,
    StorageError,
    StoragePermissionError,
    UnsafePathError,
)
from stalwart.storage.base import ObjectInfo

__all__ = [
    "DIR_FLAGS",
    "NOFOLLOW",
    "Folders",
    "files_below",
    "link_error",
    "open_folders",
    "refuse_link",
    "walk",
]

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
"""Add to the flags of every ``open`` of an object: a link there fails instead of being followed."""
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_ROOT_FLAGS = os.O_RDONLY | _DIRECTORY | _CLOEXEC
DIR_FLAGS = _ROOT_FLAGS | NOFOLLOW
"""Flags to open a folder below the root: never through a link."""

LINK_ADVICE = (
    "stalwart never follows links under a checkpoint root, since gc or a damaged manifest "
    "could then delete or read files outside it. To keep checkpoints on another disk, mount "
    "that disk at the root, or put the whole root there (the root path itself may be a link); "
    "then replace this link with a real folder or file"
)


def link_error(path: str, op: str) -> UnsafePathError:
    """The error for a link met at ``path`` while doing ``op``."""
    return UnsafePathError(f"cannot {op}: {path} is a symbolic link; {LINK_ADVICE}")


@dataclass(frozen=True)
class Folders:
    """Open descriptors of a key's folders, the root first and the object's folder last.

    Attributes:
        path: the object's folder as a path, for messages.
        fds: the descriptors, root first; ``fds[-1]`` holds the object.
        created: ``created[i]`` is true when ``fds[i + 1]``'s folder was created by this call
            (its entry in ``fds[i]`` must be made durable too).
    """

    path: str
    fds: tuple[int, ...]
    created: tuple[bool, ...]

    @property
    def fd(self) -> int:
        """The descriptor of the object's folder."""
        return self.fds[-1]

    def fsync(self) -> None:
        """Make new entries durable: the object's folder and every folder that got a new one."""
        os.fsync(self.fd)
        for i, made in enumerate(self.created):
            if made:
                os.fsync(self.fds[i])


@contextlib.contextmanager
def open_folders(
    root: str, parts: Sequence[str], *, op: str, create: bool = False
) -> Iterator[Folders]:
    """Open ``root`` and then each of ``parts`` inside the one before, never through a link.

    Args:
        root: the store's root (may itself be reached through links).
        parts: folder names below it, already validated (no ``..``, no ``/``).
        op: what the caller does, for messages (``"read"``, ``"write"``, ...).
        create: create missing folders.

    Raises:
        UnsafePathError: a folder on the way is a symbolic link.
        ObjectNotFoundError: the root or a folder does not exist (and ``create`` is false).
        StorageError: a file stands where a folder should be, or the system refused.
    """
    fds: list[int] = []
    created: list[bool] = []
    path = root
    try:
        try:
            fds.append(os.open(root, _ROOT_FLAGS))
        except OSError as e:
            raise _folder_error(e, root, op) from e
        for part in parts:
            path = os.path.join(path, part)
            made = False
            if create:
                try:
                    os.mkdir(part, 0o777, dir_fd=fds[-1])
                    made = True
                except FileExistsError:
                    pass
                except OSError as e:
                    raise _folder_error(e, path, op) from e
            try:
                fds.append(os.open(part, DIR_FLAGS, dir_fd=fds[-1]))
            except OSError as e:
                if e.errno in (errno.ENOTDIR, errno.ELOOP) and _is_link(part, fds[-1]):
                    raise link_error(path, op) from e
                if e.errno == errno.ENOTDIR and not create:  # a file stands in the way
                    raise ObjectNotFoundError(f"no folder at {path} ({op}): it is a file") from e
                raise _folder_error(e, path, op) from e
            created.append(made)
        yield Folders(path, tuple(fds), tuple(created))
    finally:
        for fd in reversed(fds):
            with contextlib.suppress(OSError):
                os.close(fd)


def refuse_link(folders: Folders, name: str, op: str) -> None:
    """Raise :class:`UnsafePathError` when ``name`` in ``folders`` is a symbolic link."""
    if _is_link(name, folders.fd):
        raise link_error(os.path.join(folders.path, name), op)


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _folder_error(e: OSError, path: str, op: str) -> StorageError:
    if e.errno == errno.ENOENT:
        return ObjectNotFoundError(f"no folder at {path} ({op}): {e.strerror or e}")
    if e.errno == errno.ENOTDIR:
        return StorageError(
            f"cannot {op}: {path} is a file where stalwart expects a folder; move it out of "
            "the checkpoint root"
        )
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return StoragePermissionError(
            f"cannot {op} {path}: the location is read-only or not writable "
            f"({e.strerror or e}); choose a writable checkpoint root"
        )
    return StorageError(f"{op} {path} failed: {e}")


def files_below(
    dir_fd: int, key_prefix: str = "", *, stem: str = ""
) -> Iterator[tuple[int, str, os.DirEntry[str]]]:
    """Every entry below the open folder ``dir_fd`` that is not a folder, never through a link.

    Yields ``(fd of its folder, key_prefix + its path, entry)``, top-level names starting with
    ``stem`` only; the folder's fd stays open until the next entry is asked for. A folder
    swapped for a link, or removed, during the walk is skipped.
    """
    with os.scandir(dir_fd) as it:
        entries = [e for e in it if e.name.startswith(stem)]
    for entry in entries:
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
        except FileNotFoundError:
            continue  # deleted while we looked
        if not is_dir:
            yield dir_fd, f"{key_prefix}{entry.name}", entry
            continue
        try:
            sub = os.open(entry.name, DIR_FLAGS, dir_fd=dir_fd)
        except OSError:
            continue  # gone or swapped for a link meanwhile: never followed
        try:
            yield from files_below(sub, f"{key_prefix}{entry.name}/")
        finally:
            os.close(sub)


def walk(dir_fd: int, key_prefix: str, *, stem: str = "", hidden: str) -> Iterator[ObjectInfo]:
    """Objects below the open folder ``dir_fd`` whose top-level name starts with ``stem``.

    Links (to files or folders) and names starting with ``hidden`` (temporaries) are not
    objects: never listed, so never read or collected. A folder swapped for a link during the
    walk is skipped too.
    """
    for _, key, entry in files_below(dir_fd, key_prefix, stem=stem):
        try:
            if entry.is_file(follow_symlinks=False) and not entry.name.startswith(hidden):
                st = entry.stat(follow_symlinks=False)
                yield ObjectInfo(key, st.st_size, st.st_mtime)
        except FileNotFoundError:
            continue  # deleted while we looked: not listed
