"""``bench/plan_validate.py``'s interval and rollback tables.

The interval table sets 1x against 0.5x and 2x, paired by seed; a sweep may run the
recommendation and one neighbour only (more seeds where the question is open), and the table
then pairs what it has and says nothing of the missing side. The rollback table sets the steps
each resume from the durable tier redid beside the model's expectation.
"""

from __future__ import annotations

import pytest

from bench.plan_validate import report_intervals, report_rollbacks, rollbacks_lost_steps


def _run(config: str, seed: int, measured: float, every: int) -> dict[str, object]:
    return {"config": config, "seed": seed, "measured": measured, "model_realised": 0.6,
            "model_trace": measured, "every": every, "load": 1.0}  # fmt: skip


def test_a_sweep_of_1x_and_2x_only_is_paired_by_seed(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [_run("stall", s, 0.70 + 0.01 * s, 16) for s in range(3)]
    rows += [_run("stall-double", s, 0.68, 32) for s in range(3)]
    rows.append(_run("stall-double", 9, 0.5, 32))  # no 1x run of seed 9: left out of the pairs
    report_intervals(rows)
    out = capsys.readouterr().out
    assert "every 16/32 steps" in out
    assert "1x - 2x, paired by seed: +3.0 pp" in out  # (2 + 3 + 4) / 3 points ahead
    assert "3 of 3 seeds > 0" in out
    assert "0.5x," not in out and "best in" not in out


def test_a_full_trio_counts_the_seeds_where_1x_beats_both(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = []
    for s, (half, one, double) in enumerate([(0.6, 0.7, 0.65), (0.6, 0.62, 0.66)]):
        rows += [_run("stall-half", s, half, 8), _run("stall", s, one, 16),
                 _run("stall-double", s, double, 32)]  # fmt: skip
    report_intervals(rows)
    out = capsys.readouterr().out
    assert "1x best in 1 of 2 seeds" in out
    assert "1x - 0.5x, paired by seed: +6.0 pp" in out
    assert "1x - 2x, paired by seed: +0.5 pp" in out


def test_a_resume_logged_by_every_member_counts_once() -> None:
    run = {"events": [
        {"kind": "resumed", "tier": "durable", "step": 64, "last_known": 88, "steps_lost": 24},
        {"kind": "resumed", "tier": "durable", "step": 64, "last_known": 88, "steps_lost": 24},
        {"kind": "step", "step": 65},
        {"kind": "resumed", "tier": "durable", "step": 64, "last_known": 94, "steps_lost": 30},
        {"kind": "resumed", "tier": "peer", "step": 96, "last_known": 97, "steps_lost": 1},
    ]}  # fmt: skip
    assert sorted(rollbacks_lost_steps(run)) == [24, 30]


def test_the_rollback_table_sets_the_runs_losses_beside_the_models(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = [{**_run("stall-double", s, 0.6, 32), "rollbacks_lost_steps": lost,
             "model_lost_steps": 14.0} for s, lost in enumerate([[0, 10], [20]])]  # fmt: skip
    rows.append(_run("stall", 0, 0.6, 16))  # scored before the table existed: left out
    report_rollbacks(rows)
    out = capsys.readouterr().out
    assert "| stall-double | 32 | 3 | 10.0 ± 5.8 | 14.0 |" in out
    assert "| stall |" not in out
