"""Recipe H (24 M leaves a case, 1.3 GB of CSV) for ``bench/rca_accuracy.py``: use the cases
riskloc's generator has finished so far, and show every method's answer per case.

    # riskloc's generator, unchanged, in the background (about 150 s CPU a case):
    cd ~/.cache/stalwart-bench/riskloc-08cd777c801f && nice -n 19 ../riskloc-venv/bin/python \
        generate_dataset.py --num 3 --seed 7313 --data-root ~/.cache/stalwart-bench/data \
        --dataset-name H-7313-3 --dims 10 5 250 20 8 12
    # the cases finished so far, as the set the bench reads (H-7313-<k>, hard links):
    .venv/bin/python bench/rca_h_recipe.py link H-7313-3 7313
    nice -n 10 .venv/bin/python bench/rca_accuracy.py --split test --recipes H --h-cases <k> \
        --rs-cases 0 --peers riskloc,autoroot --peer-timeout 300
    .venv/bin/python bench/rca_h_recipe.py show H-7313-<k>     # truth and answers per case
    nice -n 10 .venv/bin/python bench/rca_h_recipe.py run H-7303-3  # stalwart, lean loading

``run`` is stalwart's ``localize`` with default options (as the accuracy bench calls it) plus
``memory_limit``, given the CSV path, so its time includes reading 1.3 GB of CSV: the bench's
``load`` (a pandas frame of 24 M rows of Python strings) went past 15 GB on this 23 GB box, and a
frame with categorical columns past 9 GB, before ``localize`` returned.

The generator writes ``injection_info.csv`` after each finished case and case ``i`` does not
depend on ``--num``, so the first ``k`` cases of a longer run are the ``--num k`` set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import pandas as pd

from stalwart.diagnose import DiagnoseOptions, localize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rca_accuracy import ANSWER_FORMAT, PINNED, Tally, case_hash, synthetic_cases

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "stalwart-bench"


def link(source: Path, seed: int) -> Path:
    """``H-<seed>-<k>`` holding the ``k`` cases ``source`` has finished (hard links)."""
    info = pd.read_csv(source / "injection_info.csv")
    out = source.parent / f"H-{seed}-{len(info)}"
    if out != source:
        out.mkdir(exist_ok=True)
        for stamp in info["timestamp"]:
            target, origin = out / f"{stamp}.csv", source / f"{stamp}.csv"
            if target.exists() and not target.samefile(origin):
                target.unlink()  # a truncated file of an interrupted run
            if not target.exists():
                os.link(origin, target)
        info.to_csv(out / "injection_info.csv", index=False)
    return out


def show(directory: Path, methods: list[str]) -> None:
    """Each case's labelled causes and every cached method's answer, status and seconds."""
    for case in synthetic_cases(directory, directory.name, 1000):
        digest = case_hash(case)
        print(f"{case.file}: truth {';'.join(sorted(case.truth))}")
        for m in methods:
            path = CACHE / "peers" / f"{m}{ANSWER_FORMAT.get(m, '')}-{PINNED[:12]}-{digest}.json"
            if path.exists():
                got = json.loads(path.read_text())
                hits = len(set(got["preds"]) & case.truth)
                print(
                    f"  {m}: {got['status']} {got['time']:.1f} s, {hits} of "
                    f"{len(got['preds'])} right: {';'.join(got['preds'])}"
                )


def run(directory: Path, limit: str) -> None:
    """Stalwart on each case: its answer, the seconds in ``localize`` and the set's tally."""
    tally = Tally()
    for case in synthetic_cases(directory, directory.name, 1000):
        path = case.files()[0]
        attrs = [c for c in pd.read_csv(path, nrows=1).columns if c not in ("real", "predict")]
        opts = DiagnoseOptions(example_rows=0, memory_limit=limit)
        start, cpu = time.perf_counter(), time.process_time()
        d = localize(str(path), "real", "predict", columns=attrs, options=opts)
        spent, cpu = time.perf_counter() - start, time.process_time() - cpu
        preds = {"&".join(sorted(f"{k}={v}" for k, v in f.items.items())) for f in d.findings}
        tally.add(preds, case.truth, spent)
        print(
            f"{case.file}: {len(preds & case.truth)} of {len(preds)} right, {spent:.1f} s "
            f"({cpu:.1f} s CPU, all threads; {d.timings_s}), confidence {d.confidence:.2f}: "
            f"{';'.join(sorted(preds))}",
            flush=True,
        )
    print(f"{directory.name} stalwart | {tally.row()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("link", help="the finished cases of a generator run as H-<seed>-<k>")
    a.add_argument("source")
    a.add_argument("seed", type=int)
    b = sub.add_parser("show", help="truth and cached peer answers per case")
    b.add_argument("set")
    b.add_argument("--methods", default="riskloc,autoroot,adtributor,squeeze,robustspot")
    c = sub.add_parser("run", help="stalwart's localize on each case of a set")
    c.add_argument("set")
    c.add_argument("--memory-limit", default="3GB", help="DuckDB's, spilling beyond it")
    args = ap.parse_args()
    if args.cmd == "link":
        print(link(CACHE / "data" / args.source, args.seed))
    elif args.cmd == "run":
        run(CACHE / "data" / args.set, args.memory_limit)
    else:
        show(CACHE / "data" / args.set, args.methods.split(","))


if __name__ == "__main__":
    main()
