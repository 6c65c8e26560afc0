"""Temporaries of :class:`~stalwart.storage.local.LocalStorage` writes: names, claims, cleanup.

A write fills ``.tmp-<32 hex>-<name>`` next to its target and renames it into place; a crash
leaves the temporary behind, and :func:`remove_stale` removes such leftovers. It must never
remove a temporary that a writer is still filling: that write then fails at its rename
(issue 23: ``gc --grace-s 0`` failed saves and loads with ``ObjectNotFoundError`` on their
lease, because the grace was the only test and a lease's temporary lives a millisecond). So:

* a writer holds an exclusive ``flock`` on its temporary from its creation until after the
  rename (:func:`create_claimed`). A temporary whose lock is held is in flight and is never
  removed, whatever its age and whatever grace the caller asked for;
* cleanup takes that lock itself, without waiting, before it unlinks; a writer that finds,
  once it holds its lock, that its file was unlinked meanwhile starts again under a new name;
* a temporary nobody holds belongs to a dead writer. One that :func:`create_claimed` named
  (:data:`CLAIMED_NAME`) goes at once, whatever its age: its writer held the lock as long as
  it lived, so a killed save's pack (up to 256 MiB reserved ahead of its data by a direct
  write) frees its space at the next ``gc``, not an hour later. Any other temporary of the
  form (written by a stalwart from before the claims, which took no lock) goes once it is
  older than the caller's threshold; where the filesystem cannot lock, nobody can tell, so
  a temporary goes only once its last write is :data:`UNLOCKED_MIN_AGE_S` old, a floor no
  caller can lower.

Only names of the exact form :func:`create_claimed` gives count, and links are never followed
(the walk goes through :mod:`stalwart.storage.confine`). On a network filesystem ``flock`` is
as good as the filesystem's locking (NFSv4 locks across hosts; some FUSE mounts only locally).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import time
import uuid

from stalwart.errors import StorageError
from stalwart.storage.confine import NOFOLLOW, files_below

__all__ = [
    "CLAIMED_NAME",
    "TEMP_NAME",
    "TEMP_PREFIX",
    "UNLOCKED_MIN_AGE_S",
    "RemovedTemps",
    "create_claimed",
    "remove_stale",
]

TEMP_PREFIX = ".tmp-"
"""Name prefix of in-flight temporaries; never a valid object name, never listed."""
TEMP_NAME = re.compile(r"^\.tmp-[0-9a-f]{32}-")
"""Exactly the names :func:`create_claimed` gives (and gave before the claims); no other file is
ever removed as a temporary."""
CLAIMED_NAME = re.compile(r"^\.tmp-[0-9a-f]{12}0[0-9a-f]{19}-")
"""The names of temporaries whose writer claims them: the 13th hex digit is ``0``. Writers from
before the claims named theirs with ``uuid4().hex``, whose 13th digit (the UUID version) is
always ``4``, so an unclaimed temporary of this form provably lost its writer."""
UNLOCKED_MIN_AGE_S = 3600.0
"""Where locks do not work, a temporary is removed only when its last write is this old."""

_NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})
_ATTEMPTS = 8


def create_claimed(dir_fd: int, name: str, flags: int, mode: int = 0o644) -> tuple[int, str]:
    """Create a new temporary for ``name`` in the folder ``dir_fd`` and claim it.

    Returns ``(fd, temporary name)``; the claim lasts until ``fd`` is closed, so close it only
    after the rename. ``flags`` must include ``O_CREAT | O_EXCL``.

    Raises:
        StorageError: cleanup removed every temporary we made (never seen in practice).
    """
    for _ in range(_ATTEMPTS):
        tmp = f"{TEMP_PREFIX}{_claimed_hex()}-{name}"
        fd = os.open(tmp, flags | NOFOLLOW, mode, dir_fd=dir_fd)
        if _claim(fd):
            return fd, tmp
        os.close(fd)  # cleanup holds it or took it: leave it and start again
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
    raise StorageError(
        f"could not keep a temporary for {name}: another process removed {_ATTEMPTS} in a row; "
        "check for a cleanup job that deletes .tmp- files under the checkpoint root"
    )


def _claimed_hex() -> str:
    """32 random hex digits but the 13th, ``0``: the mark of :data:`CLAIMED_NAME`."""
    digits = uuid.uuid4().hex
    return f"{digits[:12]}0{digits[13:]}"


def _claim(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno not in _NO_LOCKS:
            raise
        return True  # no locks here: the age floor protects us
    return os.fstat(fd).st_nlink > 0  # unlinked between our create and our lock


class RemovedTemps(int):
    """How many temporaries :func:`remove_stale` removed (an ``int``, as
    ``RemovesStaleTemps.remove_stale_temps`` returns), with the bytes they held."""

    bytes_freed: int

    def __new__(cls, count: int = 0, bytes_freed: int = 0) -> RemovedTemps:
        removed = super().__new__(cls, count)
        removed.bytes_freed = bytes_freed
        return removed


def remove_stale(root_fd: int, older_than_s: float) -> RemovedTemps:
    """Remove the temporaries of dead writers below the open folder ``root_fd``.

    A claimed one (:data:`CLAIMED_NAME`) goes once its lock is free, whatever its age; any
    other one once it is also older than ``older_than_s``.

    Returns how many were removed, and their bytes.
    """
    now = time.time()
    return _sweep(root_fd, now - older_than_s, now - max(older_than_s, UNLOCKED_MIN_AGE_S))


def _sweep(dir_fd: int, cutoff: float, unlocked_cutoff: float) -> RemovedTemps:
    removed, freed = 0, 0
    for fd, _, entry in files_below(dir_fd):
        try:
            if not TEMP_NAME.match(entry.name) or not entry.is_file(follow_symlinks=False):
                continue
            st = entry.stat(follow_symlinks=False)
            old = st.st_mtime < cutoff or CLAIMED_NAME.match(entry.name) is not None
            if old and _remove_unclaimed(fd, entry.name, st.st_mtime, unlocked_cutoff):
                removed, freed = removed + 1, freed + st.st_size
        except FileNotFoundError:
            continue
    return RemovedTemps(removed, freed)


def _remove_unclaimed(dir_fd: int, name: str, mtime: float, unlocked_cutoff: float) -> bool:
    """Unlink ``name`` unless a writer holds its claim; True when it was removed."""
    try:
        fd = os.open(name, os.O_RDONLY | NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
    except OSError:
        return False  # renamed into place or removed meanwhile, or a link
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a writer is filling it
        except OSError as e:
            if e.errno not in _NO_LOCKS or mtime >= unlocked_cutoff:
                return False  # cannot tell whether a writer owns it: only very old ones go
        held = os.fstat(fd)
        try:
            now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            return False
        if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
            return False  # the name now belongs to another file: not the one we judged
        os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
