"""Sharded campaigns in real gloo worlds: spawned by ``run_sharded(backend="torch")`` and
started by ``torchrun``; a worker SIGKILLed mid-campaign, then the same call resumes.

Every merged result is compared with a one-process ``run_campaign`` on the same fault list,
trial for trial and in order (the per-trial table, with each criterion's outcome and rate).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from stalwart.errors import DistributedError
from stalwart.vulnerability import estimate, run_campaign, scale

from . import campaign_models as cm

pytestmark = pytest.mark.timeout(240)

CRITERIA = ["top1", "dev>0.05"]
ROOT = Path(__file__).resolve().parents[2]


def test_ranks_import_the_factory_in_the_environment_of_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    faults = cm.mixed_faults(n=8)
    kw: dict = {"workers": 2, "backend": "torch", "shards": 2, "timeout_s": 180}
    scale.run_sharded(cm.tiny, faults, tmp_path / "a", ["top1"], **kw)  # the forkserver is up
    monkeypatch.setenv("STALWART_TEST_MODEL_VARIANT", "b")
    from . import env_campaign

    res = scale.run_sharded(env_campaign.make, faults, tmp_path / "b", ["top1"], **kw)
    assert len(res) == len(faults)


def test_spawned_world_merges_to_the_one_process_result(tmp_path: Path) -> None:
    faults = cm.mixed_faults()
    ref = run_campaign(*cm.tiny(), faults, CRITERIA)
    res = scale.run_sharded(
        cm.tiny, faults, tmp_path, CRITERIA, workers=2, backend="torch", shards=6, timeout_s=180
    )
    assert len(res) == len(ref) == 300
    assert res.table().equals(ref.table())
    assert estimate(res, "bit").rows == estimate(ref, "bit").rows
    assert res.manifest["workers"] == 2 and res.manifest["ran_shards"] == list(range(6))


def test_a_killed_worker_is_resumed_without_rerunning_finished_shards(tmp_path: Path) -> None:
    marker = str(tmp_path / "died")
    # a shard is 37-38 trials, one forward each with the naive engine plus the golden pass:
    # rank 1's 50th forward is inside the second shard it claims
    make = functools.partial(cm.dies_on_rank, 1, 50, marker)
    faults = cm.mixed_faults(make=make)
    camp = tmp_path / "camp"
    kw = {"workers": 2, "backend": "torch", "shards": 8, "engine": "naive", "timeout_s": 180}
    with pytest.raises(DistributedError, match=r"worker 1 died \(SIGKILL\).*run the same call"):
        scale.run_sharded(make, faults, camp, CRITERIA, **kw)
    assert os.path.exists(marker)
    done = {p.name: os.stat(p).st_mtime_ns for p in camp.glob("shard-*.npz")}
    assert 0 < len(done) < 8

    res = scale.run_sharded(make, faults, camp, CRITERIA, **kw)
    ran = res.manifest["ran_shards"]
    assert ran == sorted(set(range(8)) - {int(n[6:11]) for n in done})
    assert {n: os.stat(camp / n).st_mtime_ns for n in done} == done  # not re-run
    assert not list(camp.glob(".*.tmp")), "a killed writer's temporary file outlived the resume"
    assert not list((camp / ".claims").iterdir()), "claims outlived the run"
    ref = run_campaign(*make(), faults, CRITERIA, engine="naive")  # marker set: nobody dies
    assert res.table().equals(ref.table())


def test_torchrun_world_merges_to_the_one_process_result(tmp_path: Path) -> None:
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "tests/distributed/campaign_torchrun.py"), str(tmp_path), "5"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = pq.read_table(tmp_path / "merged.parquet")
    ref = run_campaign(*cm.tiny(), cm.mixed_faults(), CRITERIA)
    assert merged.equals(ref.table())
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["workers"] == 2 and manifest["ran_shards"] == list(range(5))
