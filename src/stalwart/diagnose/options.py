"""Options of a root-cause analysis: frozen, keyword-only dataclasses, validated on creation.

``DiagnoseOptions`` says what the analysis finds (mining, scoring, selection, cleaning);
``EngineTuning``, one of its fields, sizes the engines' batches, buffers and caches, which change
memory and speed but never a finding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from stalwart.diagnose.budget import parse_bytes
from stalwart.errors import ConfigError

__all__ = ["DiagnoseOptions", "EngineTuning"]


@dataclass(frozen=True, kw_only=True)
class EngineTuning:
    """Sizes of the engines' batches, buffers and caches.

    They trade memory for speed and never change what an analysis finds: the tests set them
    tiny so that a small input takes the streamed, chunked, spilled and recounted paths a large
    one takes, and check the findings against the defaults'. The defaults suit a host with a
    few GiB free; ``memory_limit`` is the knob for a smaller one.
    """

    batch_rows: int = 1 << 20
    """Rows of one Arrow batch streamed from DuckDB, and of one chunk of the row cache that a
    counting pass holds (measured at 10 M rows: 4 M-row chunks took twice the system time and
    1.6x the peak memory of 1 M-row ones)."""
    stream_rows: int = 1 << 22
    """Inputs with more rows stream their failing rows from DuckDB batch by batch; smaller ones
    fetch them in one materialized result, which is faster while small."""
    group_gain: int = 4
    """Out of core, the coded rows are grouped by every coded column (a second scan) only when
    that divides their number by at least this."""
    dense_triples: int = 1 << 22
    """FP-Growth counts item triples in a dense array up to this many cells (8 bytes each), by
    sorting their keys beyond."""
    node_chunk: int = 1 << 18
    """FP-tree nodes whose ancestors are held at once (times the tree's depth, 2 bytes each)."""
    triple_buffer: int = 1 << 20
    """Triple keys buffered (16 bytes each) before they are summed."""
    kpi_cache_ids: int = 10_000_000
    """KPI search: most element ids (leaves x cuboids) held for the whole search; beyond it,
    every cuboid is recounted each round."""
    kpi_dense_cells: int = 4
    """KPI search: a cube of at most this many cells per leaf (plus 1024) has its cuboids summed
    from the full cube's cells."""

    def __post_init__(self) -> None:
        least = {"batch_rows": 1, "group_gain": 1, "node_chunk": 1, "triple_buffer": 1}
        for f in fields(self):
            value, low = getattr(self, f.name), least.get(f.name, 0)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"EngineTuning.{f.name}={value!r}: expected an integer >= {low}")


