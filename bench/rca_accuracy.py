"""Root-cause accuracy on KPI data nobody here tuned on: stalwart's ``localize`` against
RiskLoc, AutoRoot, Squeeze, Adtributor, RobustSpot (and HotSpot) run from riskloc's own code.

    nice -n 10 .venv/bin/python bench/rca_accuracy.py --riskloc /work/.mirror/shaido987+riskloc/repo
    nice -n 10 .venv/bin/python bench/rca_accuracy.py --quick          # a few cases, RiskLoc only
    nice -n 10 .venv/bin/python bench/rca_accuracy.py --tune           # grid on the training split

Protocol (defaults are chosen on ``train`` only, the table is reported on ``test``):

- generated sets, riskloc's ``generate_dataset.py`` at the pinned commit, its recipes S, L, H
  with seeds the project never used (train 7301-7303, test 7311-7313; later draws ``fresh``
  7321-7323 and ``fresh2`` 7331-7333, each run once; ``--peers-only`` fills the peers' cache
  without running or scoring stalwart);
- the RobustSpot RS incidents, sorted by file name, alternately into half A (train) and B (test).

Scoring is riskloc's ``utils/evaluation.py`` rule: exact-match root-cause sets per case, TP, FP,
FN summed over the cases, F1 = 2TP / (2TP + FP + FN). Time per case is the method alone (riskloc's
``run_method`` plus post-processing; stalwart's ``localize`` on an in-memory frame, DuckDB
included), data loading excluded. Peers run once in a side virtual environment the bench builds
(numpy pandas scipy kneed loguru pyyaml from the package index) under ``--cache``; their
per-case answers are cached by method, commit and the case files' hash, so reruns only run
stalwart. A peer case over ``--peer-timeout`` seconds of its process's CPU time counts as no answer
(CPU, not wall: a loaded shared box does not count against a peer).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rca_rs import leaves as rs_leaves
from rca_rs import read_labels, truth

from stalwart.diagnose import DiagnoseOptions, localize

PINNED = "08cd777c801ffc912269ca5e75fea8e2f2870f77"
MIRROR = Path("/work/.mirror/shaido987+riskloc/repo")
RS_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "rca" / "robustspot-RS"
RECIPES = {
    "S": [],
    "L": [
        *("--dims", "10", "24", "10", "15", "--noise-level", "0.0", "0.1"),
        *("--anomaly-severity", "0.5", "1.0", "--anomaly-deviation", "0.0", "0.0"),
        *("--num-anomaly", "1", "5", "--num-anomaly-elements", "1", "1", "--only-last-layer"),
    ],
    "H": ["--dims", "10", "5", "250", "20", "8", "12"],
}
SEEDS = {
    "train": {"S": 7301, "L": 7302, "H": 7303},
    "test": {"S": 7311, "L": 7312, "H": 7313},
    # a second held-out draw, run once after the second tuning round had seen `test` results
    "fresh": {"S": 7321, "L": 7322, "H": 7323},
    # a third draw, run once after the third round (deep and multiple causes) was committed
    "fresh2": {"S": 7331, "L": 7332, "H": 7333},
}
PEERS = ("riskloc", "autoroot", "squeeze", "adtributor", "robustspot", "hotspot")
# Squeeze answers one string per cluster with its elements joined by ";" (its own
# AttributeCombination.batch_to_string); riskloc's post-processing sorted that string on "&" as
# one cause (scrambling it). Its answers are split per element now, cached under a new key.
ANSWER_FORMAT = {"squeeze": "-split"}
SIDE_PACKAGES = ("numpy", "pandas", "scipy", "kneed", "loguru", "pyyaml")


@dataclasses.dataclass(frozen=True)
class Case:
    """One incident: where its leaves are, how riskloc reads it, and its labelled causes."""

    set_name: str
    directory: Path
    file: str
    rs: bool
    truth: frozenset[str]

    def files(self) -> list[Path]:
        return [self.directory / f"{self.file}.csv"]


def export_riskloc(source: Path, cache: Path) -> Path:
    """riskloc's code at the pinned commit, exported once with ``git archive``."""
    out = cache / f"riskloc-{PINNED[:12]}"
    if (out / "run.py").exists():
        return out
    git_dir = source / ".git" if (source / ".git").exists() else source
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        archive = Path(tmp) / "riskloc.tar"
        cmd = ["git", f"--git-dir={git_dir}", "archive", "-o", str(archive), PINNED]
        subprocess.run(cmd, check=True)
        part = Path(tmp) / "code"
        with tarfile.open(archive) as tar:
            tar.extractall(part, filter="data")
        part.rename(out)
    return out


