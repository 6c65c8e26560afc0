"""Helpers for testing code built on stalwart: fault-injecting wrappers and fakes."""

from stalwart.testing.flaky import FlakyStorage

__all__ = ["FlakyStorage"]
