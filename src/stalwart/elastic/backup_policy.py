"""How many contributions a backup-worker step waits for: a static count or :class:`Dynamic`.

:class:`Dynamic` (after Xu et al., arXiv 2004.14696) picks the ``k`` of the next step that
maximises the expected training progress per second,

    rate(k) = progress(k) / (T(k) + c),

with ``T(k)`` the time until the ``k``-th contribution arrives (the median over recent steps
of each step's ``k``-th smallest compute time), ``c`` the commit's own cost (the median over
recent steps of the interval between results minus the slowest used contribution's time) and
``progress(k) = k / (k + phi)`` the progress of one step with ``k`` members' gradients
relative to an exact gradient, where ``phi`` is the gradient noise scale in units of one
member's batch (McCandlish et al., "An Empirical Model of Large-Batch Training", arXiv
1812.06162): ``phi = tr(S) / |G|^2`` with ``S`` the covariance of one member's gradient and
``G`` the true gradient, both estimated from the ``k`` contributions a step already has
(:func:`noise_scale`). Noisy gradients (large ``phi``) make ``progress`` grow with ``k``
(every contribution counts, the contributions-per-second rule); clean ones make a step worth
the same whatever ``k`` (only the step rate counts). Unknown ``phi`` counts as
noise-dominated. Before the commit's cost is measured (an epoch's first step), ``k = n``
(``n - 1`` with partial contributions, never below ``min_k``).

**Partial contributions** (``partial=True``, after DropCompute, Giladi et al., arXiv
2306.10598): the members still computing when the ``k``-th contribution arrives stop at their
next micro-batch and send what they have, weighted by the share they computed (see
:mod:`stalwart.elastic.backup`). Then a smaller ``k`` loses less: ``progress`` counts each
slower member's share ``T(k) / t_i`` of its batch, less what stopping at a micro-batch
boundary loses (``boundary``), instead of nothing.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from stalwart.errors import ConfigError

__all__ = ["Dynamic", "Static", "backup_count", "noise_scale"]


@dataclass(frozen=True)
class Static:
    """A fixed number of backup workers ``b`` (``backup=b`` is ``Static(b)``).

    Attributes:
        b: commit each step once ``n - b`` members' full contributions arrived.
        partial: the others send the micro-batches they finished (``optimizer.accumulate``)
            instead of nothing; the reducer waits for them at most ``grace`` times the median
            step interval.
        grace: see ``partial``.
    """

    b: int
    partial: bool = False
    grace: float = 0.5

    def __post_init__(self) -> None:
        if self.b < 0 or self.grace < 0:
            raise ConfigError(f"{self}: the number of backup workers and grace must be >= 0")


@dataclass(frozen=True, kw_only=True)
class Dynamic:
    """Choose the number of backup workers online from the members' compute times.

    Attributes:
        window: steps of compute-time history per member (medians over it).
        margin: a smaller ``k`` is chosen only if it gives this much more progress/s.
        min_k: never commit with fewer contributions than this.
        partial: late members send the micro-batches they finished (see :class:`Static`).
        grace: how long the reducer waits for partial contributions, in step intervals.
        boundary: with ``partial``, the share of a batch a slower member is expected to lose
            by stopping at a micro-batch boundary (a quarter: one of 4 micro-batches, or half
            of one of 2); without it, two members with close times made ``k - 1`` look as
            good as ``k`` and the second one's last micro-batch was lost.
    """

    window: int = 10
    margin: float = 0.1
    min_k: int = 1
    partial: bool = False
    grace: float = 0.5
    boundary: float = 0.25

    def __post_init__(self) -> None:
        if self.window < 1 or self.margin < 0 or self.min_k < 1 or self.grace < 0:
            raise ConfigError(f"{self}: window and min_k must be >= 1, margin and grace >= 0")

    def choose(
        self, steps: Sequence[Mapping[int, float]], size: int, *, cost: float = 0.0,
        noise: float | None = None,
    ) -> int:  # fmt: skip
        """The ``k`` for the next step, given recent steps' compute times (rank -> seconds).

        ``T(k)`` is the median over the steps of the ``k``-th smallest time of each step (a
        member not measured in a step counts as slower than all measured), so a fixed slow
        member and a different slow member every step are handled alike. ``cost``: the
        commit's own seconds per step; ``noise``: the gradient noise scale ``phi`` (None:
        unknown, taken as noise-dominated).
        """
        if not steps:
            return size  # nothing measured yet: wait for all
        ordered = [sorted(t.values()) + [math.inf] * (size - len(t)) for t in steps]
        t_k = [statistics.median(o[k - 1] for o in ordered) for k in range(1, size + 1)]
        lost = self.boundary  # a share stops at a micro-batch boundary: less than T(k)/t_i
        share = [statistics.median(k + sum(max(0.0, min(1.0, o[k - 1] / t) - lost) for t in o[k:])
                                   for o in ordered) if self.partial else k
                 for k in range(1, size + 1)]  # fmt: skip

        def rate(k: int) -> float:
            eff = share[k - 1]
            gain = eff if noise is None or not math.isfinite(noise) else eff / (eff + noise)
            return gain / max(t_k[k - 1] + cost, 1e-9)

        best, rate_best = size, rate(size)
        for k in range(size - 1, self.min_k - 1, -1):
            if rate(k) > rate_best * (1.0 + self.margin):
                best, rate_best = k, rate(k)
        return best


def backup_count(backup: int | Static | Dynamic | None, size: int) -> int:
    """The first step's ``k`` for a world of ``size`` (a static ``b`` gives ``size - b``).

    :class:`Dynamic` starts at ``size`` (nothing measured yet), or ``size - 1`` with partial
    contributions (never below its ``min_k``, never above ``size``): then a late member's work
    is sent, not lost, and waiting for the slowest costs the most (measured: an epoch's first
    two steps at ``k = n`` were its whole lag behind the best static ``b``).
    """
    if backup is None:
        return size
    if isinstance(backup, Dynamic):
        return min(size, max(backup.min_k, size - 1, 1)) if backup.partial else size
    return max(1, size - (backup.b if isinstance(backup, Static) else backup))


def noise_scale(parts: Sequence[Sequence[torch.Tensor]], mean: Sequence[torch.Tensor]) -> float:
    """``phi = tr(S) / |G|^2`` from ``k >= 2`` members' gradients and their mean (nan if k < 2).

    ``tr(S)`` is estimated by the members' spread around the mean, ``sum |g_i - m|^2 / (k-1)``,
    and ``|G|^2`` by ``|m|^2 - tr(S) / k`` (both unbiased; McCandlish et al., appendix A);
    ``inf`` when the second estimate is not positive (noise swamps the signal).
    """
    k = len(parts)
    if k < 2:
        return math.nan
    spread = sum(
        float((g.double() - m.double()).pow(2).sum()) for part in parts
        for g, m in zip(part, mean, strict=True)
    ) / (k - 1)  # fmt: skip
    signal = sum(float(m.double().pow(2).sum()) for m in mean) - spread / k
    return spread / signal if signal > 0 else math.inf
