"""``stalwart rca`` through typer's CliRunner."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow.csv as pacsv
import pytest
import typer
from typer.testing import CliRunner

from stalwart.cli import rca
from stalwart.diagnose.synth import SyntheticLog

pytestmark = pytest.mark.timeout(120)
ENV = {"COLUMNS": "200", "NO_COLOR": "1"}


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    from stalwart.cli.main import app as main_app

    if any(c.name == "rca" for c in main_app.registered_commands):
        return main_app
    local = typer.Typer()
    local.callback()(lambda: None)
    rca.register(local)
    return local


@pytest.fixture(scope="module")
def csv(log2: SyntheticLog, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rca") / "log.csv"
    pacsv.write_csv(
        log2.table.cast(
            log2.table.schema.set(
                0, log2.table.schema.field(0).with_type(__import__("pyarrow").string())
            )
        ),
        path,
    )
    return path


def run(app: typer.Typer, *args: object) -> tuple[int, str, str]:
    r = CliRunner().invoke(app, ["rca", *map(str, args)], env=ENV)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r.exit_code, r.stdout, r.stderr


def test_table_json_and_html(
    app: typer.Typer, csv: Path, log2: SyntheticLog, tmp_path: Path
) -> None:
    code, out, _ = run(app, csv, "--label", "failed", "--html", tmp_path / "r.html")
    assert code == 0
    for cause in log2.causes:
        for k, v in cause.items():
            assert f"{k}={v}" in out
    page = (tmp_path / "r.html").read_text()
    assert "<svg" in page and "Subsumed neighbours" in page and "http" not in page.split("<svg")[0]
    code, out, _ = run(app, csv, "--label", "failed", "--json")
    assert code == 0
    assert sorted(map(str, (f["items"] for f in json.loads(out)["findings"]))) == sorted(
        map(str, log2.causes)
    )


def test_a_culprit_that_always_fails_renders_its_report(app: typer.Typer, tmp_path: Path) -> None:
    # Every row of host h3 fails: its rate, 1.0, came out a rounding above its Wilson bound,
    # and the report's plot refused the negative error bar (exit 3, no report written).
    rng = random.Random(0)
    rows = []
    for _ in range(400):
        host = f"h{rng.randint(0, 9)}"
        rows.append(f"{host},{int(host == 'h3' or rng.random() < 0.05)}\n")
    path = tmp_path / "log.csv"
    path.write_text("host,failed\n" + "".join(rows))
    code, out, _ = run(app, path, "--label", "failed", "--html", tmp_path / "r.html", "--json")
    assert code == 0, out
    (top,) = [f for f in json.loads(out)["findings"] if f["items"] == {"host": "h3"}]
    assert top["lift_low"] <= top["lift"] <= top["lift_high"], top
    assert "<svg" in (tmp_path / "r.html").read_text()


def test_errors_are_one_red_line(app: typer.Typer, csv: Path) -> None:
    code, out, err = run(app, csv, "--label", "faild")
    assert code == 2 and "Did you mean 'failed'" in err and "Traceback" not in err + out
    code, _, err = run(app, csv)
    assert code == 2 and "--label" in err
    code, _, err = run(app, csv.parent / "missing.csv", "--label", "failed")
    assert code == 2 and "no such file" in err


def test_nothing_found_is_clear(app: typer.Typer, csv: Path) -> None:
    code, out, _ = run(app, csv, "--label", "c00 = 'nope'")
    assert code == 0 and "no failures" in out


def test_kpi_mode(app: typer.Typer, tmp_path: Path) -> None:
    lines = ["dc,app,real,pred"] + [
        f"dc{d},app{a},{300 if (d, a) == (1, 2) else 1000},1000" for d in range(3) for a in range(4)
    ]
    (tmp_path / "kpi.csv").write_text("\n".join(lines))
    code, out, _ = run(app, tmp_path / "kpi.csv", "--actual", "real", "--expected", "pred")
    assert code == 0 and ("app=app2 & dc=dc1" in out or "dc=dc1 & app=app2" in out)
