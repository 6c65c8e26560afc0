"""A launcher stops on SIGTERM or SIGINT by passing it on: its workers save, then it exits.

A container runtime or job controller signals only a node's first process, its launcher. The
launcher records the signal (:func:`run_with_signals`); its loop then forwards it to the
node's live workers, so that their :class:`~stalwart.PreemptionGuard` saves, and waits up to
:data:`STOP_GRACE_S` for them to exit, replacing none (:func:`drain`). A second signal
during the wait kills them at once. The launcher exits with ``128 + signal``. The host's
:class:`~stalwart.elastic.supervisor.Supervisor` and an agent node's loop
(:mod:`stalwart.elastic.nodes`) stop alike.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

__all__ = ["STOP_GRACE_S", "drain", "run_with_signals"]

log = logging.getLogger(__name__)

STOP_GRACE_S = 30.0
"""How long the launcher's workers have to save and exit after it forwarded SIGTERM or SIGINT
to them (torchrun's and Kubernetes' default grace), seconds."""

_POLL_S = 0.02

T = TypeVar("T")


def run_with_signals(
    run: Callable[[], T],
    stop_signals: list[int],
    rehost: Callable[[], None] | None = None,
) -> T:
    """``run()`` with the launcher's signals (main thread only; elsewhere plain ``run()``).

    SIGTERM and SIGINT are appended to ``stop_signals``; SIGUSR1 calls ``rehost`` where one is
    given. The handlers only record: the loop in ``run`` acts between two of its rounds.
    """
    if threading.current_thread() is not threading.main_thread():
        return run()

    def stop(signum: int, _frame: object) -> None:
        stop_signals.append(signum)

    handlers: dict[signal.Signals, Any] = {signal.SIGTERM: stop, signal.SIGINT: stop}
    if rehost is not None:
        handlers[signal.SIGUSR1] = lambda _signum, _frame: rehost()
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    try:
        return run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def drain(procs: Iterable[Any], stop_signals: list[int]) -> int:
    """Forward the first of ``stop_signals`` to the live ``procs`` (``subprocess.Popen``) and
    wait up to :data:`STOP_GRACE_S` for them to exit, reaping none; a second signal kills them
    at once. Returns ``128 + signal``: the launcher's exit code."""
    signum = stop_signals[0]
    running = [p for p in procs if p.poll() is None]
    log.warning("launcher got %s: forwarded to %d worker(s), waiting up to %.0f s for them "
                "to save and exit (signal again to kill them now)",
                signal.Signals(signum).name, len(running), STOP_GRACE_S)  # fmt: skip
    for p in running:
        p.send_signal(signum)
    deadline = time.monotonic() + STOP_GRACE_S
    while any(p.poll() is None for p in running) and time.monotonic() < deadline:
        if len(stop_signals) > 1:
            for p in running:
                p.kill()
            break
        time.sleep(_POLL_S)
    return 128 + signum
