"""Run by the tests under ``torchrun --nproc-per-node N``: one sharded campaign, rank 0 writes
the merged per-trial table and manifest. Usage: campaign_torchrun.py DIRECTORY SHARDS."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq

from stalwart.vulnerability import scale
from tests.distributed import campaign_models as cm

if __name__ == "__main__":
    out, shards = Path(sys.argv[1]), int(sys.argv[2])
    res = scale.run_rank(
        cm.tiny, cm.mixed_faults(), out / "camp", ["top1", "dev>0.05"], shards=shards
    )
    if res is not None:
        pq.write_table(res.table(), out / "merged.parquet")
        (out / "manifest.json").write_text(json.dumps(res.manifest))