def side_python(cache: Path) -> Path:
    """The side environment's interpreter, built once (riskloc's requirements, unpinned)."""
    venv = cache / "riskloc-venv"
    python = venv / "bin" / "python"
    if not (venv / ".complete").exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *SIDE_PACKAGES], check=True)
        (venv / ".complete").touch()
    return python


def generated(code: Path, python: Path, cache: Path, recipe: str, seed: int, n: int) -> Path:
    """A generated set (``n`` cases), made once with riskloc's generator."""
    name = f"{recipe}-{seed}-{n}"
    out = cache / "data" / name
    if not (out / "injection_info.csv").exists():
        cmd = [str(python), "generate_dataset.py", "--num", str(n), "--seed", str(seed)]
        cmd += ["--data-root", str(cache / "data"), "--dataset-name", name, *RECIPES[recipe]]
        subprocess.run(cmd, cwd=code, check=True, stdout=subprocess.DEVNULL)
    return out


def synthetic_cases(directory: Path, set_name: str, limit: int) -> list[Case]:
    info = pd.read_csv(directory / "injection_info.csv")
    out = []
    for _, row in info.head(limit).iterrows():
        labels = frozenset("&".join(sorted(x.split("&"))) for x in str(row["set"]).split(";"))
        out.append(Case(set_name, directory, str(row["timestamp"]), False, labels))
    return out


def rs_cases(data: Path, half: str, limit: int, skip: int = 0) -> list[Case]:
    """RS incidents sorted by file name; A takes the even places, B the odd."""
    labels = {str(c["data"]): c for c in read_labels(data / "anomaly.yaml")}
    names = sorted(n for n in labels if (data / f"{n}.csv").exists())
    chosen = names[0::2] if half == "A" else names[1::2]
    return [
        Case(f"RS-{half}", data, n, True, frozenset(truth(labels[n]["cause"])))
        for n in chosen[skip : skip + limit]
    ]


def score(preds: set[str], labels: frozenset[str]) -> tuple[int, int, int]:
    """riskloc's rule: a labelled cause is found when its exact combination is predicted."""
    norm = {"&".join(sorted(p.split("&"))) for p in preds}
    tp = len(labels & norm)
    return tp, max(len(norm) - tp, 0), len(labels) - tp


