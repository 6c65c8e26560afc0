"""``stalwart plan``: tables, JSON, plot, inputs from files and options, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stalwart.cli.main import app

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}
FAST = ["--failures", "100"]


def _invoke(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(app, list(args), env=ENV)


def test_table_by_default() -> None:
    r = _invoke("plan", *FAST)
    assert r.exit_code == 0, r.output
    assert "Modelled ETTR (not measured)" in r.output
    for name in ("checkpoint-restart", "stalwart-no-memory", "stalwart-ladder"):
        assert name in r.output
    assert "measured here" in r.output and "public" in r.output


def test_json_with_options_and_sets() -> None:
    sets = ["--set", "tiers.disk.interval_s=600", "--strategy", "stalwart-no-memory"]
    r = _invoke("plan", "--json", "--no-simulate", "--accelerators", "1024", "--step-s", "2", *sets)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["inputs"]["job"]["accelerators"] == 1024
    (only,) = doc["plans"]
    assert only["strategy"] == "stalwart-no-memory" and only["simulated"] is None
    assert only["intervals_s"]["disk"] == 600
    assert doc["sources"]["job.step_s"] == "given"


def test_inputs_costs_and_fleet_files(tmp_path: Path) -> None:
    inputs, costs = tmp_path / "in.toml", tmp_path / "costs.json"
    inputs.write_text("[job]\naccelerators = 2048\n")
    costs.write_text('{"torchrun_restart_s": 60}')
    r = _invoke("plan", "--json", "--no-simulate", "--inputs", str(inputs), "--costs",
                str(costs), "--fleet", "meta-rsc2")  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["inputs"]["job"]["accelerators"] == 2048
    assert doc["inputs"]["costs"]["torchrun_restart_s"] == 60
    assert "RSC2" in doc["sources"]["fleet.node_loss_per_hour"]


def test_scaling_table_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "ettr.png"
    r = _invoke("plan", *FAST, "--sizes", "1024,2048", "--plot", str(out),
                "--strategy", "checkpoint-restart")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "Modelled ETTR against job size" in r.output and "2,048" in r.output
    assert out.stat().st_size > 1000


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "job.gpus=8"], "no input 'job.gpus'"),
        (["--set", "job.accelerators"], "SECTION.FIELD=VALUE"),
        (["--accelerators", "1000"], "must divide accelerators"),
        (["--sizes", "1024,x"], "whole numbers"),
        (["--inputs", "nope.toml"], "cannot read plan inputs"),
        (["--strategy", "yolo"], "yolo"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    r = _invoke("plan", "--no-simulate", *args)
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output


def test_cli_strategy_choices_are_the_library_s() -> None:
    from stalwart.cli.plan import StrategyName
    from stalwart.plan import Strategy

    assert [s.value for s in StrategyName] == [s.value for s in Strategy]
