"""The command line's outputs never destroy data, and its messages say what is wrong.

An output file that is one of the command's inputs, lies in a checkpoint root, or names the
same file as another output is refused (exit 2) before any work; every output is written
atomically, so a full disk (simulated: a writer raising ``ENOSPC``, no root needed) leaves the
earlier file whole, no partial one, and exits 2 with a message naming the file. Exports
(files and DCP folders) translate a full disk the same way and remove what they had begun.
Bad numbers, ports and paths are named by the option the user gave.
"""

from __future__ import annotations

import csv
import errno
import json
import math
import os
import shutil
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import typer
from typer.testing import CliRunner

import stalwart.elastic
from stalwart import Checkpointer
from stalwart.cli.conventions import GuardedGroup
from stalwart.cli.main import app
from stalwart.errors import ConfigError, StorageFullError

pytestmark = pytest.mark.timeout(120)

ENV = {"COLUMNS": "400", "NO_COLOR": "1"}
LABEL = "status != 'ok'"


def run(*args: object) -> tuple[int, str]:
    """Exit code and stdout + stderr of ``stalwart ARGS`` run in this process."""
    r = CliRunner().invoke(app, list(map(str, args)), env=ENV)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r.exit_code, " ".join((r.stdout + r.stderr).split())  # unwrapped lines


@pytest.fixture
def log(tmp_path: Path) -> Path:
    """A small failure log: host h3 fails."""
    path = tmp_path / "events.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["host", "status"])
        for i in range(400):
            host = f"h{i % 8}"
            w.writerow([host, "xid79" if host == "h3" and i % 3 else "ok"])
    return path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "ck"
    with Checkpointer(path) as ck:
        for step in (10, 20):
            ck.save(step, {"w": torch.full((4, 4), float(step))})
    return path


def _manifest(root: Path, step: int) -> Path:
    return root / "manifests" / f"step-{step:020d}.json"