# Run inside the side environment with riskloc's code as the working directory: loads each
# case once (riskloc's own reader), runs each asked method through riskloc's run_method and
# post-processing, and prints one JSON line per (case, method).
DRIVER = r"""
import json, signal, sys, time
from utils.run_utils import read_dataframe, run_method
from utils.evaluation import root_cause_postprocessing
from utils.argument_parser import get_input_arguments

def defaults(method):  # the method's defaults, from riskloc's own command line parser
    sys.argv = ["run.py", method]
    return get_input_arguments()[3]

class Timeout(Exception):
    pass

def alarm(*_):
    raise Timeout()

signal.signal(signal.SIGPROF, alarm)
job = json.loads(sys.stdin.read())
for case in job["cases"]:
    rs = case["rs"]
    df, attributes, df_a, df_b = read_dataframe(case["dir"], case["file"], rs, rs)
    for method in case["methods"]:
        start, cpu = time.time(), time.process_time()
        signal.setitimer(signal.ITIMER_PROF, job["timeout"])  # seconds of CPU, not wall
        try:
            args = defaults(method)
            found = run_method(df.copy(), [df_a, df_b], attributes, method, args, rs, False)
            if method == "squeeze":  # one string per cluster, its elements joined by ";"
                found = [e for s in found for e in s.split(";")]
            preds = [str(p) for p in root_cause_postprocessing(found, method)]
            status = "ok"
        except Timeout:
            preds, status = [], "timeout"
        except Exception as e:  # a peer's own bug on this case: no answer, say which
            preds, status = [], f"error: {type(e).__name__}: {e}"[:200]
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
        spent, cpu = time.time() - start, time.process_time() - cpu
        print(json.dumps({"key": case["keys"][method], "preds": preds, "time": spent,
                          "cpu": cpu, "status": status}), flush=True)
"""


def case_hash(case: Case) -> str:
    h = hashlib.sha256()
    for f in case.files():
        h.update(f.read_bytes())
    if case.rs:
        h.update(case.file.encode())
    return h.hexdigest()[:16]


def run_peers(
    cases: list[Case], methods: list[str], code: Path, python: Path, cache: Path, timeout: int
) -> dict[tuple[str, str], dict]:
    """Each (case file, method) answer, from the cache or run once in the side environment."""
    store = cache / "peers"
    store.mkdir(parents=True, exist_ok=True)
    results: dict[tuple[str, str], dict] = {}
    todo = []
    for case in cases:
        digest = case_hash(case)
        keys = {m: f"{m}{ANSWER_FORMAT.get(m, '')}-{PINNED[:12]}-{digest}" for m in methods}
        missing = [m for m in methods if not (store / f"{keys[m]}.json").exists()]
        if missing:
            todo.append(
                {
                    "dir": str(case.directory),
                    "file": case.file,
                    "rs": case.rs,
                    "methods": missing,
                    "keys": keys,
                }
            )
        for m in methods:
            results[(case.file, m)] = {"key": keys[m]}
    if todo:
        print(f"running {sum(len(t['methods']) for t in todo)} peer answers ...", flush=True)
        job = json.dumps({"cases": todo, "timeout": timeout})
        with subprocess.Popen(
            [str(python), "-c", DRIVER],
            cwd=code,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        ) as proc:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(job)
            proc.stdin.close()
            for line in proc.stdout:
                if line.startswith("{") and '"key"' in line:
                    got = json.loads(line)
                    (store / f"{got['key']}.json").write_text(json.dumps(got))
    for key, value in results.items():
        path = store / f"{value['key']}.json"
        results[key] = (
            json.loads(path.read_text())
            if path.exists()
            else {"preds": [], "time": float("nan"), "status": "missing"}
        )
    return results


def load(case: Case) -> tuple[pd.DataFrame, list[str], object, object]:
    """The case's leaves as ``localize`` reads them (RS: the 4-minute mean forecast)."""
    if case.rs:
        stamp = next(
            int(str(c["timestamp"]))
            for c in read_labels(case.directory / "anomaly.yaml")
            if c["data"] == case.file
        )
        frame, attrs = rs_leaves(case.directory / f"{case.file}.csv", stamp)
        return frame, attrs, ("succ", "cnt"), ("succ_exp", "cnt_exp")
    frame = pd.read_csv(case.files()[0])
    attrs = [c for c in frame.columns if c not in ("real", "predict")]
    frame[attrs] = frame[attrs].astype(str)
    return frame, attrs, "real", "predict"