@dataclass(frozen=True, kw_only=True)
class DiagnoseOptions:
    """How ``analyze`` and ``localize`` clean, mine, score and select.

    Defaults suit a fleet-sized log (10^3 to 10^8 rows, tens of attribute columns). Fields
    named ``kpi_*`` set ``localize``'s search; ``min_support`` to ``min_gain`` set the labelled
    events' mining and selection (``max_findings`` bounds both).
    """

    min_support: float = 0.05
    """Smallest share of the failures (or of the deviation) an item-set must cover to be mined."""
    max_len: int = 3
    """Largest number of attribute values in one item-set."""
    min_lift: float = 1.5
    """Smallest lift (failure rate inside / overall failure rate) a finding may have."""
    min_lift_gain: float = 1.25
    """A superset must raise the failure rate at least this many times over the rest of its
    subset (and significantly) to be kept: with millions of rows tiny, useless differences are
    significant, so a material effect is required too."""
    simpler: float = 0.8
    """Selection takes a subset of the best candidate instead when the subset explains at least
    this share of what the best one does (the simpler explanation wins near-ties)."""
    confidence: float = 0.95
    """Two-sided level of the Wilson interval reported around each lift."""
    alpha: float = 0.01
    """Significance level of the pruning tests, before the Bonferroni correction over candidates."""
    max_findings: int = 10
    """At most this many findings are selected."""
    coverage: float = 0.95
    """Selection stops once the findings' rows hold this share of the failures (or deviation)."""
    min_gain: float = 0.02
    """Labelled events: selection stops when the next finding would explain less than this
    share of the failures (they include a background rate spread over every row)."""
    rank_by: str | None = None
    """Labelled events: which finding selection takes next. ``"explained"``: the most failures
    attributable beyond the residual rate (a broad cause first). ``"likelihood"``: the largest
    likelihood ratio of its rate against the residual rate, which weighs how sharply it singles
    out failures against how many it holds, so a small, sharp cause (one bad host among
    hundreds) comes before a broad combination that merely holds several of them. None: each
    entry point's own (``analyze``: explained; ``analyze_fleet``: likelihood)."""
    kpi_risk: float = 0.4
    """KPI mode: an element is a cause when its risk (purity of deviating leaves minus the
    misfit of the ripple effect) reaches this; see ``kpi_search``."""
    kpi_min_ep: float = 0.02
    """KPI mode: a cause must explain at least this share of the abnormal deviation, and the
    search stops when less is left unexplained."""
    kpi_trim: int = 5
    """KPI mode: the forecast-noise cut is the deviation of the leaf this many places in from
    the extreme on the side opposite the anomaly (outliers trimmed)."""
    kpi_max_depth: int | None = None
    """KPI mode: most attributes in one cause; every attribute when omitted."""
    kpi_merge: float = 0.6
    """KPI mode, additive KPI: causes under one ancestor merge into it when it explains as much
    and the rest of its leaves moved the deviation's way with at least this balance (0..1)."""
    kpi_merge_ratio: float = 0.3
    """KPI mode, ratio KPI: the same merge bar (a ratio's small leaves are noisy, so a broad
    cause's leaves fail the risk bar one by one more often). Chosen by best mean F1 over the
    training sets S-7301, L-7302, RS-A (0.3 / 0.4 / 0.5: 0.786 / 0.782 / 0.778)."""
    id_share: float = 0.02
    """A column whose distinct values exceed this share of the rows (and ``id_min_distinct``) is
    ID-like and dropped, as in the FDA paper's variability filter."""
    id_min_distinct: int = 100
    """Columns with at most this many distinct values are never treated as IDs."""
    max_values: int = 64
    """Numeric columns with more distinct values are bucketed; categorical ones get rare values
    folded into ``other``."""
    buckets: int = 5
    """Number of quantile buckets for numeric columns."""
    rare_share: float = 0.001
    """A value of a high-cardinality column is folded into ``other`` when it covers less than this
    share of the rows and too few failures to ever reach ``min_support``."""
    exclude: tuple[str, ...] = ()
    """Columns never analysed (besides the label, weight and KPI columns)."""
    keep: tuple[str, ...] = ()
    """Columns never dropped as ID-like nor folded."""
    hierarchies: tuple[tuple[str, ...], ...] = ()
    """Nested columns, coarsest first (``("region", "rack", "host")``): an item-set never holds two
    levels of one hierarchy, and a coarse finding explained by a finer one is pruned."""
    memory_limit: str | None = None
    """DuckDB memory limit (``"4GB"``); beyond it aggregation spills to ``temp_directory``."""
    temp_directory: str | None = None
    """Where DuckDB spills; a fresh temporary folder when omitted."""
    threads: int | None = None
    """DuckDB worker threads; all cores when omitted."""
    example_rows: int = 5
    """Example rows kept per finding for the HTML report."""
    tuning: EngineTuning = field(default_factory=EngineTuning)
    """Batch, buffer and cache sizes of the engines (memory and speed, never the findings)."""

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, want: str) -> None:
            if not ok:
                raise ConfigError(f"{name}={getattr(self, name)!r}: expected {want}")

        check(0.0 < self.min_support <= 1.0, "min_support", "a share in (0, 1]")
        check(1 <= self.max_len <= 8, "max_len", "an integer from 1 to 8")
        check(self.min_lift >= 1.0, "min_lift", "a number >= 1")
        check(self.min_lift_gain >= 1.0, "min_lift_gain", "a number >= 1")
        check(0.0 < self.simpler <= 1.0, "simpler", "a share in (0, 1]")
        check(0.5 <= self.confidence < 1.0, "confidence", "a level in [0.5, 1)")
        check(0.0 < self.alpha < 1.0, "alpha", "a level in (0, 1)")
        check(self.max_findings >= 1, "max_findings", "at least 1")
        check(0.0 < self.coverage <= 1.0, "coverage", "a share in (0, 1]")
        check(0.0 <= self.min_gain < 1.0, "min_gain", "a share in [0, 1)")
        check(
            self.rank_by in (None, "explained", "likelihood"),
            "rank_by",
            "None, 'explained' or 'likelihood'",
        )
        check(self.kpi_risk <= 1.0, "kpi_risk", "a number <= 1")
        check(0.0 <= self.kpi_min_ep < 1.0, "kpi_min_ep", "a share in [0, 1)")
        check(self.kpi_trim >= 0, "kpi_trim", "0 or more")
        check(self.kpi_merge > 0, "kpi_merge", "a balance in (0, 1] (above 1: never merge)")
        check(self.kpi_merge_ratio > 0, "kpi_merge_ratio", "a balance in (0, 1]")
        check(
            self.kpi_max_depth is None or self.kpi_max_depth >= 1,
            "kpi_max_depth",
            "None or at least 1",
        )
        check(0.0 < self.id_share <= 1.0, "id_share", "a share in (0, 1]")
        check(self.max_values >= 2, "max_values", "at least 2")
        check(2 <= self.buckets <= 50, "buckets", "2 to 50")
        check(0.0 <= self.rare_share < 1.0, "rare_share", "a share in [0, 1)")
        check(self.example_rows >= 0, "example_rows", "0 or more")
        check(isinstance(self.tuning, EngineTuning), "tuning", "an EngineTuning")
        check(
            self.memory_limit is None or parse_bytes(str(self.memory_limit)) is not None,
            "memory_limit",
            "a size such as '4GB' or '512MiB' (digits, a unit; it reaches DuckDB's SET)",
        )
        object.__setattr__(self, "exclude", _names(self.exclude, "exclude"))
        object.__setattr__(self, "keep", _names(self.keep, "keep"))
        hier = tuple(_names(h, "hierarchies") for h in self.hierarchies)
        for h in hier:
            if len(h) < 2:
                raise ConfigError(f"hierarchies: {h!r} needs at least two columns, coarsest first")
        object.__setattr__(self, "hierarchies", hier)


def _names(value: Sequence[str] | str, what: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    out = tuple(value)
    if not all(isinstance(v, str) for v in out):
        raise ConfigError(f"{what}: expected column names, got {out!r}")
    return out
