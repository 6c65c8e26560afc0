"""Helpers for testing code built on stalwart: fault-injecting wrappers, fakes, and gloo worlds."""

from stalwart.testing.chaos import Delay, InjectedFault, Kill, KillSchedule, Raise
from stalwart.testing.flaky import FlakyStorage
from stalwart.testing.run_ranks import run_ranks

__all__ = ["Delay", "FlakyStorage", "InjectedFault", "Kill", "KillSchedule", "Raise", "run_ranks"]
