"""The coded rows of an out-of-core analysis, written once to local files and re-read per pass.

Every counting round (one per item-set length, two per selected finding) needs every coded row.
Rescanning a DuckDB temporary table for each costs a scan and an Arrow conversion of all
columns; here the rows are written once, column-major, as the smallest unsigned integers that
hold each column's codes (one byte for up to 255 values), and each pass reads only the columns
it counts, chunk by chunk with plain reads (the operating system's page cache keeps them hot; the
process holds one chunk at a time, so its resident memory stays that of a chunk).

The masses are stored per written chunk: a chunk of plain events (total mass 1, failure mass 0
or 1) keeps only its failure flags as bytes; any other chunk keeps both masses as float64.
While the rows are written, the number of distinct coded rows is estimated (k minimum values
of a 64-bit hash), so the caller can decide whether grouping them would pay, and the sample by
mass that counting's lower bounds use is drawn.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np
import pyarrow as pa

from stalwart.diagnose.source import Source

__all__ = [
    "SAMPLE_ROWS",
    "Chunk",
    "RowCache",
    "group_rows",
    "row_hash",
    "scratch_folder",
    "write_rows",
]

SAMPLE_ROWS = 1 << 16
"""Rows of the mass-proportional sample drawn while writing (``ItemCounter``'s sample size)."""
_KMV = 4096  # hashes kept by the distinct-count estimate (about 1.6% relative error)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MIX = np.uint64(0x100000001B3)

Chunk = tuple[dict[int, np.ndarray], np.ndarray, np.ndarray | None]
"""Codes per column, failure masses, total masses of a run of rows (None: plain events, whose
failure masses are 0/1 flags)."""


def code_dtype(values: int) -> np.dtype:
    """The smallest unsigned dtype holding codes 0..``values``."""
    return np.dtype(np.uint8 if values < 256 else np.uint16)


@dataclass
class RowCache:
    """Coded rows in a private folder: ``k{c}`` per column, ``t8`` (failure flags of plain
    chunks), ``t``/``r`` (float64 masses of the other chunks, at their row offsets)."""

    folder: str
    dtypes: dict[int, np.dtype]
    rows: int = 0
    chunks: list[tuple[int, int, bool]] = field(default_factory=list)
    """(first row, rows, plain) per written chunk."""
    total_target: float = 0.0
    total_reference: float = 0.0
    stop_estimate: int | None = None
    """Stop estimating once more distinct rows than this were seen (the count only grows)."""
    _kmv: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    _files_open: dict[str, BinaryIO] = field(default_factory=dict)
    _sample: dict[int, np.ndarray] = field(default_factory=dict)
    _sampled_weight: float = 0.0
    _rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))

    def _path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def append(self, cols: dict[int, np.ndarray], t: np.ndarray, r: np.ndarray) -> None:
        """Write a run of rows (codes per column, failure and total masses); ``close`` after
        the last."""
        n = len(t)
        if n == 0:
            return
        for c, dt in self.dtypes.items():
            self._write(f"k{c}", np.ascontiguousarray(cols[c], dtype=dt), self.rows)
        plain = bool(np.all(r == 1.0) and np.all((t == 0.0) | (t == 1.0)))
        self._write("t8", (t == 1.0).astype(np.uint8), self.rows)
        if not plain:  # sparse files: plain chunks leave holes
            self._write("t", np.ascontiguousarray(t, dtype=np.float64), self.rows)
            self._write("r", np.ascontiguousarray(r, dtype=np.float64), self.rows)
        self.chunks.append((self.rows, n, plain))
        self.rows += n
        self.total_target += float(t.sum())
        self.total_reference += float(r.sum())
        self._estimate(cols, n)
        self._draw(cols, r, n, plain)

    def _draw(self, cols: dict[int, np.ndarray], r: np.ndarray, n: int, plain: bool) -> None:
        # SAMPLE_ROWS draws with replacement, each a row with probability proportional to its
        # total mass, kept while streaming: a slot moves into this chunk with probability (its
        # mass / the mass so far), to a row drawn by mass within it
        w = float(r.sum())
        if w <= 0:
            return
        self._sampled_weight += w
        move = self._rng.random(SAMPLE_ROWS) < w / self._sampled_weight
        k = int(move.sum())
        pick = self._rng.integers(0, n, k) if plain else self._rng.choice(n, k, p=r / w)
        for c, dt in self.dtypes.items():
            if c not in self._sample:
                self._sample[c] = np.zeros(SAMPLE_ROWS, dtype=dt)
            self._sample[c][move] = cols[c][pick]

    def sample(self, size: int) -> dict[int, np.ndarray] | None:
        """The codes of ``size`` rows drawn by total mass (with replacement), when ``size`` is
        ``SAMPLE_ROWS`` and the cache holds more rows than that; else None."""
        if size != SAMPLE_ROWS or self.rows <= size or self._sampled_weight <= 0:
            return None
        return dict(self._sample)

    def _write(self, name: str, a: np.ndarray, row: int) -> None:
        # files stay open while the rows are written: opening and closing one per chunk cost
        # seven times the writes themselves (system time, ext4)
        f = self._files_open.get(name)
        if f is None:
            f = self._files_open[name] = open(self._path(name), "wb", buffering=0)  # noqa: SIM115
        f.seek(row * a.itemsize)
        view = memoryview(a).cast("B")
        while view:
            view = view[f.write(view) or 0 :]

    def close(self) -> None:
        """Close the files the rows were written to."""
        for f in self._files_open.values():
            f.close()
        self._files_open.clear()

    def remove(self) -> None:
        """Delete the cache's files (a grouped cache replaces the rows)."""
        self.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _estimate(self, cols: dict[int, np.ndarray], n: int) -> None:
        if self.stop_estimate is not None and self.distinct() > self.stop_estimate:
            return
        h = row_hash([cols[c] for c in self.dtypes], n)
        if len(self._kmv) >= _KMV:
            h = h[h <= self._kmv[-1]]
        elif len(h) > 4 * _KMV:
            # the K smallest distinct values lie at or below the 4K-th smallest value unless
            # rows repeat a lot; then the whole chunk is kept
            cut = h[h <= np.partition(h, 4 * _KMV)[4 * _KMV]]
            h = cut if len(np.unique(cut)) >= _KMV else h
        self._kmv = np.unique(np.concatenate([self._kmv, h]))[:_KMV]

    def distinct(self) -> int:
        """Estimated number of distinct coded rows (of those seen before ``stop_estimate``)."""
        if len(self._kmv) < _KMV:
            return len(self._kmv)
        return int((_KMV - 1) / (float(self._kmv[-1]) / 2.0**64))

    def read(self, columns: Iterable[int], *, flags: bool = False) -> Iterator[Chunk]:
        """The rows chunk by chunk, in the order written, with the codes of ``columns`` only;
        with ``flags``, a chunk of plain events comes as its failure flags (uint8) and None."""
        wanted = [c for c in columns if c in self.dtypes]
        with ExitStack() as stack:
            fds = {
                name: stack.enter_context(open(self._path(name), "rb", buffering=0))
                for name in self._files(wanted)
            }
            for start, n, plain in self.chunks:
                cols = {c: _pread(fds[f"k{c}"], self.dtypes[c], start, n) for c in wanted}
                if plain and flags:
                    yield cols, _pread(fds["t8"], np.dtype(np.uint8), start, n), None
                    continue
                if plain:
                    t = _pread(fds["t8"], np.dtype(np.uint8), start, n).astype(np.float64)
                    r = np.ones(n)
                else:
                    t = _pread(fds["t"], np.dtype(np.float64), start, n)
                    r = _pread(fds["r"], np.dtype(np.float64), start, n)
                yield cols, t, r

    def _files(self, wanted: list[int]) -> list[str]:
        names = [f"k{c}" for c in wanted] + ["t8"]
        if not all(plain for _, _, plain in self.chunks):
            names += ["t", "r"]
        return [n for n in names if os.path.exists(self._path(n))]


