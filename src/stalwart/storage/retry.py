"""Retrying a storage call on transient failures, with exponential backoff and jitter.

Remote stores fail in two ways: *transiently* (throttling, timeouts, connection resets, a 503)
where the same call will likely succeed a moment later, and *permanently* (no such key, access
denied) where retrying only delays the error. :func:`is_transient` draws that line once, for
builtin errors, our :class:`~stalwart.errors.TransientStorageError`, and botocore / aiohttp
errors recognised by duck typing (neither library is imported here). :func:`call_with_retry`
runs a call under a :class:`RetryPolicy` and turns exhaustion into a ``TransientStorageError``.
"""

from __future__ import annotations

import errno
import logging
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from stalwart.errors import ConfigError, StalwartError, TransientStorageError

__all__ = ["RetryPolicy", "call_with_retry", "error_code", "is_transient"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# S3 / GCS / Azure error codes (and HTTP statuses as strings) that mean "try again later".
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "TooManyRequestsException",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "OperationAborted",
        "429",
        "500",
        "502",
        "503",
        "504",
    }
)
_TRANSIENT_HTTP_STATUSES = frozenset({429, 500, 502, 503, 504})
_TRANSIENT_ERRNOS = frozenset(
    {errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED, errno.EPIPE}
)
# Connection-level exception classes of botocore and aiohttp, matched by name so that neither
# library has to be importable (their own ConnectionError does not derive from the builtin).
_TRANSIENT_CLASS_NAMES = frozenset(
    {
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ResponseStreamingError",
        "IncompleteReadError",
        "ClientConnectionError",
        "ClientPayloadError",
        "ServerDisconnectedError",
        "ServerTimeoutError",
    }
)


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How often and how patiently to retry a transient storage failure.

    The wait before retry ``n`` (1-based) is ``initial_backoff_s * multiplier ** (n - 1)``,
    capped at ``max_backoff_s``, then scaled by a random factor in ``[0.5, 1.0]`` so that
    many ranks throttled at once do not retry in lockstep.
    """

    attempts: int = 5
    """Total tries, including the first; 1 means never retry."""
    initial_backoff_s: float = 0.05
    """Wait before the first retry, in seconds."""
    max_backoff_s: float = 2.0
    """Upper bound of any single wait, in seconds."""
    multiplier: float = 2.0
    """Growth factor of the wait between consecutive retries (at least 1)."""

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or self.attempts < 1:
            raise ConfigError(
                f"RetryPolicy.attempts must be an integer >= 1, got {self.attempts!r}"
            )
        if self.initial_backoff_s < 0:
            raise ConfigError(
                f"RetryPolicy.initial_backoff_s must be >= 0, got {self.initial_backoff_s!r}"
            )
        if self.max_backoff_s < self.initial_backoff_s:
            raise ConfigError(
                f"RetryPolicy.max_backoff_s ({self.max_backoff_s!r}) must be >= "
                f"initial_backoff_s ({self.initial_backoff_s!r})"
            )
        if self.multiplier < 1:
            raise ConfigError(f"RetryPolicy.multiplier must be >= 1, got {self.multiplier!r}")

    def backoff_s(self, retry: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (1-based), jitter included."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (retry - 1))
        return base * (0.5 + 0.5 * (rng or random).random())


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes / contexts, outermost first, without cycles."""
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and not any(cur is s for s in seen):
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def error_code(exc: BaseException) -> str | None:
    """The service error code (``"SlowDown"``, ``"NoSuchBucket"``, ...) in ``exc``'s chain.

    Reads the ``response`` dict botocore attaches to a ``ClientError``; s3fs keeps that error
    as the ``__cause__`` of the builtin it raises. Returns ``None`` when there is none.
    """
    for e in _chain(exc):
        response: Any = getattr(e, "response", None)
        if isinstance(response, dict):
            code = (response.get("Error") or {}).get("Code")
            if code:
                return str(code)
    return None


def _http_status(exc: BaseException) -> int | None:
    for e in _chain(exc):
        response: Any = getattr(e, "response", None)
        if isinstance(response, dict):
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if isinstance(status, int):
                return status
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the call that raised ``exc`` may succeed.

    True for :class:`TransientStorageError`, builtin ``ConnectionError`` / ``TimeoutError``,
    ``OSError`` with a connection errno, throttling / 5xx service codes anywhere in the cause
    chain, and botocore / aiohttp connection errors. Any other stalwart error is permanent.
    """
    if isinstance(exc, TransientStorageError):
        return True
    if isinstance(exc, StalwartError):
        return False
    code = error_code(exc)
    if code is not None:
        return code in _TRANSIENT_CODES
    if _http_status(exc) in _TRANSIENT_HTTP_STATUSES:
        return True
    # Before Python 3.11 asyncio had its own TimeoutError; if asyncio is not loaded, none exists.
    asyncio = sys.modules.get("asyncio")
    timeouts = (TimeoutError, asyncio.TimeoutError) if asyncio is not None else (TimeoutError,)
    for e in _chain(exc):
        if isinstance(e, (ConnectionError, *timeouts)):
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
        if any(cls.__name__ in _TRANSIENT_CLASS_NAMES for cls in type(e).__mro__):
            return True
    return False


def call_with_retry(
    fn: Callable[[], T],
    *,
    policy: RetryPolicy,
    what: str,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call ``fn()``; retry transient failures under ``policy``; return its result.

    Args:
        fn: the operation, without arguments (use a closure or ``functools.partial``).
        policy: attempts and backoff.
        what: a short description for logs and errors, like ``"write s3://b/k"``.
        sleep: how to wait (tests pass a fake to run instantly).

    Raises:
        TransientStorageError: every attempt failed transiently; chained from the last error.
        Exception: a permanent error from ``fn``, unchanged, at its first occurrence.
    """
    for attempt in range(1, policy.attempts + 1):
        try:
            return fn()
        except Exception as e:
            if not is_transient(e):
                raise
            if attempt == policy.attempts:
                raise TransientStorageError(
                    f"{what} failed after {policy.attempts} attempts with transient errors; "
                    f"last error: {type(e).__name__}: {e}. The store may be throttling or "
                    "unreachable: retry later or raise RetryPolicy.attempts"
                ) from e
            delay = policy.backoff_s(attempt)
            logger.warning(
                "%s failed (attempt %d of %d, %s: %s); retrying in %.3f s",
                what,
                attempt,
                policy.attempts,
                type(e).__name__,
                e,
                delay,
            )
            sleep(delay)
    raise AssertionError("unreachable: the loop returns or raises")  # pragma: no cover
