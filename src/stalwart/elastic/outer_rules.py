"""Buffered DiLoCo's settings (:class:`Buffered`), outer update rule for ``k < N``, weights.

With ``k`` of ``N`` members per version, a version is a *fraction* of a synchronous round,
and versions come ``N / k`` times as often as rounds. Applying DiLoCo's outer Nesterov step
(lr 0.7, momentum 0.9) to every version, as synchronous DiLoCo does to every round, takes
``N / k`` times the step per sample and lets stale pseudo-gradients ride the momentum: on
our task it diverged (held-out loss 7.5 after 20 versions).

**Delayed Nesterov** (after Liu et al., "Asynchronous Local-SGD Training for Language
Modeling", arXiv 2401.09135). Version ``v`` is made of ``n_v`` contributions of ``N``
members, so it carries the *mass* ``μ_v = n_v / N`` of a round; its combined pseudo-gradient
``Δ_v`` is accumulated, ``A += μ_v Δ_v``, ``M += μ_v``. While ``M < 1`` the version is a
momentum-free step ``θ -= lr · μ_v Δ_v``. The version that completes a round (``M >= 1``)
updates the momentum once with the round's average and takes the Nesterov step; the part of
``μ_v`` beyond a round (``e = M - 1``) is carried into the next one::

    m = β m + (A - e Δ_v) / (M - e)
    θ -= lr · (μ_v Δ_v + β m)
    A, M = e Δ_v, e

so every contribution enters exactly one momentum update, and there is one momentum update
per ``N`` contributions (for ``k = 2`` of 3: after versions 2, 3, 5, 6, ...). A fast member
can post two phases into one buffer, so a version may hold more than ``N`` contributions
(``μ_v > 1``); the update then repeats while ``M >= 1``, each round it ends adding its
``β m`` to the step.

So per round the gradient is applied once (in pieces, as it arrives) and the momentum is
updated and applied once, as in synchronous DiLoCo; with ``μ_v = 1`` for every version this
*is* torch's ``SGD(nesterov=True)`` step (a test checks it bit for bit), which is why
``k = N`` keeps the per-version rule. The momentum buffer lives in the outer optimizer's
state (``momentum_buffer``, covered by the job's digest); ``A`` and ``M`` travel with each
version's record.

**Stale phases are restated** (by :class:`~stalwart.elastic.async_outer.AsyncOuter`, before
posting): a phase that started from version ``b`` and is posted to buffer ``v > b``
contributes ``θ_v - θ_local = Δ - (θ_b - θ_v)`` instead of ``Δ = θ_b - θ_local``: its
displacement less what the model already moved since ``b`` (mostly the same direction, made
by the members that reported first); applying the raw ``Δ`` again overshoots. Delayed
momentum without restating still diverged on our task with 2 of 3 members.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from stalwart.errors import ConfigError

__all__ = ["Buffered", "Pending", "assign_h", "combine", "delayed_nesterov"]


@dataclass(frozen=True, kw_only=True)
class Buffered:
    """Asynchronous DiLoCo: an outer step once ``k`` of the members' pseudo-gradients arrived.

    Attributes:
        k: contributions per outer step (None: one less than the members, at least 1).
        staleness: contributions more than this many versions old are dropped.
        compute_aware: assign fewer inner steps to slower members (None: only when ``k`` equals
            the members; below, the ``k`` fastest already go ahead, and equal phase times
            would leave one member out of every buffer, stale by one version).
        h_min: the fewest inner steps a member is assigned.
        rule: the outer update: ``"auto"`` (delayed Nesterov when ``k`` is below the members,
            the outer optimizer's own step per version otherwise), ``"delayed"`` or
            ``"per-version"`` (always one or the other).
    """

    k: int | None = None
    staleness: int = 2
    compute_aware: bool | None = None
    h_min: int = 1
    rule: str = "auto"

    def __post_init__(self) -> None:
        if (self.k is not None and self.k < 1) or self.staleness < 0 or self.h_min < 1:
            raise ConfigError(f"{self}: need k >= 1, staleness >= 0 and h_min >= 1")
        if self.rule not in ("auto", "delayed", "per-version"):
            raise ConfigError(f"{self}: rule must be 'auto', 'delayed' or 'per-version'")

    def compute_aware_for(self, members: int) -> bool:
        """Whether members take the assigned inner steps with ``members`` members."""
        on = self.k_for(members) >= members
        return self.compute_aware if self.compute_aware is not None else on

    def delayed(self, members: int) -> bool:
        """Whether versions take the delayed Nesterov step with ``members`` members."""
        auto = self.k_for(members) < members
        return self.rule == "delayed" or (self.rule == "auto" and auto)

    def k_for(self, members: int) -> int:
        """Contributions per outer step with ``members`` members."""
        want = self.k if self.k is not None else members - 1
        return max(1, min(want, members))


def combine(
    parts: list[dict[str, Any]], version: int, h: int
) -> tuple[list[torch.Tensor], list[float]]:
    """The weighted pseudo-gradient of buffer ``version`` (see :mod:`stalwart.elastic.async_outer`).

    Returns:
        Δ per parameter (float64 accumulation, the inputs' dtype), and each part's weight
        ``w_i / Σ w`` as a fraction of the whole.
    """
    disc = [(1.0 + version - p["base"]) ** -0.5 for p in parts]
    total = sum(d * p["h"] for d, p in zip(disc, parts, strict=True))
    out = []
    for j in range(len(parts[0]["deltas"])):
        acc = torch.zeros_like(parts[0]["deltas"][j], dtype=torch.float64)
        for d, p in zip(disc, parts, strict=True):
            acc += d * p["deltas"][j].to(torch.float64)
        out.append((acc * (h / total)).to(parts[0]["deltas"][j].dtype))
    return out, [d * p["h"] / total for d, p in zip(disc, parts, strict=True)]


def assign_h(rates: dict[int, float], h: int, h_min: int) -> dict[int, int]:
    """Inner steps per worker so that each phase takes about ``h`` steps of the median worker.

    Reference is the median rate, not the fastest, so that timing noise among equally fast
    members does not cut their phases (a member at or under the median keeps ``h``).
    """
    if not rates:
        return {}
    typical = statistics.median(rates.values())
    return {w: max(h_min, min(h, round(h * typical / max(r, 1e-12)))) for w, r in rates.items()}


@dataclass
class Pending:
    """The round in progress: accumulated ``Σ μ_v Δ_v`` and its mass ``Σ μ_v``."""

    acc: list[torch.Tensor] | None = None
    mass: float = 0.0
    rounds: int = field(default=0)  # momentum updates so far

    def state_dict(self) -> dict[str, object]:
        """Plain data for a version's record."""
        return {"acc": self.acc, "mass": self.mass, "rounds": self.rounds}

    @classmethod
    def from_state(cls, state: dict[str, object] | None) -> Pending:
        """The inverse of :meth:`state_dict` (None: an empty round)."""
        if not state:
            return cls()
        return cls(acc=state["acc"], mass=float(state["mass"]), rounds=int(state["rounds"]))  # type: ignore[arg-type]  # written by state_dict


@torch.no_grad()
def delayed_nesterov(
    params: Sequence[torch.Tensor],
    delta: Sequence[torch.Tensor],
    momentum_bufs: list[torch.Tensor | None],
    pending: Pending,
    *,
    mass: float,
    lr: float,
    beta: float,
) -> int:
    """One version's outer step by the delayed Nesterov rule (module docstring), in place.

    Args:
        params: the global parameters (updated in place).
        delta: the version's combined pseudo-gradient, one tensor per parameter.
        momentum_bufs: the momentum per parameter (None: zero); replaced in place when a
            round completes.
        pending: the round in progress (updated in place).
        mass: the version's fraction of a round, ``used contributions / members`` (> 0;
            above 1 when a member posted two phases into one buffer).
        lr: the outer learning rate.
        beta: the outer momentum.

    Returns:
        How many rounds this version completed (momentum updates): 0 or 1, more when a
        version holds more than ``N`` contributions (a member that posted twice).
    """
    if pending.acc is None:
        pending.acc = [torch.zeros_like(d, dtype=torch.float64) for d in delta]
    for a, d in zip(pending.acc, delta, strict=True):
        a.add_(d.to(torch.float64), alpha=mass)
    pending.mass += mass
    steps = [d * mass if mass != 1.0 else d.clone() for d in delta]
    rounds = 0
    while pending.mass >= 1.0 - 1e-9:  # more than once for a version of > N contributions
        excess = max(0.0, pending.mass - 1.0)  # carried into the next round
        for j, d in enumerate(delta):
            spill = d.to(torch.float64) * excess
            avg = ((pending.acc[j] - spill) / (pending.mass - excess)).to(d.dtype)
            buf = momentum_bufs[j]
            buf = avg.clone() if buf is None else buf.mul_(beta).add_(avg)
            momentum_bufs[j] = buf
            steps[j] = steps[j].add(buf, alpha=beta)
            pending.acc[j] = spill
        pending.mass, rounds = excess, rounds + 1
    for p, step in zip(params, steps, strict=True):
        p.add_(step, alpha=-lr)
    if rounds:
        if pending.mass <= 1e-9:
            pending.acc, pending.mass = None, 0.0
        pending.rounds += rounds
    return rounds
