"""Small generated logs shared by the diagnose tests."""

from __future__ import annotations

import pytest

from stalwart.diagnose.synth import SyntheticLog, make_failure_log


@pytest.fixture(scope="session")
def log2() -> SyntheticLog:
    """20k rows, 8 columns, a 1-item and a 2-item cause."""
    return make_failure_log(
        20_000, columns=8, causes=2, depth=(1, 2), seed=3, coverage=(0.02, 0.08)
    )
