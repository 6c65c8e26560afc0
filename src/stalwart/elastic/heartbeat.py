"""Hang detection that does not depend on gloo's timeout: heartbeats through the coordinator.

Each worker runs a small daemon thread (:class:`Heartbeat`) that adds 1 to
``coord/beat/{wid}`` five times per hang timeout, on a store client of its own. The launcher
(:class:`HeartbeatWatch`) reads the counters and remembers, on its own monotonic clock, when
each one last moved, so the workers' clocks never matter.

A worker whose counter has not moved for the hang timeout is *hung*: SIGSTOP, a stuck host, a
GC pause longer than the timeout (the thread needs the GIL, so a pause that holds it silences
the beats too). The launcher then SIGKILLs it. That is also what gets the survivors out of a
collective they are stuck in with it: gloo cannot abort a pending collective, but the kernel
closes a killed process's sockets, and the survivors' pending all-reduce fails at once on the
closed connection, exactly as after a crash. So no thread is leaked and no group is abandoned
in flight, and the gloo timeout can stay long (it only bounds members that are alive and beating
but never enter the collective).

If the launcher itself was not scheduled for a while (a busy machine), nobody is blamed for the
gap: the watch restarts every worker's silence from the moment it runs again.

When the store fails (its host died), the thread waits for a re-hosted coordinator's address
in ``STALWART_ELASTIC_STORE_FILE`` and beats there; a new watch does not judge a worker until
its first beat on the new store.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Iterable

from torch.distributed import Store, TCPStore

from stalwart.elastic.protocol import WorkerEnv, keys, read_address
from stalwart.elastic.timeouts import BEATS_PER_HANG

__all__ = ["BEATS_PER_TIMEOUT", "Heartbeat", "HeartbeatWatch"]

log = logging.getLogger(__name__)

BEATS_PER_TIMEOUT = BEATS_PER_HANG  # one definition, with the other timeouts


class Heartbeat:
    """A worker's heartbeat thread (daemon); started at construction, stopped by :meth:`stop`.

    Args:
        env: the worker's settings; ``env.hang_s`` <= 0 sends no beats.
    """

    def __init__(self, env: WorkerEnv) -> None:
        self.key = keys.beat(env.worker_id)
        self.interval_s = max(env.hang_s / BEATS_PER_TIMEOUT, 0.02)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._env, self._address = env, (env.host, env.port)
        if env.hang_s <= 0:
            return
        # A store client of its own: the training thread's client is not shared across threads.
        self._store: Store = self._connect(self._address)
        self._store.add(self.key, 1)  # the first beat, before the worker joins anything
        self._thread = threading.Thread(target=self._run, name="stalwart-heartbeat", daemon=True)
        self._thread.start()
        # Joined before the interpreter finalizes: a daemon thread caught inside the store's
        # C++ call when finalization begins is ended by pthread_exit, which aborts the process
        # (SIGABRT) while unwinding C++ frames, turning a clean exit into a crash.
        atexit.register(self.stop)

    def _connect(self, address: tuple[str, int]) -> Store:
        return TCPStore(address[0], address[1], is_master=False, timeout=self._env.timeout,
                        wait_for_workers=False)  # fmt: skip

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._store.add(self.key, 1)
            except RuntimeError as e:  # the coordinator is gone: beat at its successor
                log.warning("heartbeat: the coordinator failed (%s); waiting for a new one", e)
                if not self._follow():
                    return

    def _follow(self) -> bool:
        """Connect to a re-hosted coordinator once its address appears; False when stopped."""
        while not self._stop.wait(self.interval_s):
            address = read_address(self._env.store_file)
            if address is None or address == self._address:
                continue
            try:
                self._store = self._connect(address)
            except RuntimeError:
                continue
            self._address = address
            return True
        return False

    def stop(self) -> None:
        """Stop beating, and wait for the thread to end (it ends after its current beat)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + 5.0)


class HeartbeatWatch:
    """The launcher's view of the workers' heartbeats.

    Args:
        store: the coordinator's store.
        hang_s: silence after which a worker is hung (<= 0: never).
    """

    def __init__(self, store: Store, hang_s: float) -> None:
        self.store = store
        self.hang_s = hang_s
        self._seen: dict[int, tuple[int, float]] = {}  # wid -> (counter, when it last moved)
        self._last_poll = time.monotonic()

    def hung(self, wids: Iterable[int]) -> dict[int, float]:
        """The workers among ``wids`` silent for longer than the hang timeout, with the silence.

        Workers that never beat yet (still starting) are not judged.
        """
        if self.hang_s <= 0:
            return {}
        now = time.monotonic()
        if now - self._last_poll > self.hang_s / 2:  # we were not scheduled: blame nobody
            self._seen = {w: (n, now) for w, (n, _) in self._seen.items()}
        self._last_poll = now
        out: dict[int, float] = {}
        for wid in wids:
            count = int(self.store.add(keys.beat(wid), 0))
            if count == 0:
                continue
            last, since = self._seen.get(wid, (-1, now))
            if count != last:
                self._seen[wid] = (count, now)
            elif now - since > self.hang_s:
                out[wid] = now - since
        return out

    def forget(self, wid: int) -> None:
        """Stop judging ``wid`` (it was killed or exited)."""
        self._seen.pop(wid, None)
