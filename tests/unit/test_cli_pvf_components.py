"""``stalwart pvf --by component`` takes its groups from ``--component NAME=GLOB`` (repeatable),
and refuses a missing, malformed or unmatched group with a message that says what to give."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from stalwart import models
from stalwart.cli import pvf as pvf_cli
from stalwart.vulnerability import FixedTrials, PVFOptions, pvf


def _invoke(*args: str):  # type: ignore[no-untyped-def]
    app = typer.Typer()
    pvf_cli.register(app)

    @app.callback()
    def _main() -> None:
        pass

    return CliRunner().invoke(app, ["pvf", "mlp", "--trials", "40", *args], env={"COLUMNS": "200"})


def test_by_component_reports_the_named_groups_as_the_api_does() -> None:
    groups = ["--component", "early=fc1.*", "--component", "early=fc2.*"]
    r = _invoke("--by", "component", *groups, "--component", "head=fc4.*", "--json")
    assert r.exit_code == 0, r.output
    got = {g["group"]: (g["trials"], g["failures"]) for g in json.loads(r.stdout)["groups"]}
    ref = models.load("mlp")
    components = {"early": ["fc1.*", "fc2.*"], "head": ["fc4.*"]}
    opts = PVFOptions(by="component", components=components, stop=FixedTrials(40))
    api = pvf(ref.model, ref.inputs, ref.criteria[0], opts)
    assert got == {r.group: (r.trials, r.failures) for r in api.rows}
    assert set(got) == {"early", "head", "other"}


@pytest.mark.parametrize(("args", "says"), [
    (["--by", "component"], "--by component needs its groups: give --component NAME=GLOB"),
    (["--by", "component", "--component", "head"], "--component 'head': give NAME=GLOB"),
    (["--by", "component", "--component", "=fc1.*"], "give NAME=GLOB"),
    (["--component", "head=fc4.*"], "only with --by component (got --by bit)"),
    (["--by", "component", "--component", "head=fc9*"], "--component head=fc9*: pattern 'fc9*'"),
])  # fmt: skip
def test_bad_component_groups_are_usage_errors(args: list[str], says: str) -> None:
    r = _invoke(*args)
    assert r.exit_code == 2, r.output
    assert says in " ".join(r.output.split()) and "Traceback" not in r.output
