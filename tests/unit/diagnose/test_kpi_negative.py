"""A KPI whose values are negative (net margin, balance) is localized like its positive twin:
the deviation score keeps the sign of f - v, the ripple fit scales negative sums, and the
reference mass is the expectation's magnitude, not 0."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from stalwart.diagnose import localize
from stalwart.diagnose.kpi_scores import deviation


def _cube() -> pd.DataFrame:
    # region a drops by 50 per leaf, every other leaf moves by noise only
    rng = np.random.default_rng(0)
    rows = []
    for r in "abcd":
        for dv in "xyz":
            for s in "pq":
                a = 50.0 if r == "a" else 100.0 + rng.normal(0, 1)
                rows.append({"region": r, "dev": dv, "site": s, "actual": a, "fc": 100.0})
    return pd.DataFrame(rows)


def _found(data: object) -> list[dict[str, str]]:
    return [f.items for f in localize(data, actual="actual", expected="fc").findings]


def test_deviation_keeps_its_sign_for_negative_values() -> None:
    real, predict = np.array([-150.0, 50.0, -1.0]), np.array([-100.0, 100.0, 1.0])
    assert deviation(real, predict).tolist() == pytest.approx([0.4, 2 / 3, 2.0])
    assert (np.sign(deviation(real, predict)) == np.sign(predict - real)).all()


def test_shifted_negative_kpi_finds_the_same_cause_in_a_frame() -> None:
    pos = _cube()
    neg = pos.assign(actual=pos.actual - 200, fc=pos.fc - 200)
    assert _found(pos) == [{"region": "a"}]
    assert _found(neg) == _found(pos)
    assert localize(neg, actual="actual", expected="fc").confidence > 0.5


def test_shifted_negative_kpi_finds_the_same_cause_through_duckdb(tmp_path: Path) -> None:
    pos = _cube()
    neg = pos.assign(actual=pos.actual - 200, fc=pos.fc - 200)
    pos.to_csv(tmp_path / "pos.csv", index=False)
    neg.to_csv(tmp_path / "neg.csv", index=False)
    assert _found(str(tmp_path / "pos.csv")) == [{"region": "a"}]
    assert _found(str(tmp_path / "neg.csv")) == [{"region": "a"}]


def test_negative_expectations_keep_their_weight_when_values_are_folded(tmp_path: Path) -> None:
    # 80 hosts (over max_values): a value is kept when its expected mass is common, so a
    # negative expectation must weigh its magnitude, not 0 ("every value rare")
    rng = np.random.default_rng(0)
    rows = [
        {"host": f"h{h}", "region": r, "actual": 50.0 if r == "a" else 100 + rng.normal(0, 1)}
        for h in range(80)
        for r in "abcd"
    ]
    pos = pd.DataFrame(rows).assign(fc=100.0)
    neg = pos.assign(actual=pos.actual - 200, fc=pos.fc - 200)
    pos.to_csv(tmp_path / "pos.csv", index=False)
    neg.to_csv(tmp_path / "neg.csv", index=False)
    a, b = (
        localize(str(tmp_path / f), actual="actual", expected="fc") for f in ("pos.csv", "neg.csv")
    )
    assert b.cleaning == a.cleaning
    assert "kept 80 values" in b.cleaning[0]["detail"]
    assert [f.items for f in b.findings] == [f.items for f in a.findings] == [{"region": "a"}]
