"""Why Squeeze (riskloc's port, run by ``bench/rca_accuracy.py``) scores about 0: one case at a
time, its clusters, its "normal" leaves and its answer, as published and with one line changed.

    nice -n 10 .venv/bin/python bench/rca_peers_debug.py S-7311-10/608821 S-7311-10/975569
    nice -n 10 .venv/bin/python bench/rca_peers_debug.py --rs-b 8       # the first 8 RS-B cases

Squeeze scores a candidate cause with its generalized potential score on the abnormal cluster's
leaves plus the "normal" leaves, ``|d| < d[a0]`` where ``d = (f - v) / (f + v)`` and ``a0`` is
the abnormal leaf of smallest ``|d|`` (``Squeeze.normal_indices``, the same line in
NetManAIOps/Squeeze). ``d[a0]`` is signed: when the anomaly raises the actual value over the
forecast (``d < 0``) the normal set is empty, every cuboid that contains the cluster scores
about 1 and the layer-by-layer search stops at layer 1 (``ps_upper_bound`` 0.9) with
one-attribute answers. The ``abs`` column re-runs the case with ``|d[a0]|``, a diagnosis only;
the accuracy table keeps Squeeze as published.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rca_accuracy import (
    MIRROR,
    RS_DATA,
    Case,
    export_riskloc,
    rs_cases,
    score,
    side_python,
    synthetic_cases,
)

# Run in the side environment, riskloc's code as the working directory: one JSON line per
# (case, variant) with the clusters, the normal set and the answer split per element.
DRIVER = r"""
import json, sys, time
import numpy as np
from loguru import logger
from utils.run_utils import read_dataframe
from algorithms.squeeze.squeeze import Squeeze, SqueezeOption

logger.remove()


class AbsNormal(Squeeze):
    @property
    def normal_indices(self):
        if not hasattr(self, "_abs_normal"):
            dev = self.leaf_deviation_score
            abnormal = np.concatenate(self.cluster_list).astype(int)
            self._abs_normal = np.where(np.abs(dev) < np.min(np.abs(dev[abnormal])))[0]
        return self._abs_normal


job = json.loads(sys.stdin.read())
divide = lambda x, y: np.divide(x, y, out=np.zeros_like(x), where=y != 0)
for case in job["cases"]:
    rs = case["rs"]
    df, attrs, df_a, df_b = read_dataframe(case["dir"], case["file"], rs, rs)
    for variant, cls in (("published", Squeeze), ("abs", AbsNormal)):
        opt = SqueezeOption(ps_upper_bound=0.9, max_num_elements_single_cluster=12)
        data, op = ([df_a, df_b], divide) if rs else ([df.copy()], lambda x: x)
        start = time.time()
        model = cls(data_list=data, op=op, option=opt).run()
        dev = model.leaf_deviation_score
        clusters = model.cluster_list
        preds = [e for s in model.root_cause_string_list for e in s.split(";")]
        print(json.dumps({
            "case": case["file"], "variant": variant, "time": time.time() - start,
            "leaves": int(len(dev)), "clusters": [len(c) for c in clusters],
            "cluster_mean_d": [round(float(np.mean(dev[np.asarray(c, int)])), 3) for c in clusters],
            "normal": int(len(model.normal_indices)) if clusters else 0,
            "preds": preds}), flush=True)
"""


def cases_from(args: argparse.Namespace) -> list[Case]:
    out: list[Case] = []
    for spec in args.cases:
        set_dir, file = spec.split("/")
        directory = args.cache / "data" / set_dir
        out += [c for c in synthetic_cases(directory, set_dir, 10_000) if c.file == file]
    if args.rs_b:
        out += rs_cases(args.rs, "B", args.rs_b)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*", help="SET/FILE under the bench cache's data/")
    ap.add_argument("--rs-b", type=int, default=0, help="also the first N RS half-B cases")
    ap.add_argument("--rs", type=Path, default=RS_DATA)
    ap.add_argument("--riskloc", type=Path, default=MIRROR)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "stalwart-bench")
    args = ap.parse_args()
    cases = cases_from(args)
    code = export_riskloc(args.riskloc, args.cache)
    python = side_python(args.cache)
    job = {"cases": [{"dir": str(c.directory), "file": c.file, "rs": c.rs} for c in cases]}
    proc = subprocess.run(
        [str(python), "-c", DRIVER],
        cwd=code,
        input=json.dumps(job),
        capture_output=True,
        text=True,
        check=True,
    )
    truth = {c.file: c.truth for c in cases}
    totals: dict[str, list[int]] = {}
    print("| case | variant | clusters (leaves) | mean d | normal leaves | answer | TP/FP/FN | s |")
    print("|---|---|---|---|---|---|---|---|")
    for line in proc.stdout.splitlines():
        got = json.loads(line)
        tp, fp, fn = score(set(got["preds"]), truth[got["case"]])
        t = totals.setdefault(got["variant"], [0, 0, 0])
        t[0], t[1], t[2] = t[0] + tp, t[1] + fp, t[2] + fn
        print(
            f"| {got['case']} | {got['variant']} | {got['clusters']} | {got['cluster_mean_d']} | "
            f"{got['normal']} of {got['leaves']} | {';'.join(got['preds'])} | {tp}/{fp}/{fn} | "
            f"{got['time']:.1f} |"
        )
    for variant, (tp, fp, fn) in totals.items():
        f1 = 2 * tp / (2 * tp + fp + fn) if tp else 0.0
        print(f"{variant}: TP {tp} FP {fp} FN {fn} F1 {f1:.3f}")
    for c in cases:
        print(f"truth {c.file}: {';'.join(sorted(c.truth))}")


if __name__ == "__main__":
    main()
