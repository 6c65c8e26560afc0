"""Save and exit when the scheduler says the job is about to be preempted (SIGTERM, SIGUSR1).

    with stalwart.PreemptionGuard() as preemption:          # SIGTERM and SIGUSR1 by default
        for step in range(start, total_steps):
            train_one_step()
            ckpt.save_async(step, state)                      # as usual (optional)
            preemption.save_and_exit_if_requested(ckpt, step, state)

Why a flag and not a save from the signal handler: Python runs a handler in the main thread
between two bytecodes, possibly in the middle of ``optimizer.step()`` (the state is half
updated) or inside a save that holds the checkpointer's locks (a save from the handler
would deadlock or interleave with it). The handler therefore only records the signal; the
training loop acts at its next step boundary, where the state is consistent: it waits for
the asynchronous saves in flight, saves the current step synchronously (durable and
committed when it returns), and exits.

Under ``torch.distributed`` one rank may get the signal a step before another; the check is
then collective (every rank must call it at the same point, and all stop at the same step).
Sending the same signal a second time restores the previous handler and re-delivers it, so
an operator can still kill a job whose final save hangs. A repeat within ``repeat_after_s``
of the first is the same request delivered twice, not a second one: a terminal's Ctrl-C or
a scheduler that signals every process of the job reaches a worker directly, and its
launcher (``stalwart run``, torchrun) forwards the signal again a moment later.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType
from typing import Any

from stalwart.checkpoint.collective import resolve_group
from stalwart.checkpoint.options import env_signals
from stalwart.errors import ConfigError

__all__ = ["DEFAULT_SIGNALS", "PreemptionGuard"]

log = logging.getLogger(__name__)

DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionGuard:
    """A context manager that turns preemption signals into a flag the training loop checks.

    Args:
        signals: the signals that mean "save and stop"; default ``STALWART_PREEMPTION_SIGNALS``
            (e.g. ``TERM,USR1``), else SIGTERM and SIGUSR1.
        exit_code: the status :meth:`save_and_exit_if_requested` exits with; default
            ``128 + signal`` (what a shell reports for a process the signal ended), so that a
            job controller does not mistake a preempted run for a finished one.
        process_group: the ranks that stop together (default: the default group, if any).
        repeat_after_s: a repeat of the received signal kills the process (the previous
            handler) only this many seconds or more after the first; sooner, it is the same
            request delivered twice (the process group's and the launcher's copy).
    """

    def __init__(
        self,
        signals: tuple[int, ...] | None = None,
        *,
        exit_code: int | None = None,
        process_group: Any = None,
        repeat_after_s: float = 2.0,
    ) -> None:
        chosen = env_signals(DEFAULT_SIGNALS) if signals is None else signals
        self.signals = tuple(signal.Signals(s) for s in chosen)
        if not self.signals:
            raise ConfigError("PreemptionGuard needs at least one signal, e.g. (signal.SIGTERM,)")
        self.exit_code = exit_code
        self.received: signal.Signals | None = None
        self.repeat_after_s = repeat_after_s
        self._received_at = 0.0
        self._process_group = process_group
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def requested(self) -> bool:
        """True once one of the signals arrived in this process."""
        return self.received is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.received == sig:
            if time.monotonic() - self._received_at < self.repeat_after_s:
                return  # the same request again (the launcher forwarded what we got)
            # asked twice: stop waiting for the loop, die the usual way
            signal.signal(sig, self._previous.get(sig, signal.SIG_DFL))
            signal.raise_signal(sig)
            return
        self.received = sig  # only a flag: the loop saves at a consistent step boundary
        self._received_at = time.monotonic()

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError(
                "PreemptionGuard must be entered in the main thread (Python delivers signals "
                "there only); enter it around the training loop of the main thread"
            )
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def should_stop(self) -> bool:
        """Whether to stop now: this process got a signal, or (collectively) any rank did.

        With more than one rank, every rank must call this at the same step.
        """
        g = resolve_group(self._process_group)
        if g.world == 1:
            return self.requested
        return g.count(self.requested) > 0  # one number a step, not an object gather

    def save_and_exit_if_requested(
        self, ckpt: Any, step: int, state: Any, *, metadata: dict[str, str] | None = None
    ) -> None:
        """If :meth:`should_stop`, flush saves in flight, save ``step`` and exit; else return.

        Waits for every asynchronous save of ``ckpt`` (a :class:`Checkpointer`), saves
        ``state`` as ``step`` unless that step was just committed, closes ``ckpt`` and
        raises ``SystemExit(exit_code)``. The manifest's metadata records the signal under
        ``stalwart.preempted``.
        """
        if not self.should_stop():
            return
        name = self.received.name if self.received is not None else "peer"
        log.warning("%s received: saving step %s, then exiting", name, step)
        ckpt.wait()  # the in-flight async saves commit first (saves commit in call order)
        if ckpt.latest_step() != step:
            ckpt.save(step, state, metadata={**(metadata or {}), "stalwart.preempted": name})
        ckpt.close()
        sig = self.received or self.signals[0]
        raise SystemExit(128 + int(sig) if self.exit_code is None else self.exit_code)
