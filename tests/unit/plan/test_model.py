"""The planner: intervals, strategies compared, the result's renderings."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from stalwart.errors import ConfigError
from stalwart.plan import PlanInputs, Strategy, optimal_interval, plan
from stalwart.plan.ladder import RungCosts, rates_per_s
from stalwart.plan.model import analytic, landing_rates, recommend_intervals

SMALL = {"failures": 200, "replications": 4}


def test_checkpoint_restart_saves_at_the_exact_optimum() -> None:
    inputs = PlanInputs()
    costs = RungCosts.of(inputs, Strategy.CHECKPOINT_RESTART)
    best = optimal_interval(costs.save_s["remote"], sum(rates_per_s(inputs).values()))
    step = inputs.job.step_s
    got = recommend_intervals(inputs, Strategy.CHECKPOINT_RESTART)["remote"]
    assert abs(got - best) <= step / 2 and got / step == round(got / step)


def test_tiers_nobody_lands_on_save_at_the_cap_on_the_faster_grid() -> None:
    inputs = PlanInputs()  # 128 live replicas: single failures never reach disk or remote
    land = landing_rates(inputs, Strategy.LADDER)
    assert land["disk"] == land["remote"] == 0 and land["peer"] > 0
    got = recommend_intervals(inputs, Strategy.LADDER)
    cap = inputs.tiers.remote.interval_cap_s
    assert got["memory"] < got["disk"] <= cap and got["disk"] % got["memory"] == 0


def test_an_interval_the_user_sets_is_kept() -> None:
    inputs = PlanInputs().replace(**{"tiers.disk.interval_s": 600.0, "job.step_s": 1.0})
    assert recommend_intervals(inputs, Strategy.NO_MEMORY)["disk"] == 600.0


def test_an_interval_is_never_shorter_than_the_write_it_waits_for() -> None:
    inputs = PlanInputs().replace(**{"tiers.remote.write_gbps": 0.001, "job.step_s": 1.0})
    lag = RungCosts.of(inputs, Strategy.CHECKPOINT_RESTART).lag_s["remote"]
    assert recommend_intervals(inputs, Strategy.CHECKPOINT_RESTART)["remote"] >= lag


def test_the_closed_form_is_exact_only_where_it_is() -> None:
    blocking = PlanInputs().replace(**{"tiers.remote.write_gbps": 1e15})
    cr = Strategy.CHECKPOINT_RESTART
    assert analytic(blocking, cr, recommend_intervals(blocking, cr)).method.startswith("exact")
    assert analytic(PlanInputs(), cr, {"remote": 300.0}).method == "first order"


def test_plan_compares_the_strategies_and_renders() -> None:
    result = plan(PlanInputs().replace(**{"job.group_size": 16_384}), **SMALL)
    by = {p.strategy: p for p in result.plans}
    assert list(by) == [s.value for s in Strategy]
    cr, no_mem, ladder = (by[s.value] for s in Strategy)
    assert cr.ettr < no_mem.ettr < ladder.ettr  # modelled; no live replica to heal from
    assert ladder.lost_work_s < cr.lost_work_s
    doc = json.loads(result.to_json())
    assert doc["label"] == "modelled" and len(doc["plans"]) == 3
    assert doc["sources"]["fleet.node_loss_per_hour"].startswith("public: Llama 3")
    assert doc["plans"][0]["simulated"]["ettr_ci"] > 0
    text = _render(result.table())
    assert "Modelled" in text and "stalwart-ladder" in text


def test_scaling_curve_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result = plan(strategies=["checkpoint-restart"], sizes=[1024, 4096], **SMALL)
    assert [p.accelerators for p in result.scaling] == [1024, 4096]
    assert result.scaling[0].simulated > result.scaling[1].simulated  # more GPUs, more failures
    out = result.plot(tmp_path / "ettr.png")
    assert out.stat().st_size > 1000
    without = plan(strategies=["checkpoint-restart"], simulate=False, sizes=[1024])
    assert math.isnan(without.scaling[0].simulated) and without.plans[0].simulated is None
    assert json.loads(without.to_json())["scaling"][0]["simulated"] is None


def test_bad_plan_requests_say_what_to_do() -> None:
    with pytest.raises(ConfigError, match=r"unknown strategy.*checkpoint-restart"):
        plan(strategies=["restart-everything"], simulate=False)
    with pytest.raises(ConfigError, match=r"group_size \(128\) must divide accelerators"):
        plan(sizes=[1000], simulate=False)
    with pytest.raises(ConfigError, match="no scaling curve"):
        plan(simulate=False).plot("x.png")


def _render(table: object) -> str:
    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text()


def test_a_tier_without_room_for_two_snapshots_is_left_out() -> None:
    inputs = PlanInputs().replace(**{"job.group_size": 16_384, "tiers.memory.capacity_gb": 8.0})
    (ladder,) = plan(inputs, strategies=["stalwart-ladder"], **SMALL).plans
    assert "memory" not in ladder.intervals_s and "memory" not in ladder.simulated.rungs
    assert "cannot hold two snapshots (10 GB)" in ladder.notes[0]  # 2 x 4 GB x (4 + 1) / 4
