"""How stalwart starts the Python processes it runs itself: forked by a preloaded forkserver.

``stalwart.testing.run_ranks`` (gloo test worlds) and the PVF campaign's torch back-end
(``scale.run_sharded(..., backend="torch")``) start processes that each need torch. A spawned
interpreter imports torch anew (about 1.5 s of CPU on a 2-core box, per process); a child
forked by a forkserver that imported it once starts in milliseconds. The forkserver is one per
program and reads its preload list when it starts: the first caller's list is the one used,
and a later caller's modules are imported by its children as usual (slower, never wrong).

A forked child is a copy of the forkserver, not of its caller: ``sys.path`` and the main
module are sent with each child (as with spawn), but the environment and the standard output
and error are the forkserver's, as they were when it started. :class:`Inherited` carries the
caller's at the call, and the child takes them first thing (:meth:`Inherited.adopt`), before
it unpickles anything that imports the caller's modules. One thing comes earlier: the main
script (as with spawn, a child imports it first, so it must guard its start with
``if __name__ == "__main__"``); what its module level reads from the environment is the
forkserver's. Platforms without a forkserver spawn.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterable
from multiprocessing.reduction import DupFd
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # ForkServerContext does not exist on Windows
    from multiprocessing.context import ForkServerContext, SpawnContext

__all__ = ["TORCH", "Inherited", "preloaded_context"]

TORCH = ("torch", "torch.distributed")
"""What every caller preloads; callers add their own stalwart package."""

_STDIO = (1, 2)


def preloaded_context(preload: Iterable[str]) -> ForkServerContext | SpawnContext:
    """The forkserver context, its server to import ``preload`` when it starts (else spawn)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx


class Inherited:
    """The caller's environment, standard output and standard error, for a child to adopt.

    Make one per start, pass it in the process's arguments: its file descriptors are handed
    to the child while the process starts (``multiprocessing.reduction.DupFd``), so a child
    writes where its caller's output goes now (a test's capture, say), not where the
    forkserver's went when it started.
    """

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        self.environ = dict(os.environ) if environ is None else environ
        self.fds: list[Any] = []

    def __reduce__(self) -> tuple[Any, ...]:
        fds: list[Any] = []
        for fd in _STDIO:
            try:
                os.fstat(fd)
            except OSError:  # closed in the caller: the child keeps its own
                fds.append(None)
            else:
                fds.append(DupFd(fd))  # only while a process starts (the spawning Popen's)
        return (_rebuilt, (self.environ, fds))

    def adopt(self) -> None:
        """In the child: take the caller's environment and output, before anything else.

        Torch's thread count was fixed when the forkserver imported torch; an
        ``OMP_NUM_THREADS`` the caller sets is applied here, as a spawned child would have it.
        """
        os.environ.clear()
        os.environ.update(self.environ)
        for target, handle in zip(_STDIO, self.fds, strict=True):
            if handle is not None:
                fd = handle.detach()
                os.dup2(fd, target)
                os.close(fd)
        threads = self.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            import torch

            torch.set_num_threads(int(threads))


def _rebuilt(environ: dict[str, str], fds: list[Any]) -> Inherited:
    out = Inherited(environ)
    out.fds = fds
    return out
