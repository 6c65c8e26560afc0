"""Synthetic failure logs with known causes, for tests, the demo and the benchmarks.

Attribute columns take Zipf-skewed values over cardinalities from 2 to 500; an ID column mimics
a host or job id (one value per five rows); a handful of causes (conjunctions of 1 to ``max
depth`` attribute values, each covering a few percent of the rows) fail at a high rate, and
every other row fails at a low background rate (noise).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

__all__ = ["SyntheticLog", "make_failure_log"]

_CARDS = (2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 25, 30, 40, 50, 64, 100, 150, 200, 300, 500)


@dataclass(frozen=True)
class SyntheticLog:
    """A generated log and the causes injected into it."""

    table: pa.Table
    causes: tuple[dict[str, str], ...]
    label: str = "failed"


def _zipf(card: int, s: float) -> np.ndarray:
    p = 1.0 / np.arange(1, card + 1) ** s
    return p / p.sum()


def make_failure_log(
    rows: int,
    *,
    columns: int = 20,
    causes: int = 2,
    depth: int | tuple[int, ...] = 2,
    strength: float = 0.3,
    base_rate: float = 0.01,
    coverage: tuple[float, float] = (0.004, 0.03),
    id_column: bool = True,
    seed: int = 0,
) -> SyntheticLog:
    """Generate ``rows`` rows x ``columns`` attributes with ``causes`` injected causes.

    Args:
        depth: attribute values per cause (one number, or one per cause).
        strength: failure probability of a row inside a cause.
        base_rate: failure probability of every other row.
        coverage: each cause covers a share of rows in this range.
    """
    rng = np.random.default_rng(seed)
    cards = [_CARDS[i % len(_CARDS)] for i in range(columns)]
    probs = [_zipf(c, 1.1 + 0.3 * rng.random()) for c in cards]
    names = [f"c{i:02d}" for i in range(columns)]
    codes = [
        rng.choice(c, size=rows, p=p).astype(np.int32) for c, p in zip(cards, probs, strict=True)
    ]
    depths = (depth,) * causes if isinstance(depth, int) else tuple(depth)
    chosen: list[dict[int, int]] = []
    used: set[int] = set()
    for d in depths[:causes]:
        for _ in range(10_000):
            pool = [i for i in range(columns) if i not in used and cards[i] >= 3]
            if len(pool) < d:
                pool = [i for i in range(columns) if cards[i] >= 3]
            cols = rng.choice(pool, size=d, replace=False)
            vals = [int(rng.integers(0, min(12 if d == 1 else 4, cards[c]))) for c in cols]
            share = float(np.prod([probs[c][v] for c, v in zip(cols, vals, strict=False)]))
            if coverage[0] <= share <= coverage[1]:
                chosen.append(dict(zip(map(int, cols), vals, strict=False)))
                used.update(int(c) for c in cols)
                break
        else:
            raise ValueError(f"no cause of depth {d} covers {coverage} of the rows; widen it")
    inside = np.zeros(rows, dtype=bool)
    for cause in chosen:
        m = np.ones(rows, dtype=bool)
        for c, v in cause.items():
            m &= codes[c] == v
        inside |= m
    p_fail = np.where(inside, strength, base_rate)
    failed = rng.random(rows) < p_fail
    arrays: dict[str, pa.Array] = {}
    if id_column:
        n_ids = max(rows // 5, 1)
        ids = rng.integers(0, n_ids, size=rows).astype(np.int32)
        host = pa.array([f"host-{k:07d}" for k in range(n_ids)])
        arrays["host_id"] = pa.DictionaryArray.from_arrays(pa.array(ids), host)
    for name, card, code in zip(names, cards, codes, strict=False):
        dictionary = pa.array([f"{name}v{k}" for k in range(card)])
        arrays[name] = pa.DictionaryArray.from_arrays(pa.array(code), dictionary)
    arrays["failed"] = pa.array(failed)
    truth = tuple(
        {names[c]: f"{names[c]}v{v}" for c, v in sorted(cause.items())} for cause in chosen
    )
    return SyntheticLog(pa.table(arrays), truth)
