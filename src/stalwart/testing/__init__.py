"""Helpers for testing code built on stalwart: fault-injecting wrappers, fakes, and gloo worlds."""

from stalwart.testing.chaos import (
    BitFlip,
    Delay,
    Drop,
    InjectedFault,
    Kill,
    KillSchedule,
    LoseCoordinator,
    Raise,
)
from stalwart.testing.flaky import FlakyStorage
from stalwart.testing.fleet import simulate_fleet
from stalwart.testing.run_ranks import run_ranks

__all__ = [
    "BitFlip",
    "Delay",
    "Drop",
    "FlakyStorage",
    "InjectedFault",
    "Kill",
    "KillSchedule",
    "LoseCoordinator",
    "Raise",
    "run_ranks",
    "simulate_fleet",
]