def row_hash(columns: Sequence[np.ndarray], n: int) -> np.ndarray:
    """A 64-bit hash of each row of ``columns`` (integer codes; ``n`` rows)."""
    h = np.zeros(n, dtype=np.uint64)
    for col in columns:
        h = (h ^ col.astype(np.uint64)) * _MIX
    h ^= h >> np.uint64(30)
    h *= _M1
    h ^= h >> np.uint64(27)
    h *= _M2
    h ^= h >> np.uint64(31)
    return h


def group_rows(codes: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of ``codes`` (rows x columns) and the summed ``t`` of each, exactly:
    grouped by a 64-bit row hash, or by the rows themselves when two rows share a hash."""
    if len(codes) == 0:
        return codes, t
    h = row_hash(list(codes.T), len(codes))
    _, first, inverse = np.unique(h, return_index=True, return_inverse=True)
    # a collision (two distinct rows, one hash) is grouped exactly; checked column by column,
    # so the check holds one column's temporaries, not a copy of the rows
    if not all(np.array_equal(col[first][inverse], col) for col in codes.T):
        distinct, inverse = np.unique(codes, axis=0, return_inverse=True)
        return distinct, np.bincount(inverse.ravel(), weights=t, minlength=len(distinct))
    return codes[first], np.bincount(inverse, weights=t, minlength=len(first))


def _pread(f: BinaryIO, dtype: np.dtype, start: int, n: int) -> np.ndarray:
    out = np.empty(n, dtype=dtype)
    view = memoryview(out).cast("B")
    f.seek(start * dtype.itemsize)
    done = 0
    while done < out.nbytes:
        got = f.readinto(view[done:])
        if not got:
            raise OSError(f"row cache file {f.name!r} ended early at byte {f.tell()}")
        done += got
    return out


def scratch_folder(src: Source) -> str:
    """A new private folder in the analysis' temporary directory (DuckDB's, where it spills; the
    system's when the connection is the caller's), removed when ``src`` closes."""
    where = None
    if src.owns_connection:
        where = src.con.sql("SELECT current_setting('temp_directory')").fetchall()[0][0] or None
        if where:
            os.makedirs(where, exist_ok=True)
    tmp = tempfile.TemporaryDirectory(prefix="stalwart-rca-rows-", dir=where)
    src.scratch.append(tmp)
    return tmp.name


def write_rows(
    batches: Iterable[pa.RecordBatch],
    columns: list[int],
    sizes: dict[int, int],
    folder: str,
    stop_estimate: int | None = None,
    chunk_rows: int = 1 << 20,
) -> RowCache:
    """Write record batches (codes of ``columns`` in order, then ``t`` and ``r``) to a new cache
    under ``folder``, in chunks of about ``chunk_rows`` rows (what a pass holds at once);
    ``sizes`` gives each column's number of values (its largest code)."""
    dtypes = {c: code_dtype(sizes[c]) for c in columns}
    cache = RowCache(tempfile.mkdtemp(prefix="rows-", dir=folder), dtypes)
    cache.stop_estimate = stop_estimate
    pending: list[pa.RecordBatch] = []
    try:
        for rb in itertools.chain(batches, [None]):
            if rb is not None:
                pending.append(rb)
            if pending and (rb is None or sum(b.num_rows for b in pending) >= chunk_rows):
                _append(cache, pending, columns)
                pending = []
    finally:
        cache.close()
    return cache


def _append(cache: RowCache, batches: list[pa.RecordBatch], columns: list[int]) -> None:
    def col(i: int) -> np.ndarray:
        if len(batches) == 1:
            return batches[0].column(i).to_numpy(zero_copy_only=False)
        return np.concatenate([b.column(i).to_numpy(zero_copy_only=False) for b in batches])

    n = len(columns)
    cache.append({c: col(i) for i, c in enumerate(columns)}, col(n), col(n + 1))
