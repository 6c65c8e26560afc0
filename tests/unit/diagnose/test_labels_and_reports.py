"""Bucket labels stay apart however narrow the column, a report renders any value as text, and
a skipped-lines note counts records, not lines."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from stalwart.diagnose import analyze
from stalwart.diagnose.clean import bucket_labels
from stalwart.diagnose.report import render_html


def test_bucket_labels_of_close_edges_are_distinct() -> None:
    edges, labels = bucket_labels([1.0, 1.00002, 1.00004, 1.00006])
    assert len(set(labels)) == len(labels) == len(edges) + 1
    assert labels[1] == "[1, 1.00002)"  # as few digits as keep them apart
    assert bucket_labels([0.5, 2.25])[1] == ["< 0.5", "[0.5, 2.25)", ">= 2.25"]


def test_a_narrow_numeric_column_finds_its_own_bucket() -> None:
    # 500 values 1 + k e-6; failures exactly k in 100..199, one quintile: its buckets used to
    # print alike ("[1, 1)") and be counted together, lift 1.67 instead of 5.
    k = list(range(500))
    table = pa.table(
        {"latency_s": [1 + i * 1e-6 for i in k], "failed": [100 <= i < 200 for i in k]}
    )
    (top, *_) = analyze(table, "failed").findings
    assert top.failures == 100 and top.rows == 100 and round(top.lift, 6) == 5.0


def test_a_value_with_dollar_signs_renders_as_text() -> None:
    values = ["${HOME}_${USER}", "plain"] * 200
    table = pa.table({"tmpl": values, "failed": [v.startswith("$") for v in values]})
    html = render_html(analyze(table, "failed"), title="t")
    assert "${HOME}_${USER}" in html  # the plot drew it (matplotlib read it as math before)


def test_skipped_lines_count_records_not_lines(tmp_path: Path) -> None:
    rows = ["host,msg,status"] + [f'h{i % 3},"line one\nline two",{"fail" if i % 5 else "ok"}'
                                  for i in range(60)]  # fmt: skip
    (tmp_path / "ml.csv").write_text("\n".join(rows) + "\n")
    d = analyze(tmp_path / "ml.csv", "status != 'ok'", skip_bad_lines=True)
    assert d.total_rows == 60 and not [n for n in d.notes if "skipped" in n]


def test_a_json_lines_column_of_mixed_types_reads_as_plain_text(tmp_path: Path) -> None:
    # DuckDB types such a column JSON: values came out as JSON text, '"h3"' with its quotes.
    lines = ['{"host": 0, "failed": false}'] + [
        f'{{"host": "h{i % 4}", "failed": {"true" if i % 4 == 3 else "false"}}}'
        for i in range(1, 200)
    ]
    (tmp_path / "mixed.jsonl").write_text("\n".join(lines) + "\n")
    d = analyze(tmp_path / "mixed.jsonl", "failed")
    assert [f.items for f in d.findings][:1] == [{"host": "h3"}]
