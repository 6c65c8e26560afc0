"""Measure protections on the same replayed fault list (paired), and under bit-error rates.

:func:`evaluate` replays one fault list against the unprotected model and under each
protection, and reports failures, what the protection fixed and broke (McNemar), the share
of failures it recovered, its runtime overhead (median forward time ratio) and its static
cost. :func:`ber_sweep` gives a quality metric (accuracy, AUC) against the bit-error rate,
with and without each protection, on the same corrupted bits.

Protections that learn from data (clipping bounds, ABFT thresholds) must be calibrated on
inputs they are not scored on: :func:`split_inputs` draws a held-out calibration split and a
disjoint evaluation split from one batch of inputs.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from stalwart.errors import ConfigError, require
from stalwart.frames import ArrowFrames
from stalwart.inject import Fault, apply_faults
from stalwart.inject.bits import layout_of
from stalwart.inject.error_models import draw_ber
from stalwart.inject.targets import Pattern, select_tensors
from stalwart.notebook import render_table
from stalwart.protect.base import Protection, row_fingerprints
from stalwart.vulnerability import FaultList, criterion, run_campaign
from stalwart.vulnerability.campaign import check_eval
from stalwart.vulnerability.stats import mcnemar

__all__ = [
    "InputSplit",
    "ProtectionResult",
    "ProtectionResults",
    "ber_faults",
    "ber_sweep",
    "evaluate",
    "forward_time",
    "split_inputs",
]


def _check_held_out(protections: Sequence[Protection], inputs: Sequence[Any]) -> None:
    """Refuse a protection calibrated on any of the inputs it is about to be scored on."""
    scored = row_fingerprints(inputs)
    for p in protections:
        shared = len(getattr(p, "calibration_rows", frozenset()) & scored)
        if shared:
            raise ConfigError(
                f"protection {p.name!r} was calibrated on {shared} of the {len(scored)} inputs "
                "it would be scored on; calibrate on held-out inputs (split_inputs) or pass "
                "in_sample=True to report an in-sample result"
            )


@dataclass(frozen=True)
class InputSplit:
    """Disjoint calibration and evaluation inputs drawn from one batch (rows of dim 0)."""

    calibration: tuple[Any, ...]
    evaluation: tuple[Any, ...]
    labels: torch.Tensor | None
    """Labels of the evaluation rows (None when none were given)."""
    calibration_index: torch.Tensor
    evaluation_index: torch.Tensor
    seed: int


def split_inputs(
    inputs: Sequence[Any],
    labels: torch.Tensor | None = None,
    calibration_fraction: float = 0.5,
    *,
    seed: int = 0,
) -> InputSplit:
    """Split the rows of ``inputs`` (and ``labels``) into calibration and evaluation sets.

    Every input tensor is indexed along dim 0, which must be the same batch of samples for
    all of them; the rows are shuffled with ``seed`` and the first ``calibration_fraction``
    go to calibration. Each row lands in exactly one set.

    Raises:
        ConfigError: the fraction is not in (0, 1), the inputs do not share a batch
            dimension, or one of the two sets would be empty.
    """
    if not 0.0 < calibration_fraction < 1.0:
        raise ConfigError(
            f"calibration fraction {calibration_fraction} is outside (0, 1); "
            "pass e.g. 0.5 to calibrate on half of the inputs and score on the other half"
        )
    sizes = {x.shape[0] for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0}
    if len(sizes) != 1 or any(not isinstance(x, torch.Tensor) for x in inputs):
        raise ConfigError(
            f"cannot split inputs into samples: expected tensors sharing dim 0, got first "
            f"dims {sorted(sizes)}; calibrate on separate clean inputs instead"
        )
    n = sizes.pop()
    n_cal = round(n * calibration_fraction)
    if not 0 < n_cal < n:
        raise ConfigError(
            f"{n} samples at calibration fraction {calibration_fraction} leave an empty "
            "calibration or evaluation set; use more inputs or a fraction nearer 0.5"
        )
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    cal, ev = perm[:n_cal].sort().values, perm[n_cal:].sort().values
    return InputSplit(
        tuple(x[cal] for x in inputs),
        tuple(x[ev] for x in inputs),
        labels[ev] if labels is not None and len(labels) == n else None,
        cal,
        ev,
        seed,
    )


@dataclass
class ProtectionResult:
    """One protection on one replayed fault list."""

    name: str
    trials: int
    failures: int
    baseline_failures: int
    fixed: int
    broken: int
    p_value: float
    recovered: float
    """Share of the unprotected failures that the protection removed (net of broken)."""
    overhead: float
    """Median CPU time of a forward (one thread) with the protection over without, minus 1
    (0.1 = +10 %); NaN for a modelled protection (nothing of it runs to be timed)."""
    cost: dict[str, float] = field(default_factory=dict)
    method: str = "measured"
    """How the result was obtained (measured on the faulty model, and how)."""
    basis: str = "measured"
    """``measured``: the mechanism runs (its redundancy is stored, its check is timed);
    ``modelled``: simulated, runtime not measured."""
    false_alarm_rate: float = 0.0
    """Share of the clean scored inputs the detector flags (storage checks: of clean checks)."""
    overhead_s: float = 0.0
    """Median CPU seconds the protection adds to one forward over the scored inputs (NaN
    when modelled)."""


class ProtectionResults(list[ProtectionResult], ArrowFrames):
    """What :func:`evaluate` returns: a plain list of results, one per protection, that also
    converts to a table and renders in notebooks."""

    def to_arrow(self) -> Any:
        """One row per protection: the result's fields, ``cost`` spread over ``cost_<key>``
        columns (NULL where a protection does not report that cost)."""
        pa = require("pyarrow", "sdc", "ProtectionResults.to_arrow")

        names = [f.name for f in dataclasses.fields(ProtectionResult) if f.name != "cost"]
        cols: dict[str, list[Any]] = {n: [getattr(r, n) for r in self] for n in names}
        for key in dict.fromkeys(k for r in self for k in r.cost):
            cols[f"cost_{key}"] = [r.cost.get(key) for r in self]
        return pa.table(cols)

    def _repr_html_(self) -> str:
        """Jupyter's rendering: one row per protection."""
        trials = self[0].trials if self else 0
        base = self[0].baseline_failures if self else 0
        summary = (
            f"{len(self)} protection(s) on {trials} replayed faults ({base} unprotected failures)"
        )
        table = self.to_arrow()
        keep = ["name", "basis", "failures", "fixed", "broken", "recovered", "overhead"]
        keep += ["false_alarm_rate", "method"]
        return render_table("Protection results", summary, table.select(keep), more="protection(s)")


