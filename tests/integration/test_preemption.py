"""SIGTERM to a real training process: it saves the step it was at and exits; that step loads
bit for bit equal to an uninterrupted run stopped at the same step."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stalwart
from tests.integration.preempt_worker import build, train_step

pytestmark = pytest.mark.timeout(180)

WORKER = Path(__file__).with_name("preempt_worker.py")


def test_sigterm_saves_the_current_step_and_exits(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # wait until it trains (and has async saves behind it)
        if line.strip() == "step 7":
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    # the signal may be seen right after "step 7" (then nothing more is printed) or later
    last = max([7] + [int(ln.split()[1]) for ln in out.splitlines() if ln.startswith("step ")])
    ckpt = stalwart.Checkpointer(root)
    steps = ckpt.steps()
    assert steps[-1] == last and {3, 6} <= set(steps), steps  # async saves flushed too
    assert ckpt.manifest(last).metadata.get("stalwart.preempted") in ("SIGTERM", None)

    model, optimizer = build()  # the uninterrupted run, stopped at the same step
    for step in range(1, last + 1):
        train_step(model, optimizer, step)
    fresh_model, fresh_opt = build()
    state = stalwart.TrainingState(model=fresh_model, optimizer=fresh_opt)
    ckpt.load(state)
    for (name, a), b in zip(
        model.state_dict().items(), fresh_model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    for a, b in zip(optimizer.state.values(), fresh_opt.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a), "optimizer state differs"
