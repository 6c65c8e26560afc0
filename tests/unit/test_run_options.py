"""Options of a run reach the launcher and the job as given, and impossible ones are refused.

``stalwart run --min-size`` is passed on unchanged (across ``--nnodes`` nodes it counts the
members of every node) and checked by ``launch()``; ``Job(timeout_s=0)`` is refused like a
negative timeout instead of becoming the default. No process is started.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import stalwart
import stalwart.elastic
from stalwart.cli.main import app
from stalwart.elastic import Job, launch
from stalwart.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}
MISSING = "/nonexistent/train.py"  # checked after the sizes: launch() stops before any process


def test_cli_passes_min_size_across_nodes_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def record(script: Any, args: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        raise ConfigError("recorded")

    monkeypatch.setattr(stalwart.elastic, "launch", record)
    argv = ["run", "--nproc", "2", "--rdzv", "127.0.0.1:1", "--nnodes", "2:2",
            "--min-size", "4", MISSING]  # fmt: skip
    CliRunner().invoke(app, argv, env=ENV)
    assert seen["min_size"] == 4 and seen["nnodes"] == "2:2"


def test_launch_takes_a_min_size_counting_every_node() -> None:
    # 2 workers on each of 2 nodes: 4 members; the sizes pass, the missing script stops it
    with pytest.raises(ConfigError, match="does not exist"):
        launch(MISSING, nproc=2, min_size=4, rdzv="127.0.0.1:1", nnodes="2:2")
    with pytest.raises(ConfigError, match="pass a min_size from 1 to 4"):
        launch(MISSING, nproc=2, min_size=5, rdzv="127.0.0.1:1", nnodes="1:2")


def test_cli_refuses_an_impossible_min_size_and_says_what_to_pass(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('never started')\n")
    r = CliRunner().invoke(app, ["run", "--nproc", "2", "--min-size", "5", str(script)], env=ENV)
    assert r.exit_code == 2, r.output
    assert "min_size=5 (--min-size)" in r.output and "from 1 to 2" in r.output
    r = CliRunner().invoke(app, ["run", "--nproc", "4", "--group-size", "2", "--min-size", "3",
                                 str(script)], env=ENV)  # fmt: skip
    assert r.exit_code == 2 and "at most 2 replica groups" in r.output, r.output


@pytest.mark.parametrize("timeout_s", [0, 0.0, -1])
def test_job_refuses_a_timeout_of_zero_as_a_negative_one(timeout_s: float) -> None:
    model = torch.nn.Linear(2, 2)
    state = stalwart.TrainingState(model=model, optimizer=torch.optim.SGD(model.parameters()))
    with pytest.raises(ConfigError, match=f"timeout {timeout_s} s: give a positive number"):
        Job(state, world="single", timeout_s=timeout_s)
