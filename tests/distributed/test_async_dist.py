"""Asynchronous saves in a real gloo job (a group of their own, no deadlock, exact bytes),
and asynchronous DiLoCo with k < N on real ``stalwart run`` workers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stalwart.elastic import read_events
from stalwart.elastic.events import EventKind
from stalwart.testing import Delay, KillSchedule, run_ranks

from . import async_ranks

pytestmark = pytest.mark.timeout(180)


def test_lazy_saves_run_beside_training_collectives(tmp_path: Path) -> None:
    results = run_ranks(
        async_ranks.lazy_saves_beside_training_collectives, 2, str(tmp_path / "ck"), timeout_s=120
    )
    assert results == [[1, 2, 3, 4, 5]] * 2


WORKER = Path(__file__).with_name("diloco_worker.py")
VERSIONS, H = 20, 20


def test_async_diloco_with_k_below_n_converges_with_outer_momentum_0_9(tmp_path: Path) -> None:
    """Buffered(k=2 of 3), worker 2 slowed 2x, Nesterov 0.7/0.9 and the default (delayed
    Nesterov) rule: no divergence over 20 versions, one digest on every member, and one
    momentum update per 3 contributions. (The per-version Nesterov step diverged here.)"""
    slow = KillSchedule(delays=(Delay(worker=2, delay_s=0.01),))  # 2x its modelled compute
    env = {**os.environ, "OMP_NUM_THREADS": "1", **slow.to_env()}
    env.pop("STALWART_ELASTIC_STORE", None)
    cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", "3", "--max-restarts", "0",
           "--events", str(tmp_path / "events"), "--timeout", "30", str(WORKER), "--mode",
           "async", "--k", "2", "--fixed-h", "--compute-s", "0.01", "--trace", "--outer",
           str(VERSIONS), "--h", str(H), "--out", str(tmp_path / "out")]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, f"stalwart run failed:\n{done.stdout}\n{done.stderr[-4000:]}"
    finals = [torch.load(p) for p in sorted((tmp_path / "out").glob("final-*.pt"))]
    assert len(finals) == 3 and {f["steps"] for f in finals} == {VERSIONS}
    assert len({f["digest"] for f in finals}) == 1, "every member ends on the same state"
    initial = finals[0]["trace"][0][2]
    losses = [loss for f in finals for _, version, loss in f["trace"] if version >= 5]
    # Stated bound (no divergence): after the fifth version no member's traced loss is above
    # half the initial one, and the final loss is under a quarter of it (measured: 0.15 and
    # 0.22 at most; the per-version rule on the same run: 28x the initial loss, 47x at most).
    assert max(losses) < 0.5 * initial and finals[0]["loss"] < 0.25 * initial, (initial, losses)
    aggregates = sorted(
        (e for lines in read_events(tmp_path / "events").values() for e in lines
         if e["kind"] == EventKind.DILOCO_AGGREGATE),
        key=lambda e: e["version"],
    )  # fmt: skip
    assert [e["version"] for e in aggregates][:VERSIONS] == list(range(1, VERSIONS + 1))
    used = momentum = 0
    for e in aggregates[:VERSIONS]:
        used += len(e["used"])
        momentum += e["momentum"]
        assert momentum == used // 3, "one momentum update per round of 3 contributions"


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts /proc/self/fd")
def test_a_checkpointer_per_save_keeps_no_group_open(tmp_path: Path) -> None:
    counts = run_ranks(
        async_ranks.per_save_checkpointers_release_their_group, 2, str(tmp_path / "ck"),
        timeout_s=120,
    )  # fmt: skip
    for per_rank in counts:
        # after the first saves warm up (pools, the storage), no growth per save: a leaked
        # gloo group would add at least one socket each time
        assert per_rank[-1] <= per_rank[3], per_rank
