"""Notebook renderings: every result type renders a small, escaped HTML fragment.

Hostile names (a tensor, column or module called ``<script>…``) must reach the page escaped,
and a result with thousands of rows must render its top rows and an "N more" line, not all.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from stalwart.checkpoint.tools.diff import DiffReport, TensorDiff, ValueDiff
from stalwart.checkpoint.tools.inspection import Inspection, TensorRow
from stalwart.diagnose import Diagnosis
from stalwart.protect.evaluate import ProtectionResults
from stalwart.vulnerability import FaultList
from stalwart.vulnerability.estimates import GroupEstimate, PVFReport
from tests.unit import result_samples as samples
from tests.unit.result_samples import HOSTILE

pytestmark = pytest.mark.timeout(180)

MAX_HTML = 40_000
"""Characters a rendering may take, whatever the size of the result."""


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    diff, inspection, ck = samples.checkpoint_results(tmp_path_factory.mktemp("ck"))
    out = {
        "diagnosis": samples.diagnosis(),
        "kpi": samples.kpi_diagnosis(),
        "campaign": samples.campaign()[2],
        "pvf": samples.pvf_report(),
        "protection": samples.protection_results(),
        "diff": diff,
        "inspection": inspection,
        "manifest": ck.manifest(2),
    }
    ck.close()
    return out


def _assert_safe(page: str) -> None:
    assert "<script" not in page.lower()  # no script of ours, none of the user's
    assert "&lt;script&gt;" in page  # the hostile name is there, escaped
    assert "onerror=1>" not in page
    assert page.count("<table") == page.count("</table>") >= 1


@pytest.mark.parametrize(
    ("kind", "title"),
    [
        ("diagnosis", "Diagnosis"),
        ("kpi", "kpi-additive"),
        ("campaign", "Campaign result"),
        ("pvf", "PVF report"),
        ("protection", "Protection results"),
        ("diff", "Checkpoint diff"),
        ("inspection", "Checkpoint step 2"),
        ("manifest", "Checkpoint step 2"),
    ],
)
def test_each_result_renders_escaped(kind: str, title: str, results: dict[str, Any]) -> None:
    page = results[kind]._repr_html_()
    assert title in page
    if kind == "protection":
        assert "sbp" in page  # protection names are ours; the model's names are not shown
        assert "<script" not in page.lower()
    else:
        _assert_safe(page)
    assert len(page) < MAX_HTML
    if kind == "campaign":  # 60 trials: 20 shown, failing first
        assert "40 more trial(s) (shown: failing trials first)" in page
        assert page.index("<td>True</td>") < page.index("<td>False</td>")
    else:
        assert "more" not in page  # small results show every row


def test_manifest_renders_like_its_inspection(results: dict[str, Any]) -> None:
    assert results["manifest"]._repr_html_() == results["inspection"]._repr_html_()


def test_diff_shows_values_and_statuses(results: dict[str, Any]) -> None:
    page = results["diff"]._repr_html_()
    assert "1 changed, 1 added, 1 removed" in page
    assert "&lt;img src=x onerror=1&gt;" in page  # a non-tensor value, escaped


def _more(page: str) -> int:
    found = re.search(r"… (\d+) more", page)
    assert found, page[-300:]
    return int(found.group(1))


def test_large_diagnosis_is_bounded(results: dict[str, Any]) -> None:
    d: Diagnosis = results["diagnosis"]
    f = d.findings[0]
    many = [dataclasses.replace(f, items={HOSTILE * 50: f"<b>{i}</b>" * 50}) for i in range(500)]
    page = dataclasses.replace(d, findings=many)._repr_html_()
    _assert_safe(page)
    assert len(page) < MAX_HTML and _more(page) == 480


def test_large_pvf_report_is_bounded_and_shows_the_worst_groups() -> None:
    rows = [
        GroupEstimate("top1", f"{HOSTILE}{i}" * 20, 10, i % 10, (i % 10) / 10, 0, 1, 0, 0, 0, 1)
        for i in range(2000)
    ]
    page = PVFReport(rows, "tensor", ["top1"], 0.95, "wilson")._repr_html_()
    _assert_safe(page)
    assert len(page) < MAX_HTML and _more(page) == 1980
    assert "highest PVF first" in page and "<td>0.9</td>" in page


def test_large_campaign_is_bounded(results: dict[str, Any]) -> None:
    res = results["campaign"]
    for _ in range(5):  # 60 -> 1920 trials
        res = res.extend(res, FaultList(res.faults.faults * 2, 0, "", res.faults.population))
    assert len(res) == 1920
    page = res._repr_html_()
    _assert_safe(page)
    assert len(page) < MAX_HTML and _more(page) == 1900


def test_large_protection_list_is_bounded(results: dict[str, Any]) -> None:
    r = results["protection"][0]
    many = ProtectionResults(dataclasses.replace(r, name=HOSTILE * 100) for _ in range(300))
    page = many._repr_html_()
    _assert_safe(page)
    assert len(page) < MAX_HTML and _more(page) == 280


def test_large_diff_and_inspection_are_bounded() -> None:
    long = HOSTILE * 500  # 14k characters: cut in the cell
    tensors = [
        TensorDiff(f"{long}{i}", "changed", "float32", (4,), 4, changed_elements=1, relative=i)
        for i in range(5000)
    ]
    values = [ValueDiff(f"{long}{i}", "changed", long, long) for i in range(300)]
    page = DiffReport(1, 2, tensors, values)._repr_html_()
    _assert_safe(page)
    assert len(page) < MAX_HTML
    assert "4980 more tensor(s)" in page and "280 more value(s)" in page
    assert "<td>5e+03</td>" in page and "<td>0</td>" not in page  # the largest changes first
    rows = [TensorRow(f"{long}{i}", "float32", (i,), 1, 4 * i, 1) for i in range(5000)]
    meta = {f"{HOSTILE}{i}": long for i in range(100)}
    page = Inspection(3, 1, 0.0, meta, rows, {"tensors": 5000})._repr_html_()
    _assert_safe(page)
    assert len(page) < MAX_HTML
    assert "4980 more tensor(s)" in page and "80 more metadata entries" in page


def test_empty_results_render(tmp_path: Path) -> None:
    assert "identical" in DiffReport(1, 1)._repr_html_()
    assert "0 protection(s)" in ProtectionResults()._repr_html_()
