"""Fleet logs: the rows ``simulate_fleet`` writes read back, ``analyze_fleet`` ranking the planted
causes of each kind of fault first without confusing them, ``stalwart rca FOLDER``, and bad
folders and rows as clear errors naming the file and line."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from stalwart.diagnose import FleetDiagnosis, analyze_fleet
from stalwart.diagnose.fleet import FLEET_SCHEMA, FaultKind, fleet_runs, read_fleet
from stalwart.environment import HOST_KEYS, host_attributes
from stalwart.errors import ConfigError
from stalwart.testing.fleet import FleetTruth, simulate_fleet

pytestmark = pytest.mark.timeout(120)
ENV = {"COLUMNS": "200", "NO_COLOR": "1"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, FleetTruth]:
    folder = tmp_path_factory.mktemp("fleet")
    return folder, simulate_fleet(folder, runs=200, seed=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_planted_causes_rank_first_for_their_kind_and_nowhere_else(
    seed: int, tmp_path: Path
) -> None:
    truth = simulate_fleet(tmp_path, runs=200, seed=seed)
    found = analyze_fleet(tmp_path)
    assert found.runs == 200 and found.members == truth.members
    assert found.faults == truth.faults
    for kind, planted in truth.causes.items():
        items = [tuple(f.items.items()) for f in found.kinds[kind].findings]
        top = items[: len(planted)]
        # the bad hosts and the bad driver (sdc), the rack (crash), the kernel (hang), the CPU
        # model (straggler): each alone, in the first places
        assert sorted(top) == sorted((item,) for item in planted), (kind, items)
        others = {i for k, p in truth.causes.items() if k != kind for i in p}
        assert not any(set(t) & others for t in top), (kind, top)


def test_rows_follow_the_documented_format(fleet: tuple[Path, FleetTruth]) -> None:
    folder, truth = fleet
    runs = fleet_runs(folder)
    assert runs is not None and len(runs) == 200
    members = [json.loads(x) for r in runs for x in (r / "members.jsonl").read_text().splitlines()]
    faults = [json.loads(x) for r in runs for x in (r / "faults.jsonl").read_text().splitlines()]
    assert len(members) == truth.members and len(faults) == sum(truth.faults.values())
    assert {r["schema"] for r in members + faults} == {FLEET_SCHEMA}
    assert {"run", "worker", "incarnation", "steps", "host"} <= set(members[0])
    assert {"step", "kind", "decided_by", "tensor", "host"} <= set(faults[0])
    assert {f["kind"] for f in faults} == {k.value for k in FaultKind}
    assert all((f["tensor"] is not None) == (f["kind"] == "sdc_suspect") for f in faults)
    # a simulated member records what host_attributes(device) records, plus the site's rack
    assert set(members[0]["host"]) == set(host_attributes(device=0)) | {"rack"}
    assert set(HOST_KEYS) <= set(members[0]["host"])
    log = read_fleet(runs[0])  # one run's folder is a fleet of one
    assert log.runs == 1 and log.table.num_rows == len(
        (runs[0] / "members.jsonl").read_text().splitlines()
    )


def test_result_renders_as_data(fleet: tuple[Path, FleetTruth], tmp_path: Path) -> None:
    from stalwart.diagnose import write_html

    folder, _ = fleet
    d = analyze_fleet(folder, kinds=["crash", "hang"])
    assert isinstance(d, FleetDiagnosis) and list(d.kinds) == ["crash", "hang"]
    table = d.to_arrow()
    assert table.column_names[:2] == ["kind", "rank"]
    assert set(table.column("kind").to_pylist()) == {"crash", "hang"}
    data = json.loads(d.to_json())
    assert data["mode"] == "fleet" and set(data["kinds"]) == {"crash", "hang"}
    page = write_html(d, tmp_path / "fleet.html").read_text()
    assert "<h2>crash</h2>" in page and "<h2>hang</h2>" in page
    assert "crash" in d._repr_html_()


def test_cli_takes_the_folder(fleet: tuple[Path, FleetTruth], tmp_path: Path) -> None:
    from stalwart.cli import rca

    app = typer.Typer()
    app.callback()(lambda: None)
    rca.register(app)
    folder, truth = fleet
    r = CliRunner().invoke(app, ["rca", str(folder), "--html", str(tmp_path / "r.html")], env=ENV)
    assert r.exit_code == 0, r.output
    for kind in FaultKind:
        assert kind.value in r.stdout
    (key, value) = truth.causes["crash"][0]
    assert f"{key}={value}" in r.stdout
    r = CliRunner().invoke(app, ["rca", str(folder), "--json", "--label", "sdc_suspect"], env=ENV)
    assert r.exit_code == 0 and list(json.loads(r.stdout)["kinds"]) == ["sdc_suspect"]
    r = CliRunner().invoke(app, ["rca", str(folder), "--actual", "a", "--expected", "b"], env=ENV)
    assert r.exit_code == 2 and "folder of runs" in r.stderr


def _run(folder: Path, members: Sequence[object], faults: Sequence[object] = ()) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("members.jsonl", members), ("faults.jsonl", faults)):
        text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
        (folder / name).write_text(text)
    return folder


def _member(**change: object) -> dict[str, object]:
    row: dict[str, object] = {
        "schema": 1,
        "run": "r1",
        "worker": 0,
        "incarnation": 0,
        "steps": 10,
        "host": {"hostname": "h0"},
    }
    return row | change


def _fault(**change: object) -> dict[str, object]:
    row = _member(step=3, kind="crash", decided_by="exit-signal", tensor=None)
    del row["steps"]
    return row | change


def test_a_folder_without_runs_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no runs to analyse.*members\.jsonl.*Fleet logs"):
        analyze_fleet(tmp_path)
    (tmp_path / "x.parquet").write_bytes(b"")
    assert fleet_runs(tmp_path) is None  # a folder of Parquet files is another input
    assert fleet_runs(tmp_path / "x.parquet") is None


@pytest.mark.parametrize(
    ("members", "faults", "message"),
    [
        (["{not json"], [], r"members\.jsonl:1: not valid JSON"),
        ([_member(), "[1, 2]"], [], r"members\.jsonl:2: not a JSON object"),
        ([_member(incarnation="x")], [], r"members\.jsonl:1: 'incarnation' must be an integer"),
        ([_member(host=["h0"])], [], r"members\.jsonl:1: 'host' must be an object"),
        ([_member(), _member()], [], r"members\.jsonl:2: incarnation 0 of worker 0 .* twice"),
        ([_member()], [_fault(kind="oom")], r"faults\.jsonl:1: kind 'oom' is not a fault kind"),
        ([_member()], [_fault(step=-1)], r"faults\.jsonl:1: 'step' must be an integer >= 0"),
        ([_member(host={"crash": "x"})], [], r"attribute 'crash' shadows a column"),
    ],
)
def test_a_malformed_row_names_its_file_and_line(
    tmp_path: Path, members: list[object], faults: list[object], message: str
) -> None:
    _run(tmp_path / "r1", members, faults)
    with pytest.raises(ConfigError, match=message):
        read_fleet(tmp_path)


def test_schema_versions_are_checked_and_never_skipped(tmp_path: Path) -> None:
    _run(tmp_path / "r1", [_member(), _member(schema=2, worker=1)])
    with pytest.raises(ConfigError, match=r"members\.jsonl:2: schema 2 is newer .* upgrade"):
        read_fleet(tmp_path, skip_bad_lines=True)
    _run(tmp_path / "r1", [_member(schema="1")])
    with pytest.raises(ConfigError, match=r"members\.jsonl:1: schema '1' is not a fleet-log"):
        read_fleet(tmp_path)


def test_bad_lines_can_be_skipped_and_lost_members_are_counted(tmp_path: Path) -> None:
    _run(
        tmp_path / "r1",
        [_member(), "{oops", _member(worker=1, steps=-5)],
        [_fault(), _fault(worker=2, host={"hostname": "h2"})],
    )
    log = read_fleet(tmp_path, skip_bad_lines=True)
    assert log.table.num_rows == 2 and log.faults["crash"] == 2
    assert log.table.column("crash").to_pylist() == [True, True]
    assert any("skipped 2 malformed" in n for n in log.notes)
    assert any("1 fault(s) name an incarnation without a row" in n for n in log.notes)
    d = analyze_fleet(tmp_path, skip_bad_lines=True)
    assert d.kinds["hang"].message == "no hang faults in these runs: nothing to explain"


def test_unknown_kind_asked_for_is_an_error(fleet: tuple[Path, FleetTruth]) -> None:
    with pytest.raises(ConfigError, match=r"fault kind 'oom'.*sdc_suspect"):
        analyze_fleet(fleet[0], kinds=["oom"])
