"""Sharded campaigns on a local Ray (one session for the module: Ray starts slowly).

Skipped, with the reason, where Ray is not installed (the ``ray`` extra). The merged result
must equal a one-process ``run_campaign`` trial for trial; a Ray worker SIGKILLed mid-run
fails the call with the resume hint, and the same call then runs only the missing shards.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stalwart.errors import DistributedError
from stalwart.vulnerability import estimate, run_campaign, scale

from . import campaign_models as cm

ray = pytest.importorskip(
    "ray", reason="Ray is not installed: pip install 'stalwart[ray]' runs these tests"
)

pytestmark = pytest.mark.timeout(300)

CRITERIA = ["top1", "dev>0.05"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[Any]:
    """Two CPUs; the actors import the factories from this checkout's tests package."""
    path = os.pathsep.join([str(ROOT), str(ROOT / "src")])
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    yield ray
    ray.shutdown()


def test_ray_actors_merge_to_the_one_process_result(tmp_path: Path) -> None:
    faults = cm.mixed_faults()
    ref = run_campaign(*cm.tiny(), faults, CRITERIA)
    res = scale.run_sharded(cm.tiny, faults, tmp_path, CRITERIA, workers=2, backend="ray", shards=6)
    assert len(res) == len(ref) == 300
    assert res.table().equals(ref.table())
    for by in ("bit", "layer"):
        assert estimate(res, by).rows == estimate(ref, by).rows
    assert res.manifest["backend"] == "ray" and res.manifest["ran_shards"] == list(range(6))
    assert ray.is_initialized(), "a Ray the caller started must stay up"


def test_a_killed_ray_worker_is_resumed_without_rerunning_finished_shards(
    tmp_path: Path,
) -> None:
    marker = str(tmp_path / "died")
    # each actor's first shard takes 39 forward passes (naive engine); the 50th is in its second
    make = functools.partial(cm.dies_on_rank, -1, 50, marker)
    faults = cm.mixed_faults(make=make)
    camp = tmp_path / "camp"
    kw = {"workers": 2, "backend": "ray", "shards": 8, "engine": "naive"}
    with pytest.raises(DistributedError, match=r"Ray worker failed.*run the same call again"):
        scale.run_sharded(make, faults, camp, CRITERIA, **kw)
    done = {p.name: os.stat(p).st_mtime_ns for p in camp.glob("shard-*.npz")}
    assert 0 < len(done) < 8
    res = scale.run_sharded(make, faults, camp, CRITERIA, **kw)
    assert res.manifest["ran_shards"] == sorted(set(range(8)) - {int(n[6:11]) for n in done})
    assert {n: os.stat(camp / n).st_mtime_ns for n in done} == done  # not re-run
    ref = run_campaign(*make(), faults, CRITERIA, engine="naive")  # marker set: nobody dies
    assert res.table().equals(ref.table())