def forward_time(
    model: nn.Module,
    inputs: Sequence[Any],
    repeats: int = 7,
    extra: Callable[[], None] | None = None,
    *,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Median seconds of one forward pass (plus ``extra``, e.g. a scrub), by ``clock``."""
    times = []
    with torch.no_grad():
        model(*inputs)
        for _ in range(repeats):
            t0 = clock()
            if extra is not None:
                extra()
            model(*inputs)
            times.append(clock() - t0)
    return statistics.median(times)


def _judge(crit: Any, golden: torch.Tensor, out: torch.Tensor) -> bool:
    return bool(crit.judge(golden, out.unsqueeze(0)).any())


def _replay(
    model: nn.Module,
    inputs: tuple[Any, ...],
    faults: FaultList,
    p: Protection,
    crit: Any,
    golden: torch.Tensor,
    repeats: int,
) -> tuple[np.ndarray, float, float]:
    """Outcome per fault under ``p``, and the median forward seconds with and without it."""
    after = np.zeros(len(faults), bool)
    with p.attach(model), torch.no_grad():
        for i, f in enumerate(p.filter(model, faults)):
            with apply_faults(model, [f]):
                p.after_fault(model)
                after[i] = _judge(crit, golden, model(*inputs))
    extra = p.scrub if hasattr(p, "scrub") else None
    prot: list[float] = []
    plain: list[float] = []
    # CPU time of this thread, with one intra-op thread, interleaved: on a shared machine
    # wall time mostly measures the scheduler, and process time counts other threads too.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(repeats):
            with p.attach(model):
                prot.append(forward_time(model, inputs, 1, extra, clock=time.thread_time))
            plain.append(forward_time(model, inputs, 1, clock=time.thread_time))
    finally:
        torch.set_num_threads(threads)
    return after, statistics.median(prot), statistics.median(plain)


def evaluate(
    model: nn.Module,
    inputs: Sequence[Any],
    faults: FaultList,
    protections: Sequence[Protection],
    criterion_: str = "top1",
    *,
    labels: torch.Tensor | None = None,
    repeats: int = 7,
    in_sample: bool = False,
) -> ProtectionResults:
    """Replay ``faults`` with no protection and under each protection (paired).

    Args:
        in_sample: allow protections calibrated on some of ``inputs`` (clipping bounds,
            ABFT thresholds); by default that is refused, as it overstates their benefit.

    Raises:
        ConfigError: a protection was calibrated on some of ``inputs`` and not ``in_sample``.
    """
    check_eval(model)
    inputs = tuple(inputs)
    if not in_sample:
        _check_held_out(protections, inputs)
    base = run_campaign(model, inputs, faults, criterion_, labels=labels)
    crit = criterion(criterion_, labels)
    before = base.failed[crit.name]
    with torch.no_grad():
        golden = model(*inputs)
    out = ProtectionResults()
    for p in protections:
        alarms = p.false_alarms(model, inputs) if hasattr(p, "false_alarms") else float("nan")
        after, t_prot, t_plain = _replay(model, inputs, faults, p, crit, golden, repeats)
        fixed, broken, pval = mcnemar(before.tolist(), after.tolist())
        k0 = int(before.sum())
        basis = getattr(p, "basis", "measured")
        nan = float("nan")
        out.append(
            ProtectionResult(
                p.name,
                len(faults),
                int(after.sum()),
                k0,
                fixed,
                broken,
                pval,
                (fixed - broken) / k0 if k0 else 0.0,
                t_prot / t_plain - 1 if basis == "measured" else nan,
                p.cost(model),
                getattr(p, "method", "measured"),
                basis,
                alarms,
                t_prot - t_plain if basis == "measured" else nan,
            )
        )
    return out


def ber_faults(
    model: nn.Module, rate: float, *, seed: int = 0, pattern: Pattern = "*"
) -> FaultList:
    """Every stored bit of the matching parameters flips with probability ``rate``."""
    rng = np.random.default_rng(seed)
    faults: list[Fault] = []
    for name, t in select_tensors(model, pattern).items():
        idx, masks = draw_ber(layout_of(t.dtype, name), t.numel(), rate, rng)
        faults += [Fault(name, int(i), m) for i, m in zip(idx, masks, strict=True)]
    return FaultList(faults, seed, f"ber={rate:g}")


def ber_sweep(
    model: nn.Module,
    metric: Callable[[nn.Module], float],
    rates: Sequence[float],
    protections: Sequence[Protection] = (),
    *,
    repeats: int = 3,
    seed: int = 0,
    pattern: Pattern = "*",
) -> dict[str, dict[float, list[float]]]:
    """``metric(model)`` per rate and repeat, unprotected (``"none"``) and per protection.

    Every protection sees the same corrupted bits for a given (rate, repeat).
    """
    check_eval(model)
    result: dict[str, dict[float, list[float]]] = {"none": {}}
    result.update({p.name: {} for p in protections})
    cases: Mapping[str, Protection | None] = {"none": None} | {p.name: p for p in protections}
    for rate in rates:
        for r in range(repeats):
            faults = ber_faults(model, rate, seed=seed + r, pattern=pattern)
            for name, p in cases.items():
                replay = p.filter(model, faults) if p is not None else faults
                ctx = p.attach(model) if p is not None else torch.no_grad()
                with ctx, apply_faults(model, replay):
                    if p is not None:
                        p.after_fault(model)
                    value = metric(model)
                result[name].setdefault(rate, []).append(value)
    return result
