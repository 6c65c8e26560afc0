"""Fuzz the label check (issue 23): thousands of labels mutated from a grammar of dangerous SQL
constructs and of legitimate conditions go through ``stalwart.diagnose.analyze``; none may have
a side effect.

Each run writes a canary secret file and watches a canary folder: a payload that reads the
secret (its text must never appear in any message or result) or writes, attaches or copies
anything (the folder must stay as it was) fails the run. Legitimate labels must be accepted;
every dangerous one must be refused with a ConfigError. Prints the counts.

    python bench/sql_label_fuzz.py --n 3000 --seed 0
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import tempfile
from pathlib import Path

import pyarrow as pa

from stalwart.diagnose import DiagnoseOptions, analyze
from stalwart.errors import ConfigError

SECRET = "FUZZ-CANARY-9d7c"

# Dangerous pieces: each alone is a construct a label must never run.
DANGER = [
    "read_text('{secret}')",
    "read_blob('{secret}')",
    "(SELECT content FROM read_text('{secret}'))",
    "(SELECT count(*) FROM read_csv('{secret}'))",
    "(SELECT count(*) FROM glob('{dir}/*'))",
    "glob('{dir}/*')",
    "(SELECT max(range) FROM range(3))",
    "EXISTS (SELECT 1 FROM read_parquet('{dir}/*.parquet'))",
    "query('SELECT 1')",
    "getenv('HOME')",
    "current_setting('temp_directory')",
    "\"read_text\"('{secret}')",
    "system.main.read_text('{secret}')",
    "COLUMNS(*)",
    "list_transform([1], x -> x)",
    "count(status)",
    "sum(latency_ms) OVER ()",
]
# Tails that try to break out of the expression.
TAILS = [
    "); COPY (SELECT 42) TO '{out}'; SELECT (1",
    "); SET enable_external_access = true; SELECT (1",
    "); ATTACH '{db}' AS x; SELECT (1",
    "); INSTALL httpfs; LOAD httpfs; SELECT (1",
    "); PRAGMA database_list; SELECT (1",
    "); CREATE TABLE t AS SELECT 1; SELECT (1",
    ") FROM read_text('{secret}') WHERE (1",
    "), (SELECT content FROM read_text('{secret}')",
    ")) UNION SELECT (content FROM read_text('{secret}')",
    " --\n) FROM read_text('{secret}') --",
    " /* ) FROM read_text('{secret}') */ OR (1",
    " /*",
    "; COPY (SELECT 1) TO '{out}'",
    "'); COPY (SELECT 1) TO '{out}'; SELECT ('x'",
]
LEGIT_ATOMS = [
    "status = 'fail'",
    "latency_ms > 500",
    "region <> 'eu'",
    "lower(status) IN ('fail', 'error')",
    "NOT ok",
    "ok",
    '"latency ms" BETWEEN 100 AND 200',
    "status LIKE 'f%'",
    "coalesce(latency_ms, 0) % 13 = 0",
    "CASE WHEN latency_ms > 900 THEN true ELSE status = 'error' END",
    "CAST(latency_ms AS DOUBLE) / 2 > 100",
    "regexp_matches(status, '^e')",
    "starts_with(region, 'u') AND length(status) = 4",
    "status IS NOT NULL /* a comment */",
]


def _table(n: int = 400) -> pa.Table:
    status = ["fail" if i % 7 == 0 else ("error" if i % 11 == 0 else "ok") for i in range(n)]
    return pa.table(
        {
            "rack": [f"r{i % 4}" for i in range(n)],
            "region": ["eu" if i % 2 else "us" for i in range(n)],
            "status": status,
            "latency_ms": [(i * 37) % 1000 for i in range(n)],
            "ok": [s == "ok" for s in status],
            "latency ms": [(i * 37) % 1000 for i in range(n)],
        }
    )


def _legit(rng: random.Random, comment: bool = True) -> str:
    parts = [rng.choice(LEGIT_ATOMS) for _ in range(rng.randint(1, 3))]
    out = parts[0]
    for p in parts[1:]:
        out = f"({out}) {rng.choice(['AND', 'OR'])} ({p})"
    out = f"NOT ({out})" if rng.random() < 0.2 else out
    return out + " -- a trailing comment" if comment and rng.random() < 0.1 else out


def _dangerous(rng: random.Random) -> str:
    base = _legit(rng, comment=False)  # a dangerous tail inside a comment would be inert
    how = rng.randrange(4)
    if how == 0:  # a dangerous value compared inside a legitimate condition
        return f"{base} {rng.choice(['AND', 'OR'])} {rng.choice(DANGER)} IS NOT NULL"
    if how == 1:  # a break-out tail after a legitimate condition
        return base + rng.choice(TAILS)
    if how == 2:  # both, with the case of the SQL (not of the paths) mutated
        parts = re.split(r"(\{\w+\})", f"{rng.choice(DANGER)} = 'x'{rng.choice(TAILS)}")
        return "".join(
            p if p.startswith("{") else "".join(c.upper() if rng.random() < 0.3 else c for c in p)
            for p in parts
        )
    return f"{rng.choice(DANGER)}{rng.choice(['', ' = 1', ' IS NULL', ' LIKE C%'])}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=3000, help="labels to try")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    table = _table()
    opts = DiagnoseOptions(example_rows=0)
    counts = {"legit": 0, "legit_ok": 0, "dangerous": 0, "refused": 0, "side_effects": 0}
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="stalwart-fuzz-") as tmp:
        folder = Path(tmp)
        (folder / "secret.txt").write_text(SECRET + "\n")
        place = {"secret": str(folder / "secret.txt"), "dir": tmp, "out": str(folder / "o.csv")}
        place["db"] = str(folder / "x.db")
        before = sorted(p.name for p in folder.iterdir())
        for i in range(args.n):
            danger = i % 2 == 1
            label = (_dangerous(rng) if danger else _legit(rng)).format(**place)
            counts["dangerous" if danger else "legit"] += 1
            text = ""
            try:
                d = analyze(table, label, options=opts)
                text = d.to_json()
                if danger:
                    problems.append(f"accepted: {label!r}")
                else:
                    counts["legit_ok"] += 1
            except ConfigError as e:
                text = str(e)
                if danger:
                    counts["refused"] += 1
                else:
                    problems.append(f"refused a legitimate label {label!r}: {e}")
            after = sorted(p.name for p in folder.iterdir())
            if SECRET in text or after != before:
                counts["side_effects"] += 1
                problems.append(f"side effect: {label!r}")
    for key, value in counts.items():
        sys.stdout.write(f"{key}: {value}\n")
    for p in problems[:20]:
        sys.stdout.write(f"PROBLEM {p}\n")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
