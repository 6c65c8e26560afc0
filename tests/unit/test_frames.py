"""``to_pandas()`` / ``to_polars()`` on every tabular result hold what its JSON holds.

pandas and polars are optional: a missing one is a ``MissingDependencyError`` naming the
``frames`` extra.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import numpy as np
import pytest

from stalwart.errors import MissingDependencyError
from tests.unit import result_samples as samples

pd = pytest.importorskip("pandas")
pl = pytest.importorskip("polars")

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    diff, inspection, ck = samples.checkpoint_results(tmp_path_factory.mktemp("ck"))
    ck.close()
    return {
        "diagnosis": samples.diagnosis(),
        "kpi": samples.kpi_diagnosis(),
        "campaign": samples.campaign()[2],
        "pvf": samples.pvf_report(),
        "protection": samples.protection_results(),
        "diff": diff,
        "inspection": inspection,
    }


def _same(a: Any, b: Any) -> bool:
    """Equal, NaN equal to NaN and to None (JSON has no NaN), inf equal to 'inf'."""
    if isinstance(a, str) and isinstance(b, float):
        a, b = b, a
    if isinstance(a, float) and isinstance(b, str):
        return str(a) == b or (math.isinf(a) and b in ("inf", "-inf"))
    if a is None or b is None:
        return (a is None or (isinstance(a, float) and math.isnan(a))) and (
            b is None or (isinstance(b, float) and math.isnan(b))
        )
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12) or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple, np.ndarray)):
        return list(a) == list(b)
    return bool(a == b)


def _records(frame: Any) -> list[dict[str, Any]]:
    if isinstance(frame, pl.DataFrame):
        return frame.to_dicts()
    return [
        {
            k: (None if v is pd.NA else v.tolist() if isinstance(v, np.ndarray) else v)
            for k, v in r.items()
        }
        for r in frame.to_dict(orient="records")
    ]


def _check(frame: Any, expected: list[dict[str, Any]]) -> None:
    rows = _records(frame)
    assert len(rows) == len(expected) > 0
    for got, want in zip(rows, expected, strict=True):
        for k, v in want.items():
            assert _same(got[k], v), (k, got[k], v)


@pytest.mark.parametrize("kind", ["diagnosis", "kpi"])
@pytest.mark.parametrize("flavour", ["pandas", "polars"])
def test_diagnosis_frames_match_the_json(kind: str, flavour: str, results: dict[str, Any]) -> None:
    d = results[kind]
    frame = d.to_pandas() if flavour == "pandas" else d.to_polars()
    fields = ("failures", "rows", "support", "lift", "lift_low", "lift_high", "explained")
    expected = []
    for i, f in enumerate(d.to_dict()["findings"], 1):
        row = {k: f[k] for k in fields} | {"rank": i, "subsumed": len(f["subsumed"])}
        row |= f["items"]  # one column per attribute a finding names
        expected.append(row)
    _check(frame, expected)
    assert _records(frame)[0]["finding"] == d.findings[0].label()


@pytest.mark.parametrize("flavour", ["pandas", "polars"])
def test_pvf_frames_match_the_json(flavour: str, results: dict[str, Any]) -> None:
    report = results["pvf"]
    frame = report.to_pandas() if flavour == "pandas" else report.to_polars()
    _check(frame, report.to_dict()["groups"])
    assert sorted(set(_records(frame)[i]["criterion"] for i in range(len(frame)))) == sorted(
        report.criteria
    )


@pytest.mark.parametrize("flavour", ["pandas", "polars"])
def test_campaign_frames_match_the_trial_table(flavour: str, results: dict[str, Any]) -> None:
    res = results["campaign"]
    frame = res.to_pandas() if flavour == "pandas" else res.to_polars()
    _check(frame, res.table().to_pylist())
    for c in res.criteria:
        assert list(frame[f"failed_{c}"]) == res.failed[c].tolist()


@pytest.mark.parametrize("flavour", ["pandas", "polars"])
def test_protection_frames_match_the_results(flavour: str, results: dict[str, Any]) -> None:
    res = results["protection"]
    frame = res.to_pandas() if flavour == "pandas" else res.to_polars()
    expected = []
    for r in res:
        row = dataclasses.asdict(r)
        cost = row.pop("cost")
        expected.append(row | {f"cost_{k}": v for k, v in cost.items()})
    _check(frame, expected)


@pytest.mark.parametrize("flavour", ["pandas", "polars"])
def test_diff_frames_match_the_json(flavour: str, results: dict[str, Any]) -> None:
    diff = results["diff"]
    tensors = diff.to_pandas() if flavour == "pandas" else diff.to_polars()
    _check(tensors, diff.to_json()["tensors"])
    values = diff.to_pandas("values") if flavour == "pandas" else diff.to_polars("values")
    _check(values, diff.to_json()["values"])
    assert samples.HOSTILE in list(tensors["name"])


def test_diff_frames_keep_nonfinite_floats() -> None:
    from stalwart.checkpoint.tools.diff import DiffReport, TensorDiff

    rows = [TensorDiff("z", "changed", "float32", (2,), 2, changed_elements=1, relative=math.inf)]
    frame = DiffReport(1, 2, rows).to_pandas()
    assert (
        frame["relative"][0] == math.inf
        and DiffReport(1, 2, rows).to_json()["tensors"][0]["relative"] == "inf"
    )


@pytest.mark.parametrize("flavour", ["pandas", "polars"])
def test_inspection_frames_match_the_json(flavour: str, results: dict[str, Any]) -> None:
    ins = results["inspection"]
    frame = ins.to_pandas() if flavour == "pandas" else ins.to_polars()
    _check(frame, ins.to_json()["tensors"])


@pytest.mark.parametrize("module", ["pandas", "polars"])
def test_a_missing_frame_library_names_the_extra(
    module: str, results: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    for kind in results:
        with pytest.raises(MissingDependencyError, match=r"stalwart\[frames\]"):
            getattr(results[kind], f"to_{module}")()