def stalwart_answer(loaded: tuple, opts: DiagnoseOptions) -> tuple[set[str], float, float]:
    """(predicted causes, seconds in ``localize``, confidence) for one loaded case."""
    frame, attrs, actual, expected = loaded
    start = time.perf_counter()
    d = localize(frame, actual, expected, columns=attrs, options=opts)
    spent = time.perf_counter() - start
    preds = {"&".join(sorted(f"{k}={v}" for k, v in f.items.items())) for f in d.findings}
    return preds, spent, d.confidence


@dataclasses.dataclass
class Tally:
    """TP/FP/FN summed over a set's cases, cases with no answer, and time per case."""

    tp: int = 0
    fp: int = 0
    fn: int = 0
    empty: int = 0
    times: list[float] = dataclasses.field(default_factory=list)

    def add(self, preds: set[str], labels: frozenset[str], spent: float) -> None:
        tp, fp, fn = score(preds, labels)
        self.tp, self.fp, self.fn = self.tp + tp, self.fp + fp, self.fn + fn
        self.empty += not preds
        self.times.append(spent)

    @property
    def f1(self) -> float:
        return 2 * self.tp / (2 * self.tp + self.fp + self.fn) if self.tp else 0.0

    def row(self) -> str:
        p = self.tp / (self.tp + self.fp) if self.tp + self.fp else 0.0
        r = self.tp / (self.tp + self.fn) if self.tp + self.fn else 0.0
        t = float(np.nanmedian(self.times)) if self.times else float("nan")
        return f"{self.f1:.3f} | {p:.3f} | {r:.3f} | {self.empty} | {t:.3f}"


def build_sets(args: argparse.Namespace, split: str, code: Path, python: Path) -> list[Case]:
    """The split's cases: generated recipes plus its RS half."""
    n = {"S": args.cases, "L": args.cases, "H": args.h_cases}
    cases: list[Case] = []
    for recipe in args.recipes:
        if n[recipe] <= 0:
            continue
        seed = SEEDS[split][recipe]
        directory = generated(code, python, args.cache, recipe, seed, n[recipe])
        cases += synthetic_cases(directory, f"{recipe}-{split}", n[recipe])
    if args.rs_cases > 0 and args.rs.exists():
        half = "A" if split == "train" else "B"
        cases += rs_cases(args.rs, half, args.rs_cases, args.rs_skip)
    return cases


def evaluate(cases: list[Case], opts_grid: list[DiagnoseOptions]) -> dict[tuple[int, str], Tally]:
    """Stalwart's tallies per (options index, set), each case loaded once."""
    tallies: dict[tuple[int, str], Tally] = {}
    for case in cases:
        loaded = load(case)
        for i, opts in enumerate(opts_grid):
            preds, spent, _ = stalwart_answer(loaded, opts)
            tallies.setdefault((i, case.set_name), Tally()).add(preds, case.truth, spent)
    return tallies


def grid() -> list[DiagnoseOptions]:
    """The tuning grid: the KPI search's bar, explanatory-power floor and noise trim."""
    return [
        DiagnoseOptions(kpi_risk=r, kpi_min_ep=e, kpi_trim=t, example_rows=0)
        for r in (0.4, 0.45, 0.5, 0.55, 0.6)
        for e in (0.01, 0.02, 0.05)
        for t in (2, 5, 10)
    ]


def tune(cases: list[Case]) -> None:
    """Every grid point's F1 per training set; the best mean F1 over the sets first."""
    opts = grid()
    tallies = evaluate(cases, opts)
    sets = sorted({c.set_name for c in cases})
    scored = sorted(
        range(len(opts)),
        key=lambda i: -float(np.mean([tallies[(i, s)].f1 for s in sets])),
    )
    print("| kpi_risk | kpi_min_ep | kpi_trim | mean F1 | " + " | ".join(sets) + " |")
    for i in scored[:15]:
        o = opts[i]
        f1s = [tallies[(i, s)].f1 for s in sets]
        print(
            f"| {o.kpi_risk} | {o.kpi_min_ep} | {o.kpi_trim} | {np.mean(f1s):.3f} | "
            + " | ".join(f"{f:.3f}" for f in f1s)
            + " |"
        )


