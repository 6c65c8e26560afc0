"""``examples/gpt_hsdp.py --tiny`` under ``stalwart run --nproc 4 --group-size 2``, one kill.

Two replica groups of two ranks, FSDP2 inside each; the seeded chaos schedule kills one
worker, its group is taken out and the job trains on; the durable tier holds the last steps,
and a second ``stalwart run`` of the same command (every process of the first one gone)
resumes from the newest of them by itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stalwart.elastic import read_events
from stalwart.elastic.events import EventKind

from .test_elastic import _env, _launcher_log

pytestmark = pytest.mark.timeout(180)

EXAMPLE = Path(__file__).parents[2] / "examples" / "gpt_hsdp.py"
RUN_TIMEOUT_S = 120


def _run(tmp: Path, tag: str, steps: int, *chaos: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", "4", "--group-size", "2",
           "--max-restarts", "2", "--events", str(tmp / f"events-{tag}"), "--timeout", "20",
           "--json", str(EXAMPLE), "--tiny", "--steps", str(steps), "--samples", "128",
           "--ckpt", str(tmp / "ckpt"), "--ckpt-every", "4", "--out", str(tmp / f"out-{tag}"),
           *chaos]  # fmt: skip
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def test_tiny_gpt_hsdp_survives_a_kill_and_a_whole_restart(tmp_path: Path) -> None:
    doc = json.loads(_run(tmp_path, "first", 12, "--chaos-seed", "3").stdout)
    assert doc["ok"] and doc["summary"]["final_step"] == 12 and doc["final_digests_equal"]
    exits = [e for e in _launcher_log(tmp_path / "events-first") if e["kind"] == EventKind.EXITED]
    assert any(e["rc"] == -9 and "taken_down_by" not in e for e in exits), "one worker was killed"
    manifests = sorted((tmp_path / "ckpt" / "manifests").glob("step-*.json"))
    assert manifests, "replica group 0 saved the durable tier"
    newest = int(manifests[-1].stem.removeprefix("step-"))
    assert newest in (8, 12)
    finals = [torch.load(p) for p in sorted((tmp_path / "out-first").glob("final-*.pt"))]
    assert {f["step"] for f in finals} == {12}

    # every process of the first run is gone: a new `stalwart run` resumes by itself
    doc = json.loads(_run(tmp_path, "second", 16).stdout)
    assert doc["ok"] and doc["summary"]["final_step"] == 16 and doc["final_digests_equal"]
    resumed = [e for lines in read_events(tmp_path / "events-second").values() for e in lines
               if e["kind"] == EventKind.RESUMED]  # fmt: skip
    assert len(resumed) >= 2 and {e["step"] for e in resumed} == {newest}, resumed
