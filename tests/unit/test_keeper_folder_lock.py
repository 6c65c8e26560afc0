"""One live writer per keep_in folder and rank; a killed trainer's restart writes again."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stalwart.checkpoint.memory.tiers import Tier, TieredCheckpointer
from stalwart.checkpoint.policy import KeepLast
from stalwart.errors import ConfigError

pytestmark = pytest.mark.timeout(120)


def _kept(folder: Path) -> TieredCheckpointer:
    return TieredCheckpointer([Tier.memory(keep=KeepLast(1), keep_in=folder)])


def test_a_second_writer_of_the_same_keep_in_folder_is_refused(tmp_path: Path) -> None:
    # Both wrote rank00000-slot0: A.recover restored B's values as A's, silently.
    a, b = _kept(tmp_path / "shm"), _kept(tmp_path / "shm")
    a.save(5, {"w": torch.full((4,), 1.0)})
    with pytest.raises(ConfigError, match=r"keep_in folder .* already has a live writer"):
        b.save(5, {"w": torch.full((4,), 7.0)})
    state = {"w": torch.zeros(4)}
    assert (a.recover(state).source, state["w"].tolist()) == ("memory", [1.0] * 4)
    a.close()  # releases the folder: B may write it now
    b.save(6, {"w": torch.full((4,), 7.0)})
    b.close()
    again = _kept(tmp_path / "shm")
    assert [s.step for s in again.snapshots] == [6]
    again.close()


CHILD = """
import os, signal, sys, torch
from stalwart.checkpoint.memory.tiers import Tier, TieredCheckpointer
from stalwart.checkpoint.policy import KeepLast
tc = TieredCheckpointer([Tier.memory(keep=KeepLast(1), keep_in=sys.argv[1])])
tc.save(1, {"w": torch.full((4,), 1.0)})
os.kill(os.getpid(), signal.SIGKILL)  # dies holding the folder's lock
"""


def test_a_trainer_restarted_after_a_kill_writes_its_folder_again(tmp_path: Path) -> None:
    folder = tmp_path / "shm"
    proc = subprocess.run([sys.executable, "-c", CHILD, str(folder)], timeout=100)
    assert proc.returncode == -signal.SIGKILL
    restarted = _kept(folder)
    assert [s.step for s in restarted.snapshots] == [1]
    restarted.save(2, {"w": torch.full((4,), 2.0)})  # the kernel released the dead one's lock
    assert [s.step for s in restarted.snapshots] == [2]
    restarted.close()


def test_a_forked_child_does_not_keep_the_folder_held(tmp_path: Path) -> None:
    # A DataLoader worker forked after the claim inherited the lock's fd: the trainer's
    # restart found the folder held (by the dead trainer's pid) until the worker exited.
    import os
    import time

    a = _kept(tmp_path / "shm")
    a.save(1, {"w": torch.ones(4)})
    started, started_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker: lives on past the trainer's close
        os.write(started_w, b"x")  # the fork's handlers have run by the time fork() returns
        time.sleep(3)
        os._exit(0)
    try:
        # On a loaded machine the child may not have run at all yet: wait until it has, so
        # the claim below tests what the child does, not whether it got the CPU in time.
        assert os.read(started, 1) == b"x"
        a.close()
        b = _kept(tmp_path / "shm")
        b.save(2, {"w": torch.ones(4)})  # raised "already has a live writer"
        b.close()
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(started)
        os.close(started_w)
