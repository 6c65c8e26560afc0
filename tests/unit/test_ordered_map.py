"""``persist.ordered_map``: order, the in-flight bound, and the first item hashed alone."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from stalwart.checkpoint.durable.persist import ordered_map


class _CountingPool:
    """A pool that records how many submitted tasks were not yet yielded back."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self.pool, self.submitted, self.most_ahead, self.yielded = pool, 0, 0, 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        self.submitted += 1
        self.most_ahead = max(self.most_ahead, self.submitted - self.yielded)
        return self.pool.submit(fn, *args)


@pytest.mark.parametrize("first_alone", [True, False])
@pytest.mark.parametrize("window", [1, 3, 10])
def test_results_in_order_within_the_window(first_alone: bool, window: int) -> None:
    with ThreadPoolExecutor(4) as pool:
        counting = _CountingPool(pool)
        out = []
        for r in ordered_map(counting, lambda x: x * x, range(25), window, first_alone=first_alone):
            counting.yielded += 1
            out.append(r)
    assert out == [x * x for x in range(25)]
    assert counting.most_ahead <= window


@pytest.mark.parametrize("first_alone", [True, False])
def test_the_first_item_runs_alone_when_asked(first_alone: bool) -> None:
    """With ``first_alone`` no other item starts before the first is done (a pack's first
    byte waits for it); without, the next ones start beside it."""
    others_started = threading.Event()
    seen_while_first_ran: list[bool] = []

    def fn(x: int) -> int:
        if x == 0:  # waits for another item to start, or gives up after 0.5 s
            seen_while_first_ran.append(others_started.wait(0.5))
        else:
            others_started.set()
        return x

    with ThreadPoolExecutor(4) as pool:
        assert list(ordered_map(pool, fn, range(8), 6, first_alone=first_alone)) == list(range(8))
    assert seen_while_first_ran == [not first_alone]


def test_an_empty_input_yields_nothing() -> None:
    with ThreadPoolExecutor(2) as pool:
        assert list(ordered_map(pool, lambda x: x, [], 4)) == []
