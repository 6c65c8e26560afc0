"""The demo end to end: a SIGKILLed run resumes bit-identically, with dedup visible."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from stalwart.demos import resume as demo_mod
from stalwart.demos.resume import default_kill_step, run_demo

pytestmark = pytest.mark.timeout(240)

SRC = Path(__file__).resolve().parents[2] / "src"


def test_demo_resume_is_bit_identical(tmp_path: Path) -> None:
    out = io.StringIO()
    report = run_demo(tmp_path, steps=60, checkpoint_every=10, console=Console(file=out, width=120))
    assert report.child_killed, report.child_exitcode
    assert report.kill_at == default_kill_step(60, 10)
    assert report.kill_at % 10 != 0
    assert report.resumed_from == report.kill_at // 10 * 10
    assert report.bit_identical, report.mismatches
    assert report.ok
    assert report.bytes_reused > 0
    assert report.bytes_written < report.bytes_total
    assert report.saves == 6  # steps 10..kill in the child, the rest after the resume
    assert report.committed_steps == [40, 50, 60]
    text = out.getvalue()
    assert "bit-identical" in text and str(tmp_path) in text
    assert (tmp_path / "demo-report.json").is_file()


def test_demo_detects_a_resume_without_rng(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison has teeth: resuming without the RNG states is caught."""
    build = demo_mod._build_job

    def build_without_rng(steps: int) -> demo_mod._Job:
        job = build(steps)
        job.state.rng = False  # only in this process: the child still saves RNG states
        return job

    monkeypatch.setattr(demo_mod, "_build_job", build_without_rng)
    out = io.StringIO()
    report = run_demo(tmp_path, steps=30, checkpoint_every=10, console=Console(file=out))
    assert report.child_killed
    assert not report.bit_identical and not report.ok
    assert "final_loss" in report.mismatches
    assert "not bit-identical" in out.getvalue()


@pytest.mark.parametrize(("steps", "every"), [(300, 25), (80, 20), (10, 3), (5, 5)])
def test_default_kill_step(steps: int, every: int) -> None:
    kill = default_kill_step(steps, every)
    assert 1 <= kill <= steps
    if steps >= 10:
        assert 0.4 * steps <= kill <= 0.7 * steps
        assert kill % every != 0


@pytest.mark.slow
def test_cli_demo(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from stalwart.cli.main import app

    root = tmp_path / "demo"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
        "COLUMNS": "200",  # no cell truncated
    }
    args = ["demo", "--root", str(root), "--steps", "80", "--every", "20"]
    # First the whole demo, every section, in its own interpreter as a user runs it.
    proc = subprocess.run(
        [sys.executable, "-m", "stalwart.cli.main", *args],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "memory+erasure" in proc.stdout and "rank 2 rebuilt" in proc.stdout
    assert "PVF" in proc.stdout and "Findings" in proc.stdout
    assert "digests equal on every member after 2 heals" in proc.stdout
    # Then again over the first one's folder (fresh), one section, through the same app here
    # (the demo's killed child is still its own process): one interpreter start fewer.
    again = CliRunner().invoke(
        app, [*args, "--no-recovery", "--no-pvf", "--no-rca", "--no-elastic"],
        env={"COLUMNS": "200"},
    )  # fmt: skip
    assert again.exit_code == 0, again.output
    for out in (proc.stdout, again.stdout):
        assert "bit-identical" in out
        assert str(root.absolute()) in out
    assert (root / "run").is_dir()