def report(args: argparse.Namespace, cases: list[Case], code: Path, python: Path) -> dict:
    """The table for one split: every method's F1, precision, recall, no-answer count and
    median time per case, per set, with RiskLoc's time over each method's."""
    peers = run_peers(cases, args.peers, code, python, args.cache, args.peer_timeout)
    ours = evaluate(cases, [DiagnoseOptions(example_rows=0)])
    table: dict[str, dict[str, Tally]] = {}
    for case in cases:
        for m in args.peers:
            got = peers[(case.file, m)]
            tally = table.setdefault(case.set_name, {}).setdefault(m, Tally())
            tally.add(set(got["preds"]), case.truth, float(got["time"]))
    for (_, set_name), tally in ours.items():
        table.setdefault(set_name, {})["stalwart"] = tally
    print(
        "| set | cases | method | F1 | precision | recall | no answer | s per case | "
        "RiskLoc time / its time |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    out: dict = {}
    for set_name, methods in table.items():
        base = methods.get("riskloc")
        n = len(methods["stalwart"].times)
        for m, tally in sorted(methods.items(), key=lambda kv: -kv[1].f1):
            ratio = ""
            if base is not None and tally.times:
                ratio = f"{np.nanmedian(base.times) / max(np.nanmedian(tally.times), 1e-9):.1f}x"
            print(f"| {set_name} | {n} | {m} | {tally.row()} | {ratio} |")
            out.setdefault(set_name, {})[m] = dataclasses.asdict(tally) | {"f1": tally.f1}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--riskloc",
        type=Path,
        default=MIRROR,
        help="a riskloc checkout or bare mirror holding the pinned commit",
    )
    ap.add_argument(
        "--cache",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "stalwart-bench",
    )
    ap.add_argument("--rs", type=Path, default=RS_DATA, help="RobustSpot RS incidents")
    ap.add_argument("--split", choices=(*SEEDS, "both"), default="test")
    ap.add_argument("--rs-skip", type=int, default=0, help="skip this many RS cases of the half")
    ap.add_argument("--quick", action="store_true", help="3 cases per set, RiskLoc only")
    ap.add_argument("--tune", action="store_true", help="grid over the kpi_* options (train)")
    ap.add_argument("--peers", default=",".join(PEERS[:5]), help="comma list of " + ",".join(PEERS))
    ap.add_argument("--recipes", default="S,L,H")
    ap.add_argument("--cases", type=int, default=20, help="cases per S and L set")
    ap.add_argument("--h-cases", type=int, default=3, help="cases per H set (24 M leaves each)")
    ap.add_argument("--rs-cases", type=int, default=1000, help="cases per RS half")
    ap.add_argument("--peer-timeout", type=int, default=300, help="CPU seconds per peer case")
    ap.add_argument("--json", type=Path, help="write every number here")
    ap.add_argument("--peers-only", action="store_true", help="fill the peer cache only")
    args = ap.parse_args()
    args.peers = [p for p in args.peers.split(",") if p]
    args.recipes = [r for r in args.recipes.split(",") if r]
    if args.quick:
        args.cases, args.h_cases, args.rs_cases, args.peers = 3, 0, 4, ["riskloc"]
    args.cache.mkdir(parents=True, exist_ok=True)
    code = export_riskloc(args.riskloc, args.cache)
    python = side_python(args.cache)
    if args.tune:
        tune(build_sets(args, "train", code, python))
        return
    results = {}
    for split in ("train", "test") if args.split == "both" else (args.split,):
        if args.peers_only:
            cases = build_sets(args, split, code, python)
            run_peers(cases, args.peers, code, python, args.cache, args.peer_timeout)
            continue
        print(f"\n{split} split")
        results[split] = report(args, build_sets(args, split, code, python), code, python)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
