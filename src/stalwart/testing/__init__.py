"""Helpers for testing code built on stalwart: fault-injecting wrappers, fakes, and gloo worlds."""

from stalwart.testing.chaos import Kill, KillSchedule
from stalwart.testing.flaky import FlakyStorage
from stalwart.testing.run_ranks import run_ranks

__all__ = ["FlakyStorage", "Kill", "KillSchedule", "run_ranks"]
