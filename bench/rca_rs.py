"""Root-cause accuracy on the RobustSpot RS incidents (set-level precision, recall, F1).

    .venv/bin/python bench/rca_rs.py [--data ../shared/data/rca/robustspot-RS] [-v]

Each incident is a ratio KPI per leaf (successes = cnt - value over requests = cnt) at the
anomalous minute; the expected numerator and denominator of a leaf are its means over the four
previous minutes (the published loader's forecast). Scoring as in the literature: per incident,
the predicted combinations against the labelled ones; TP, FP, FN summed over all incidents.
"""

from __future__ import annotations

import argparse
import ast
import time
from pathlib import Path

import pandas as pd

from stalwart.diagnose import DiagnoseOptions, localize

DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "data" / "rca" / "robustspot-RS"


def read_labels(path: Path) -> list[dict[str, object]]:
    """Parse anomaly.yaml (a flat list of data/timestamp/cause entries) without a YAML library."""
    out: list[dict[str, object]] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line.startswith("- data:"):
            out.append({"data": line.split(":", 1)[1].strip()})
        elif line.startswith("timestamp:"):
            out[-1]["timestamp"] = int(line.split(":", 1)[1])
        elif line.startswith("cause:"):
            out[-1]["cause"] = ast.literal_eval(line.split(":", 1)[1].strip())
    return out


def truth(cause: object) -> set[str]:
    causes = cause if isinstance(cause, list) else [cause]
    return {"&".join(sorted(f"{k}={v}" for k, v in c.items())) for c in causes}  # type: ignore[union-attr]


def leaves(csv: Path, timestamp: int, periods: int = 4) -> tuple[pd.DataFrame, list[str]]:
    raw = pd.read_csv(csv)
    attrs = [c for c in raw.columns if c not in ("min", "value", "cnt")]
    raw[attrs] = raw[attrs].astype(str)
    raw["succ"] = raw["cnt"] - raw["value"]
    now = raw[raw["min"] == timestamp]
    hist = raw[raw["min"].isin([timestamp - 60 * i for i in range(1, periods + 1)])]
    exp = hist.groupby(attrs, as_index=False)[["succ", "cnt"]].mean()
    exp = exp.rename(columns={"succ": "succ_exp", "cnt": "cnt_exp"})
    frame = now.merge(exp, on=attrs, how="left").fillna({"succ_exp": 0.0, "cnt_exp": 0.0})
    return frame[[*attrs, "succ", "cnt", "succ_exp", "cnt_exp"]], attrs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DEFAULT)
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--min-support", type=float, default=None)
    ap.add_argument("--min-lift", type=float, default=None)
    ap.add_argument("--max-findings", type=int, default=None)
    ap.add_argument("--min-gain", type=float, default=None)
    ap.add_argument("--coverage", type=float, default=None)
    ap.add_argument("--simpler", type=float, default=None)
    args = ap.parse_args()
    overrides = {
        k: v
        for k, v in (
            ("min_support", args.min_support),
            ("min_lift", args.min_lift),
            ("max_findings", args.max_findings),
            ("min_gain", args.min_gain),
            ("coverage", args.coverage),
            ("simpler", args.simpler),
        )
        if v is not None
    }
    tp = fp = fn = 0
    spent = 0.0
    labels = read_labels(args.data / "anomaly.yaml")
    for case in labels:
        frame, attrs = leaves(args.data / f"{case['data']}.csv", int(case["timestamp"]))  # type: ignore[call-overload]
        start = time.perf_counter()
        d = localize(
            frame,
            actual=("succ", "cnt"),
            expected=("succ_exp", "cnt_exp"),
            columns=attrs,
            options=DiagnoseOptions(example_rows=0, **overrides),
        )
        spent += time.perf_counter() - start
        pred = {"&".join(sorted(f"{k}={v}" for k, v in f.items.items())) for f in d.findings}
        true = truth(case["cause"])
        tp += len(pred & true)
        fp += len(pred - true)
        fn += len(true - pred)
        if args.verbose and pred != true:
            print(f"{case['data']}: predicted {sorted(pred)} labelled {sorted(true)}")
    p = tp / (tp + fp) if tp + fp else 0.0
    r = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * tp / (2 * tp + fp + fn) if tp else 0.0
    print(
        f"RS: {len(labels)} incidents  TP {tp}  FP {fp}  FN {fn}  precision {p:.3f}  "
        f"recall {r:.3f}  F1 {f1:.3f}  analysis time {spent:.1f} s "
        f"({spent / len(labels) * 1000:.0f} ms per incident)"
    )


if __name__ == "__main__":
    main()
