"""Sharded campaigns in one process (the ``local`` back-end), the campaign directory and merge.

The merged result must equal a one-process ``run_campaign`` on every trial, in order: the
per-trial table, each criterion's outcomes and rates, and the PVF reports built on them.
Worker processes (torch, Ray) are tested in tests/distributed/test_campaign_*.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from stalwart.errors import ConfigError, MissingDependencyError
from stalwart.vulnerability import CampaignResult, estimate, run_campaign, sample_faults, scale
from stalwart.vulnerability.scale.shards import CampaignDirectory, payload_of
from tests.distributed import campaign_models as cm

pytestmark = pytest.mark.timeout(120)

CRITERIA = ["top1", "dev>0.05"]


@pytest.fixture(scope="module")
def reference() -> CampaignResult:
    """The one-process campaign every sharded run must reproduce."""
    model, x = cm.tiny()
    return run_campaign(model, x, cm.mixed_faults(), CRITERIA)


def assert_same(merged: CampaignResult, ref: CampaignResult) -> None:
    """Trial for trial, in order, and the PVF reports on top."""
    assert len(merged) == len(ref) == len(cm.mixed_faults())
    assert merged.faults.faults == ref.faults.faults
    assert merged.table().equals(ref.table())
    for c in ref.criteria:
        assert np.array_equal(merged.failed[c], ref.failed[c])
        assert np.array_equal(merged.rate[c], ref.rate[c], equal_nan=True)
    for by in ("bit", "layer", "tensor"):
        a, b = estimate(merged, by), estimate(ref, by)
        assert a.rows == b.rows
        assert a.overall == b.overall


def test_plan_is_contiguous_and_independent_of_workers() -> None:
    plan = scale.plan_shards(10, 4)
    assert [(s.start, s.stop) for s in plan] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert [s.index for s in scale.plan_shards(3, 8)] == [0, 1, 2]  # never an empty shard
    with pytest.raises(ConfigError, match="shards must be >= 1"):
        scale.plan_shards(10, 0)


def test_local_shards_merge_to_the_one_process_result(
    tmp_path: Path, reference: CampaignResult
) -> None:
    faults = cm.mixed_faults()
    res = scale.run_sharded(cm.tiny, faults, tmp_path, CRITERIA, backend="local", shards=7)
    assert_same(res, reference)
    assert res.manifest["shards"] == 7 and res.manifest["ran_shards"] == list(range(7))
    assert res.manifest["trials"] == len(reference)
    assert sorted(p.name for p in tmp_path.glob("shard-*.npz")) == [
        f"shard-{i:05d}.npz" for i in range(7)
    ]


def test_resume_runs_only_the_missing_shards(tmp_path: Path, reference: CampaignResult) -> None:
    faults = cm.mixed_faults()
    scale.run_sharded(cm.tiny, faults, tmp_path, CRITERIA, backend="local", shards=5)
    for i in (1, 3):
        (tmp_path / f"shard-{i:05d}.npz").unlink()
    # a worker killed mid-write leaves only a temporary file: that shard is not done
    (tmp_path / ".shard-00003.npz.abc.tmp").write_bytes(b"half")
    kept = {p.name: os.stat(p).st_mtime_ns for p in tmp_path.glob("shard-*.npz")}
    res = scale.run_sharded(cm.tiny, faults, tmp_path, CRITERIA, backend="local", shards=99)
    assert res.manifest["ran_shards"] == [1, 3]
    assert res.manifest["shards"] == 5  # the stored plan wins over the new shard count
    assert {n: os.stat(tmp_path / n).st_mtime_ns for n in kept} == kept
    assert_same(res, reference)
    assert not list(tmp_path.glob(".*.tmp"))  # leftovers of killed writers are swept
    again = scale.run_sharded(cm.tiny, faults, tmp_path, CRITERIA, backend="local")
    assert again.manifest["ran_shards"] == []
    assert_same(again, reference)


def test_a_directory_is_never_resumed_with_another_campaign(tmp_path: Path) -> None:
    scale.run_sharded(cm.tiny, cm.mixed_faults(seed=0), tmp_path, "top1", backend="local")
    with pytest.raises(ConfigError, match="holds another campaign"):
        scale.run_sharded(cm.tiny, cm.mixed_faults(seed=1), tmp_path, "top1", backend="local")
    with pytest.raises(ConfigError, match="holds another campaign"):
        scale.run_sharded(cm.tiny, cm.mixed_faults(seed=0), tmp_path, "top5", backend="local")


def test_merge_refuses_shards_from_different_models(tmp_path: Path) -> None:
    faults = cm.mixed_faults()
    scale.run_sharded(cm.tiny, faults, tmp_path, CRITERIA, backend="local", shards=2)
    plan, store = scale.plan_shards(len(faults), 2), CampaignDirectory(tmp_path)
    parts = [store.load(s, faults) for s in plan]
    assert (
        scale.merge(faults, plan, parts)
        .table()
        .equals(run_campaign(*cm.tiny(), faults, CRITERIA).table())
    )
    parts[1].manifest = parts[1].manifest | {"model_hash": "0" * 16}
    with pytest.raises(ConfigError, match="different models"):
        scale.merge(faults, plan, parts)


def test_shard_file_round_trips_bit_for_bit(tmp_path: Path, reference: CampaignResult) -> None:
    store = CampaignDirectory(tmp_path)
    (shard,) = scale.plan_shards(len(reference), 1)
    store.save(shard, payload_of(reference))
    back = store.load(shard, reference.faults)
    assert back.table().equals(reference.table())
    assert back.manifest == reference.manifest


def test_a_damaged_campaign_folder_says_what_to_delete(tmp_path: Path) -> None:
    # A truncated or foreign shard file, or a damaged campaign.json, raised BadZipFile,
    # JSONDecodeError or numpy's pickle refusal (exit 3 from the CLI).
    faults = cm.mixed_faults()
    scale.run_sharded(cm.tiny, faults, tmp_path, CRITERIA, backend="local", shards=2)
    plan, store = scale.plan_shards(len(faults), 2), CampaignDirectory(tmp_path)
    shard = tmp_path / plan[1].name
    intact = shard.read_bytes()
    for damaged in (intact[: len(intact) // 2], b"", b"not a zip at all"):
        shard.write_bytes(damaged)
        with pytest.raises(ConfigError, match=r"is damaged .*delete it and run again"):
            store.load(plan[1], faults)
    shard.write_bytes(intact)
    assert store.load(plan[1], faults).table().num_rows == plan[1].stop - plan[1].start
    (tmp_path / "campaign.json").write_text("{ not json")
    with pytest.raises(ConfigError, match=r"is damaged .*to start the campaign over"):
        scale.run_sharded(cm.tiny, faults, tmp_path, CRITERIA, backend="local", shards=2)


def test_a_shard_with_outcomes_of_the_wrong_length_is_damaged(
    tmp_path: Path, reference: CampaignResult
) -> None:
    store = CampaignDirectory(tmp_path)
    (shard,) = scale.plan_shards(len(reference), 1)
    short = payload_of(reference)
    short["failed_0"] = short["failed_0"][:-1]  # a shard file whose arrays do not match
    store.save(shard, short)
    with pytest.raises(ConfigError, match=r"'failed_0' for \d+ trials: it is damaged"):
        store.load(shard, reference.faults)


def test_progress_and_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, _ = cm.tiny()
    faults = sample_faults(model, 20, seed=3)
    res = scale.run_sharded(cm.tiny, faults, tmp_path, backend="local", shards=2, progress=True)
    assert len(res) == 20
    with pytest.raises(ConfigError, match="backend must be one of"):
        scale.run_sharded(cm.tiny, faults, tmp_path, backend="mpi")
    with pytest.raises(ConfigError, match="must return"):
        scale.run_sharded(lambda: model, faults, tmp_path / "x", backend="local")
    with pytest.raises(ConfigError, match="torchrun"):
        scale.run_rank(cm.tiny, faults, tmp_path)


def test_missing_ray_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # what an environment without Ray sees
    model, _ = cm.tiny()
    faults = sample_faults(model, 8, seed=0)
    with pytest.raises(MissingDependencyError, match=r"stalwart\[ray\]"):
        scale.run_sharded(cm.tiny, faults, tmp_path, backend="ray", workers=2)


def test_module_entry_runs_resumes_and_refuses_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import pyarrow.parquet as pq

    from stalwart.vulnerability.scale.__main__ import main

    args = ["tests.distributed.campaign_models:tiny", "--dir", str(tmp_path), "--trials", "40"]
    assert main([*args, "--backend", "local", "--shards", "3", "-c", "top1"]) == 0
    model, x = cm.tiny()
    ref = run_campaign(model, x, sample_faults(model, 40, seed=0), "top1")
    assert pq.read_table(tmp_path / "trials.parquet").equals(
        ref.table().replace_schema_metadata(pq.read_schema(tmp_path / "trials.parquet").metadata)
    )
    assert (tmp_path / "pvf.json").exists() and "40 trials" in capsys.readouterr().err
    assert main(["mlp", "--dir", str(tmp_path / "y"), "--backend", "local"]) == 2
    assert "package.module:factory" in capsys.readouterr().err
