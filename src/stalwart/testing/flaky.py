"""``FlakyStorage``: a wrapper that makes any store fail on a schedule, for fault tests.

Faults come from a wrapper, not from patching library internals: a test wraps a real store and
says which operations fail, how often and with what error — a throttled remote
(``TransientStorageError``), a full disk (``StorageFullError`` on writes under ``packs/``), a
read-only mount (``StoragePermissionError``). Everything that is not failed is delegated.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Callable, Iterable

from stalwart.errors import ConfigError, TransientStorageError
from stalwart.storage.base import Buffer, ObjectInfo, ReadsLeaveHost, Storage

__all__ = ["OPERATIONS", "FlakyStorage"]

OPERATIONS = ("write", "read_into", "read", "delete", "list")
"""Operation names passed to ``fail_on`` and counted in ``calls``; ``list`` gets the prefix."""


class FlakyStorage:
    """Wrap ``inner`` and raise injected errors on chosen calls.

    A call fails when any rule fires: it is the ``fail_every``-th call (counting every
    operation), ``fail_on(op, key)`` returns true, or a seeded coin with ``fail_probability``
    comes up. Failing calls never reach ``inner``, so a failed write leaves nothing behind.

    Args:
        inner: the store to delegate to.
        fail_every: fail every n-th call (n >= 1); ``None`` for never.
        fail_on: predicate over ``(operation, key)``; see :data:`OPERATIONS`.
        error: the exception class to raise; it is built with one message argument.
        seed: seed of the random generator behind ``fail_probability``.
        fail_probability: chance in ``[0, 1]`` that any call fails.

    Attributes:
        calls: calls per operation, failed ones included.
        failures: injected failures per operation.
    """

    def __init__(
        self,
        inner: Storage,
        *,
        fail_every: int | None = None,
        fail_on: Callable[[str, str], bool] | None = None,
        error: type[Exception] = TransientStorageError,
        seed: int = 0,
        fail_probability: float = 0.0,
    ) -> None:
        if fail_every is not None and fail_every < 1:
            raise ConfigError(f"fail_every must be >= 1 or None, got {fail_every}")
        if not 0.0 <= fail_probability <= 1.0:
            raise ConfigError(f"fail_probability must be in [0, 1], got {fail_probability}")
        self.inner = inner
        self.url = inner.url
        self.fail_every = fail_every
        self.fail_on = fail_on
        self.error = error
        self.fail_probability = fail_probability
        self.calls: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._total = 0

    def __repr__(self) -> str:
        return f"FlakyStorage({self.inner!r})"

    @property
    def reads_leave_host(self) -> bool:
        """What the wrapped store says (``ReadsLeaveHost``); False when it says nothing."""
        return isinstance(self.inner, ReadsLeaveHost) and self.inner.reads_leave_host

    @property
    def injected(self) -> int:
        """Total injected failures over all operations."""
        return sum(self.failures.values())

    def _maybe_fail(self, op: str, key: str) -> None:
        with self._lock:
            self.calls[op] += 1
            self._total += 1
            fail = (
                (self.fail_every is not None and self._total % self.fail_every == 0)
                or (self.fail_on is not None and self.fail_on(op, key))
                or (self.fail_probability > 0 and self._rng.random() < self.fail_probability)
            )
            if fail:
                self.failures[op] += 1
        if fail:
            raise self.error(f"injected failure: {op} {key!r} on {self.url}")

    def write(self, key: str, data: Iterable[Buffer]) -> int:
        """Delegate unless the call is chosen to fail."""
        self._maybe_fail("write", key)
        return self.inner.write(key, data)

    def read_into(self, key: str, offset: int, out: memoryview) -> int:
        """Delegate unless the call is chosen to fail."""
        self._maybe_fail("read_into", key)
        return self.inner.read_into(key, offset, out)

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        """Delegate unless the call is chosen to fail."""
        self._maybe_fail("read", key)
        return self.inner.read(key, offset, length)

    def delete(self, key: str) -> None:
        """Delegate unless the call is chosen to fail."""
        self._maybe_fail("delete", key)
        self.inner.delete(key)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Delegate unless the call is chosen to fail (``fail_on`` sees the prefix as key)."""
        self._maybe_fail("list", prefix)
        return self.inner.list(prefix)

    def close(self) -> None:
        """Close the inner store (never fails)."""
        self.inner.close()
