"""The process's staging buffers, shared by every Checkpointer: :data:`HOST_BUFFERS`.

An asynchronous save copies the state into a host buffer; the first copy into fresh memory
faults in every page (several times the cost of a copy into warm pages). Buffers taken
from this pool go back when their save is done, so a new Checkpointer (one per save, as
scripts and integrations often make) finds warm pages and its first ``save_async`` blocks
no longer than a steady one.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

from stalwart.checkpoint.capture import HostBuffer

__all__ = ["HOST_BUFFERS", "HostBufferPool"]


class HostBufferPool:
    """Free host buffers of this process, by checkpoint root, the most recently used first.

    A save takes one for its root and gives it back once its copies are done and it is
    committed (or failed), so a new :class:`Checkpointer` of the same root finds the pages a
    previous one already faulted in. At most ``keep`` free buffers are kept (the oldest are
    dropped); :meth:`clear` frees them all.
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.free: list[tuple[str, HostBuffer]] = []
        self.made = 0  # buffers created because none was free, for tests and benches
        self._lock = threading.Lock()

    def take(self, key: str) -> HostBuffer:
        """The warmest free buffer last used for ``key`` (a root's URL), or a new one."""
        with self._lock:
            for i in range(len(self.free) - 1, -1, -1):
                if self.free[i][0] == key:
                    return self.free.pop(i)[1]
            self.made += 1
        return HostBuffer()

    def give(self, key: str, buf: HostBuffer) -> None:
        """Return ``buf``, last used for ``key``: no capture in it is read or written any more."""
        with self._lock:
            if all(b is not buf for _, b in self.free):
                self.free.append((key, buf))
            del self.free[: max(0, len(self.free) - self.keep)]

    def give_when_done(self, key: str, buf: HostBuffer, futures: list[Future[Any]]) -> None:
        """Return ``buf`` once every one of ``futures`` is done."""
        left = [len(futures)]
        lock = threading.Lock()

        def one_done(_f: Future[Any]) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self.give(key, buf)

        for f in futures:
            f.add_done_callback(one_done)

    def clear(self) -> None:
        """Free every buffer no save holds."""
        with self._lock:
            self.free.clear()


HOST_BUFFERS = HostBufferPool()
"""The process's pool of staging buffers, shared by every Checkpointer."""
