"""How stalwart starts the Python processes it runs itself: forked by a preloaded forkserver.

``stalwart.testing.run_ranks`` (gloo test worlds) and the PVF campaign's torch back-end
(``scale.run_sharded(..., backend="torch")``) start processes that each need torch. A spawned
interpreter imports torch anew (about 1.5 s of CPU on a 2-core box, per process); a child
forked by a forkserver that imported it once starts in milliseconds. The forkserver is one per
program and reads its preload list when it starts: the first caller's list is the one used,
and a later caller's modules are imported by its children as usual (slower, never wrong).

What a forked child gets is the forkserver's state, not the caller's: ``sys.path`` and the
main module are sent with each child (as with spawn), the caller's ``os.environ`` is not, so
callers pass it and set it first thing in the child. Platforms without a forkserver spawn.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # ForkServerContext does not exist on Windows
    from multiprocessing.context import ForkServerContext, SpawnContext

__all__ = ["TORCH", "preloaded_context"]

TORCH = ("torch", "torch.distributed")
"""What every caller preloads; callers add their own stalwart package."""


def preloaded_context(preload: Iterable[str]) -> ForkServerContext | SpawnContext:
    """The forkserver context, its server to import ``preload`` when it starts (else spawn)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx
