"""Bad input gives a clear ConfigError or a clear 'nothing found', never a traceback."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from stalwart.diagnose import DiagnoseOptions, analyze, localize
from stalwart.diagnose.options import EngineTuning
from stalwart.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


def _table(n: int = 400, fail_every: int = 10) -> pa.Table:
    return pa.table(
        {
            "rack": [f"r{i % 4}" for i in range(n)],
            "kernel": [f"k{i % 3}" for i in range(n)],
            "outcome": ["fail" if i % fail_every == 0 else "ok" for i in range(n)],
        }
    )


def test_misspelt_label_column_suggests_the_closest_name() -> None:
    with pytest.raises(ConfigError, match=r"no column 'outcme'.*Did you mean 'outcome'"):
        analyze(_table(), "outcme")


def test_misspelt_column_inside_a_predicate_suggests_too() -> None:
    with pytest.raises(ConfigError, match=r"Did you mean 'outcome'"):
        analyze(_table(), "outcme != 'ok'")


def test_text_label_with_unknown_values_asks_for_a_predicate() -> None:
    t = _table().append_column("status", pa.array(["timeout", "ok"] * 200))
    with pytest.raises(ConfigError, match=r"status != 'ok'"):
        analyze(t, "status")


def test_no_failures_is_a_clear_nothing_found() -> None:
    d = analyze(
        _table(fail_every=10**9)
        .drop(["outcome"])
        .append_column("outcome", pa.array([False] * 400)),
        "outcome",
    )
    assert d.findings == [] and "no failures" in d.message


def test_every_row_failing_is_a_clear_nothing_found() -> None:
    d = analyze(_table(fail_every=1), "outcome")
    assert d.findings == [] and "every row is a failure" in d.message


def test_single_attribute_column_still_works() -> None:
    n = 2000
    t = pa.table(
        {
            "rack": [f"r{i % 5}" for i in range(n)],
            "failed": [(i % 5 == 2 and i % 3 != 0) or i % 97 == 0 for i in range(n)],
        }
    )
    d = analyze(t, "failed")
    assert [f.items for f in d.findings] == [{"rack": "r2"}]


def test_only_label_columns_is_an_error() -> None:
    with pytest.raises(ConfigError, match="no attribute columns"):
        analyze(pa.table({"failed": [True, False]}), "failed")


def test_empty_file(tmp_path: Path) -> None:
    (tmp_path / "e.csv").write_bytes(b"")
    with pytest.raises(ConfigError, match="empty"):
        analyze(tmp_path / "e.csv", "failed")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        analyze(tmp_path / "nope.csv", "failed")


def test_non_utf8_text_is_decoded_and_reported(tmp_path: Path) -> None:
    rows = ["site,failed"] + [
        f"{'Zürich' if i % 4 == 0 else 'Genève'},{str(i % 4 == 0 and i % 8 != 4).lower()}"
        for i in range(400)
    ]
    (tmp_path / "l1.csv").write_bytes("\n".join(rows).encode("latin-1"))
    d = analyze(tmp_path / "l1.csv", "failed")
    assert any("Latin-1" in n for n in d.notes)
    assert [f.items for f in d.findings] == [{"site": "Zürich"}]


def test_malformed_csv_line_names_the_line_and_can_be_skipped(tmp_path: Path) -> None:
    rows = ["rack,kernel,failed"] + [
        f"r{i % 4},k{i % 3},{str(i % 4 == 1).lower()}" for i in range(300)
    ]
    rows.insert(50, "r1,k1,true,unexpected,extra")
    (tmp_path / "bad.csv").write_text("\n".join(rows))
    with pytest.raises(ConfigError, match=r"malformed CSV at line 51\b.*skip_bad_lines"):
        analyze(tmp_path / "bad.csv", "failed")
    d = analyze(tmp_path / "bad.csv", "failed", skip_bad_lines=True)
    assert any("skipped 1 malformed" in n for n in d.notes)
    assert [f.items for f in d.findings] == [{"rack": "r1"}]


@pytest.mark.parametrize("delim", [",", ";", "\t"])
def test_a_short_malformed_csv_names_the_line_duckdb_does_not(tmp_path: Path, delim: str) -> None:
    """In a short file DuckDB's sniffer fails without a line number; we find the first row
    whose field count is not the header's."""
    rows = ["host,status,n", "a,ok,1", "b,fail,2", "c,ok,x,extra", "d,fail"]
    (tmp_path / "short.csv").write_text("\n".join(r.replace(",", delim) for r in rows) + "\n")
    with pytest.raises(ConfigError, match=r"at line 4 \(4 fields where the header has 3\)"):
        analyze(tmp_path / "short.csv", "status != 'ok'")


def test_a_numeric_label_of_counts_is_refused_with_the_weight_named() -> None:
    """A label column is boolean, 0/1 or text; counts in it would mark every row failed."""
    t = _table().append_column("n", pa.array([1 + i % 5 for i in range(400)]))
    with pytest.raises(ConfigError, match=r"other than 0 and 1.*weight='n'.*n > 0"):
        analyze(t, "n")
    flags = _table().append_column("bad", pa.array([float(i % 8 == 1) for i in range(400)]))
    d = analyze(flags, "bad")  # 0.0 / 1.0 is a label
    assert d.total_failures == 50 and [f.items for f in d.findings] == [{"rack": "r1"}]


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_a_negative_or_nan_weight_is_refused(bad: float) -> None:
    n = [float(1 + i % 5) for i in range(400)]
    n[7] = bad  # counted as 0 before, in silence
    t = _table().append_column("n", pa.array(n))
    with pytest.raises(ConfigError, match=r"weight column 'n' has 1 negative or NaN value"):
        analyze(t, "outcome", weight="n")
    n[7] = 0.0
    assert analyze(_table().append_column("n", pa.array(n)), "outcome", weight="n").findings


def test_unknown_option_and_bad_values() -> None:
    # Options are the dataclass only: an unknown keyword is Python's TypeError naming it.
    with pytest.raises(TypeError, match="min_suport"):
        analyze(_table(), "outcome", options=DiagnoseOptions(min_suport=0.1))  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="min_support"):
        analyze(_table(), "outcome", min_support=0.1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="kpi_risk"):
        localize(_table(), "a", "b", kpi_risk=0.1)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="max_len"):
        analyze(_table(), "outcome", options=DiagnoseOptions(max_len=0))
    with pytest.raises(TypeError, match="skip_bad_line: the input is read with connection"):
        analyze(_table(), "outcome", skip_bad_line=True)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="rank_by='best'"):
        DiagnoseOptions(rank_by="best")
    with pytest.raises(ConfigError, match=r"EngineTuning.batch_rows=0: expected an integer >= 1"):
        EngineTuning(batch_rows=0)
    with pytest.raises(ConfigError, match="tuning"):
        DiagnoseOptions(tuning={"batch_rows": 10})  # type: ignore[arg-type]


def test_unsupported_data_type() -> None:
    with pytest.raises(ConfigError, match="cannot analyse a int"):
        analyze(42, "failed")


def test_kpi_pairs_must_match() -> None:
    t = pa.table({"a": ["x", "y"], "real": [1.0, 2.0], "pred": [1.0, 1.0], "den": [1.0, 1.0]})
    with pytest.raises(ConfigError, match="both"):
        localize(t, actual=("real", "den"), expected="pred")
    with pytest.raises(ConfigError, match="Did you mean 'real'"):
        localize(t, actual="reel", expected="pred")


def test_kpi_columns_of_text_are_named() -> None:
    # A text column reached DuckDB's cast: "ConversionException: Could not convert string"
    # (exit 3 from the CLI), where --weight said which column and what it must hold.
    t = pa.table({"a": ["x", "y"], "real": [1.0, 2.0], "pred": [1.0, 1.0], "den": [1.0, 1.0]})
    with pytest.raises(ConfigError, match="actual column 'a' is VARCHAR; it must hold numbers"):
        localize(t, actual="a", expected="pred")
    with pytest.raises(ConfigError, match="expected column 'a' is VARCHAR"):
        localize(t, actual=("real", "den"), expected=("a", "den"))


def test_a_pattern_that_matches_no_file_says_so(tmp_path: Path) -> None:
    # DuckDB's "No files found that match the pattern" came out as "malformed CSV ... Fix the
    # line".
    with pytest.raises(ConfigError, match="no file matches the pattern; check the path"):
        analyze(str(tmp_path / "nomatch*.csv"), "failed")
