"""A replacement whose first step is discarded keeps the survivors' BatchNorm statistics.

A real ``stalwart run`` of ``elastic_worker.py --batchnorm`` (gloo on CPU): worker 1 dies at
step 6 and replacement 4 heals in; the job holds at step 10 for four members; worker 2 dies
at the boundary of step 10, the replacement's first step, which every member discards. Were
the replacement's buffers not put back, its statistics would differ from the survivors', a
majority would name it an SDC suspect and ``--exclude-suspect-after 1`` would remove it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.testing import Kill, KillSchedule

from .test_elastic import RUN_TIMEOUT_S, WORKER, _env

pytestmark = pytest.mark.timeout(150)


def test_a_replacements_discarded_first_step_is_no_sdc_verdict(tmp_path: Path) -> None:
    schedule = KillSchedule((Kill(worker=1, step=6, where="boundary"),
                             Kill(worker=2, step=10, where="boundary")))  # fmt: skip
    cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", "4", "--max-restarts", "1",
           "--exclude-suspect-after", "1", "--events", str(tmp_path / "events"),
           "--timeout", "20", "--hang-timeout", "5", "--json", str(WORKER), "--steps", "16",
           "--verify-every", "4", "--batchnorm", "--hold-at", "10", "--hold-size", "4",
           "--out", str(tmp_path / "out")]  # fmt: skip
    done = subprocess.run(
        cmd, env=_env(schedule), capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    assert done.returncode == 0, f"stalwart run failed:\n{done.stdout}\n{done.stderr[-4000:]}"
    doc = json.loads(done.stdout)
    assert doc["excluded"] == [] and doc["summary"]["parity_mismatches"] == 0
    assert doc["final_digests_equal"] and doc["summary"]["final_step"] == 16
    assert [r["worker"] for r in doc["recoveries"]] == [1, 2]
