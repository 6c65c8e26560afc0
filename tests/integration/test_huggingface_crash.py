"""Hugging Face ``Trainer`` under SIGKILL: a killed training process resumes bit-identically.

Fresh interpreters (``train_crash_worker.py``): an uninterrupted run, runs that SIGKILL
themselves after a step (GPT-2 with dropout on, saves every 3 steps through
:class:`StalwartCallback`), and runs that resume through ``resume_path()``; losses and final
parameters must match the uninterrupted run's.
"""

from __future__ import annotations

import pathlib

import pytest

pytest.importorskip("transformers")

from tests.integration import train_crash_worker as worker

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def test_sigkill_mid_run_resumes_identically(tmp_path: pathlib.Path) -> None:
    worker.kill_and_resume(
        tmp_path,
        "hf",
        {
            "between-saves": {"kill": {"at": "step", "step": 8}},  # resumes from step 6
            "right-after-a-save": {"kill": {"at": "step", "step": 9}},  # resumes from 9
        },
    )
