"""``stalwart pvf``: tables, outputs with manifest, and clean errors (exit 2, no traceback)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import typer
from typer.testing import CliRunner

from stalwart.cli import pvf as pvf_cli
from stalwart.vulnerability import scale


def _app() -> typer.Typer:
    app = typer.Typer()
    pvf_cli.register(app)

    @app.callback()
    def _main() -> None:
        pass

    return app


def test_pvf_cli_writes_outputs(tmp_path) -> None:
    res = CliRunner().invoke(
        _app(),
        [
            "pvf",
            "gcn",
            "--trials",
            "60",
            "--by",
            "layer",
            "-c",
            "top1",
            "-c",
            "deviation",
            "--out",
            str(tmp_path),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "model-level PVF (top1)" in res.output
    table = pq.read_table(tmp_path / "trials.parquet")
    assert table.num_rows == 60 and "failed" in table.column_names
    manifest = json.loads(table.schema.metadata[b"stalwart.manifest"])
    assert manifest["seed"] == 0 and len(manifest["model_hash"]) == 16
    assert (tmp_path / "report.html").read_text().count("data:image/png") >= 2
    report = json.loads((tmp_path / "pvf.json").read_text())
    assert {g["group"] for g in report["groups"]} == {"lin1", "lin2"}


def test_pvf_cli_json_and_errors() -> None:
    runner = CliRunner()
    res = runner.invoke(_app(), ["pvf", "gcn", "--trials", "20", "--json", "--by", "all"])
    assert res.exit_code == 0
    assert json.loads(res.stdout)["groups"][0]["trials"] == 20
    for args, msg in [
        (["pvf", "resnet"], "no reference model"),
        (["pvf", "gcn", "--targets", "conv*"], "matches no parameter"),
        (["pvf", "gcn", "-c", "decision"], "needs one logit per input"),
        (["pvf", "gcn", "--dtype", "fp8"], "--dtype"),
        (["pvf", "nosuch.module:make"], "package.module:factory"),
    ]:
        res = runner.invoke(_app(), args)
        assert res.exit_code == 2, (args, res.output)
        assert msg in res.output and "Traceback" not in res.output


def _report(*args: str) -> dict:
    res = CliRunner().invoke(_app(), ["pvf", "gcn", "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_pvf_cli_workers_equal_one_process(tmp_path) -> None:
    assert tuple(b.value for b in pvf_cli.Backend) == scale.BACKENDS
    # two rounds (the interval is not narrow enough after the first): stratified by layer
    args = ["--trials", "40", "--by", "layer", "-c", "top1", "-c", "deviation"]
    args += ["--margin", "0.15"]
    one = _report(*args)
    extra = ["--workers", "2", "--backend", "local", "--campaign-dir", str(tmp_path)]
    for _ in ("run", "resume"):  # the second call finds every shard on disk
        many = _report(*args, *extra)
        assert many["groups"] == one["groups"] and many["overall"] == one["overall"]
        assert many["manifest"]["trials"] == one["manifest"]["trials"] > 40
        assert many["manifest"]["model_hash"] == one["manifest"]["model_hash"]
    assert many["manifest"]["backend"] == "local" and many["manifest"]["workers"] == 2
    assert many["manifest"]["ran_shards"] == []
    assert (tmp_path / "round-0").is_dir() and (tmp_path / "round-1").is_dir()