def _leftovers(folder: Path) -> list[str]:
    """Temporary files or staging folders a write left behind."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# 1. an output never replaces an input, a checkpoint's file, or another output


def test_rca_refuses_an_output_that_is_its_own_log(log: Path) -> None:
    before = log.read_bytes()
    for option in ("--html", "--json-out"):
        code, out = run("rca", log, "--label", LABEL, option, log)
        assert code == 2, out
        assert f"{option} {log} would replace the log {log}" in out
        assert log.read_bytes() == before
    code, out = run("rca", str(log.parent / "*.csv"), "--label", LABEL, "--html", log)
    assert code == 2 and "would replace the log" in out  # a glob's match too
    assert log.read_bytes() == before


def test_rca_refuses_two_outputs_naming_one_file_and_reruns_over_its_report(
    log: Path, tmp_path: Path
) -> None:
    report, json_out = tmp_path / "r.html", tmp_path / "r.json"
    code, out = run("rca", log, "--label", LABEL, "--json-out", report, "--html", report)
    assert code == 2 and f"--json-out and --html both name {report}" in out
    assert not report.exists()
    for _ in range(2):  # regenerating an earlier report stays allowed
        code, out = run("rca", log, "--label", LABEL, "--html", report, "--json-out", json_out)
        assert code == 0, out
    assert "host=h3" in report.read_text() and _leftovers(tmp_path) == []
    assert json.loads(json_out.read_text())["findings"]


def test_outputs_inside_a_checkpoint_root_are_refused(root: Path, tmp_path: Path) -> None:
    manifest = _manifest(root, 20)
    before = manifest.read_bytes()
    code, out = run("ckpt", "diff", root, 10, 20, "--html", manifest)
    assert code == 2 and f"inside the checkpoint root {root.resolve()}" in out
    code, out = run("ckpt", "export", root, manifest, "--overwrite")
    assert code == 2 and "OUT" in out and "inside the checkpoint root" in out
    code, out = run("ckpt", "export", root, root / "packs" / "x", "--format", "dcp")
    assert code == 2 and "inside the checkpoint root" in out
    assert manifest.read_bytes() == before
    code, out = run("ckpt", "diff", root, 10, 20, "--html", tmp_path / "diff.html")
    assert code == 0 and (tmp_path / "diff.html").is_file()


def test_a_root_is_known_by_its_markers_not_by_a_folder_named_manifests(
    root: Path, tmp_path: Path
) -> None:
    from stalwart.cli.conventions import check_outputs, checkpoint_root_of

    assert checkpoint_root_of(root / "packs" / "new.html") == root.resolve()
    assert checkpoint_root_of(root) == root.resolve()
    k8s = tmp_path / "repo"
    (k8s / "manifests").mkdir(parents=True)
    (k8s / "manifests" / "deploy.yaml").write_text("kind: Deployment\n")
    assert checkpoint_root_of(k8s / "report.html") is None
    check_outputs({"--html": k8s / "report.html"})  # no error
    plan_in = tmp_path / "plan.json"
    plan_in.write_text("{}")
    with pytest.raises(ConfigError, match="would replace --inputs"):
        check_outputs({"--plot": plan_in}, {f"--inputs {plan_in}": plan_in})


def test_plan_refuses_a_plot_over_its_inputs(tmp_path: Path) -> None:
    inputs = tmp_path / "in.json"
    inputs.write_text(json.dumps({"job": {"accelerators": 1024}}))
    code, out = run("plan", "--inputs", inputs, "--plot", inputs, "--no-simulate")
    assert code == 2 and "would replace --inputs" in out
    assert json.loads(inputs.read_text()) == {"job": {"accelerators": 1024}}


# 2. atomic writes: a full disk leaves the earlier file whole


def _enospc_after_half(monkeypatch: pytest.MonkeyPatch) -> None:
    """Path.write_text writes half its text, then the disk is full."""
    real = Path.write_text

    def half(self: Path, data: str, *args: Any, **kwargs: Any) -> int:
        real(self, data[: len(data) // 2], *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_text", half)


def test_rca_report_on_a_full_disk_keeps_the_earlier_report(
    log: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    report = out_dir / "r.html"
    report.write_text("<p>earlier report</p>")
    _enospc_after_half(monkeypatch)
    code, out = run("rca", log, "--label", LABEL, "--html", report)
    assert code == 2, out
    assert f"no space left on the device writing {report}" in out and "free space" in out
    assert report.read_text() == "<p>earlier report</p>"
    code, out = run("rca", log, "--label", LABEL, "--json-out", out_dir / "new.json")
    assert code == 2 and "no space left" in out
    assert sorted(p.name for p in out_dir.iterdir()) == ["r.html"]  # no partial, no temp


def test_diff_report_on_a_full_disk_keeps_the_earlier_report(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = tmp_path / "diff.html"
    report.write_text("earlier")
    _enospc_after_half(monkeypatch)
    code, out = run("ckpt", "diff", root, 10, 20, "--html", report)
    assert code == 2 and "no space left" in out and str(report) in out
    assert report.read_text() == "earlier" and _leftovers(tmp_path) == []


def test_staged_files_replace_all_or_nothing(tmp_path: Path) -> None:
    from stalwart.cli.conventions import staged_files, write_file

    (tmp_path / "a.json").write_text("old a")
    with pytest.raises(StorageFullError, match=r"writing .*b\.html"), staged_files(tmp_path) as st:
        (st / "a.json").write_text("new a")
        (st / "b.html").write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert (tmp_path / "a.json").read_text() == "old a"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]
    with pytest.raises(ZeroDivisionError):  # not a full disk: the writer's own error, as it is
        write_file(tmp_path / "c.png", lambda tmp: (tmp.write_bytes(b"x"), 1 / 0))
    write_file(tmp_path / "a.json", "new a")
    assert (tmp_path / "a.json").read_text() == "new a" and _leftovers(tmp_path) == []


def test_the_diagnosis_report_writer_is_atomic(
    log: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stalwart.diagnose import analyze, write_html

    d = analyze(str(log), LABEL)
    page = tmp_path / "r.html"
    page.write_text("earlier")
    real = os.replace

    def full(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if Path(dst) == page:  # the disk fills as the report is put in place
            raise OSError(errno.ENOSPC, "No space left on device")
        real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError):
        write_html(d, page)
    assert page.read_text() == "earlier" and _leftovers(tmp_path) == []
    monkeypatch.setattr(os, "replace", real)
    assert "h3" in write_html(d, page).read_text()


# 3. DCP export: torch's CheckpointException (a BaseException) is translated


def _dcp_failure(exc: BaseException) -> BaseException:
    from torch.distributed.checkpoint.api import CheckpointException

    summary = traceback.StackSummary.from_list([])
    return CheckpointException("save failed", {0: (exc, summary)})


@pytest.mark.parametrize("existing", [False, True])
def test_dcp_export_on_a_full_disk_exits_2_and_removes_its_partial_output(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, existing: bool
) -> None:
    import stalwart.integrations.dcp as dcp_module

    dest = tmp_path / "dcp"
    if existing:
        dest.mkdir()

    def partial(ck: Any, out: Path, **kwargs: Any) -> Any:
        Path(out).mkdir(exist_ok=True)
        (Path(out) / "__0_0.distcp").write_bytes(b"partial")
        raise _dcp_failure(OSError(errno.ENOSPC, "No space left on device"))

    monkeypatch.setattr(dcp_module, "export_dcp", partial)
    code, out = run("ckpt", "export", root, dest, "--format", "dcp")
    assert code == 2, out
    assert f"no space left on the device writing the DCP checkpoint {dest}" in out
    assert list(dest.iterdir()) == [] if existing else not dest.exists()


def test_dcp_export_failure_of_another_kind_is_named_not_a_crash(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stalwart.integrations.dcp as dcp_module

    def broken(ck: Any, out: Path, **kwargs: Any) -> Any:
        raise _dcp_failure(ValueError("planner refused the tree"))

    monkeypatch.setattr(dcp_module, "export_dcp", broken)
    code, out = run("ckpt", "export", root, tmp_path / "dcp", "--format", "dcp")
    assert code == 2 and "writing the DCP checkpoint" in out and "planner refused" in out


def test_the_root_group_reports_a_base_exception_as_unexpected() -> None:
    local = typer.Typer(cls=GuardedGroup)

    @local.command()
    def boom() -> None:
        raise _dcp_failure(ValueError("x"))

    @local.command()
    def other() -> None:
        pass

    r = CliRunner().invoke(local, ["boom"], env=ENV)
    assert r.exit_code == 3 and "unexpected error: CheckpointException" in r.stderr


# 4. file export: a full disk is a storage error, not SafetensorError or "enforce fail"


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
@pytest.mark.parametrize("errno_given", [False, True])
def test_file_export_on_a_full_disk_exits_2_and_keeps_the_earlier_file(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str, errno_given: bool
) -> None:
    import collections

    import safetensors.torch

    out = tmp_path / f"model{suffix}"
    out.write_bytes(b"earlier export")

    def fail(_: Any, path: Any, **kwargs: Any) -> None:
        Path(path).write_bytes(b"\0" * 16)
        if errno_given:
            raise OSError(errno.ENOSPC, "No space left on device")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64")

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(1 << 30, 1 << 30, 0))
    monkeypatch.setattr(safetensors.torch, "save_file", fail)
    monkeypatch.setattr(torch, "save", fail)
    code, text = run("ckpt", "export", root, out, "--overwrite")
    assert code == 2, text
    assert f"no space left on the device writing {out}" in text and "free space" in text
    assert out.read_bytes() == b"earlier export" and _leftovers(tmp_path) == []


def test_file_export_failure_with_room_left_is_not_called_a_full_disk(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stalwart.checkpoint.tools.export as export_module

    def fail(_: Any, path: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(torch, "save", fail)
    with Checkpointer(root) as ck, pytest.raises(RuntimeError, match="a bug"):
        export_module.export_step(ck, tmp_path / "m.pt")
    assert _leftovers(tmp_path) == [] and not (tmp_path / "m.pt").exists()


# 5. plan: non-finite and overflowing inputs are named, not crashes


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--step-s", "inf"], "--step-s"),
        (["--state-gb", "nan"], "--state-gb"),
        (["--state-gb", "1e308"], "--state-gb"),
        (["--step-s", "1e300"], "--step-s"),
        (["--set", "job.step_s=Infinity"], "got inf; give a finite value"),
    ],
)
def test_plan_refuses_non_finite_and_overflowing_inputs(args: list[str], named: str) -> None:
    code, out = run("plan", *args, "--no-simulate")
    assert code == 2, out
    assert named in out and "unexpected" not in out


def test_plan_inputs_refuse_infinity() -> None:
    from stalwart.plan import PlanInputs

    with pytest.raises(
        ConfigError, match=r"Job\.step_s must be a number > 0, got inf; give a finite value"
    ):
        PlanInputs().replace(**{"job.step_s": math.inf})
    with pytest.raises(ConfigError, match=r"Job\.accelerators"):
        PlanInputs().replace(**{"job.accelerators": 10**400})


def test_plan_names_the_group_size_option_for_a_job_size_it_does_not_divide() -> None:
    code, out = run("plan", "--accelerators", "16", "--no-simulate")
    assert code == 2
    assert "replica group size 128 (the default" in out and "must divide accelerators" in out
    assert "--group-size 8" in out and "--group-size 16" in out
    assert run("plan", "--accelerators", "16", "--group-size", "8", "--no-simulate")[0] == 0


# 6. run --rdzv: a port out of range is a usage error


def test_rdzv_port_out_of_range_is_a_config_error(tmp_path: Path) -> None:
    from stalwart.elastic.nodes import rendezvous

    for port in (0, 65536, 99999):
        with pytest.raises(ConfigError, match="from 1 to 65535"):
            rendezvous(f"127.0.0.1:{port}", 1)
    script = tmp_path / "train.py"
    script.write_text("")
    code, out = run("run", "--rdzv", "host:99999", script)
    assert code == 2 and "port 99999 is out of range" in out


# 7. messages say what is wrong with what was given


def test_a_file_given_where_a_folder_is_wanted_is_named(root: Path, tmp_path: Path) -> None:
    afile = tmp_path / "afile.txt"
    afile.write_text("x")
    code, out = run("run", "--events", afile, tmp_path / "train.py")
    assert code == 2 and "is a file; give a folder" in out and "Errno" not in out
    code, out = run("demo", "--root", afile)
    assert code == 2 and "is a file; give a folder" in out and "Errno" not in out
    code, out = run("ckpt", "export", root, afile, "--format", "dcp")
    assert code == 2 and "--format dcp writes a folder" in out and "Errno" not in out
    code, out = run("ckpt", "export", root, afile / "x.pt")
    assert code == 2 and f"{afile} is a file, not a folder" in out
    code, out = run("rca", tmp_path / "log.csv", "--label", LABEL, "--html", afile / "r.html")
    assert code == 2 and "is a file, not a folder" in out
    assert afile.read_text() == "x"


def test_rca_says_an_empty_folder_holds_nothing_to_analyse(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "__0_0.distcp").write_bytes(b"")
    code, out = run("rca", empty, "--label", "x")
    assert code == 2 and "nothing to analyse" in out and "fault kind" not in out


def test_rca_takes_a_long_sql_query_with_outputs(log: Path, tmp_path: Path) -> None:
    query = f"SELECT * FROM read_csv('{log}') WHERE host <> '{'x' * 300}'"
    code, out = run("rca", query, "--label", LABEL, "--html", tmp_path / "r.html")
    assert code == 0, out


def test_rca_says_label_and_kpi_mode_exclude_each_other(log: Path) -> None:
    code, out = run("rca", log, "--actual", "a", "--expected", "b", "--label", "x")
    assert code == 2 and "exclude each other" in out and "drop one" in out


# 8. run: workers that never joined the job are explained


def test_run_explains_workers_that_never_joined_and_misplaced_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stalwart.elastic.events import JobSummary

    script = tmp_path / "noop.py"
    script.write_text("")
    seen: dict[str, Any] = {}

    def no_job(path: Any, args: list[str], **kwargs: Any) -> Any:
        seen["args"] = args
        return stalwart.elastic.LaunchResult(1, 0, 0.1, tmp_path, JobSummary(), [], {}, [])

    monkeypatch.setattr(stalwart.elastic, "launch", no_job)
    code, out = run("run", script, "--json")
    assert code == 1 and seen["args"] == ["--json"]
    assert "workers exited without joining the job" in out and "stalwart.elastic.Job" in out
    assert "--json came after the script and went to it" in out
    code, out = run("run", "--help")
    assert "options go before the script" in out
