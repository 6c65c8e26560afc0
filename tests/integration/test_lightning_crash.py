"""Lightning under SIGKILL: a real training process killed mid-run resumes bit-identically.

Fresh interpreters (``train_crash_worker.py``): an uninterrupted run, runs that SIGKILL
themselves at fixed points, and runs that resume from the newest complete checkpoint
(``ckpt_path=".../last.ckpt"`` through :class:`StalwartCheckpointIO`); losses and final
parameters must match the uninterrupted run's.
"""

from __future__ import annotations

import pathlib

import pytest

pytest.importorskip("lightning.pytorch")

from tests.integration import train_crash_worker as worker

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def test_sigkill_mid_run_resumes_identically(tmp_path: pathlib.Path) -> None:
    worker.kill_and_resume(
        tmp_path,
        "lightning",
        {
            # mid-epoch 3, between saves: resumes from the step-8 checkpoint
            "mid-epoch": {"kill": {"at": "step", "step": 10}},
            # right after an async save at step 12 returned: its write and commit are in
            # flight, so the run resumes from step 12 or, if the commit did not land, step 8
            "async-save-in-flight": {"kill": {"at": "save", "step": 12}, "async": True},
        },
    )
