"""SIGTERM to ``stalwart run`` reaches its workers: they save and exit, none is left running.

A container runtime or job controller signals only the launcher (PID 1). The launcher
forwards the signal to its workers (their ``PreemptionGuard`` saves), waits for them, replaces
none, and exits with 128 + the signal; a second signal kills them at once. Real launches of a
tiny worker (no ``Job``: a guard around a sleeping loop, a ``Checkpointer`` per worker).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stalwart.elastic.stopping import STOP_GRACE_S

pytestmark = pytest.mark.timeout(60)

WORKER = """
import os, sys, time
import torch, stalwart

out, mode = sys.argv[1], sys.argv[2]
wid = os.environ["STALWART_ELASTIC_WORKER"]
ckpt = stalwart.Checkpointer(os.path.join(out, f"ckpt{wid}"))
with stalwart.PreemptionGuard() as guard:
    open(os.path.join(out, f"ready{wid}"), "w").write(str(os.getpid()))
    step = 0
    while not guard.requested:
        time.sleep(0.01)
        step += 1
    open(os.path.join(out, f"signalled{wid}"), "w").write(str(int(guard.received)))
    while mode == "hang":  # a final save that never ends
        time.sleep(0.01)
    if mode == "slow":  # a final save that takes a while: the launcher's copy comes during it
        time.sleep(0.5)
    guard.save_and_exit_if_requested(ckpt, step, {"w": torch.zeros(4)})
"""


def _launch(
    tmp: Path, mode: str, *rdzv: str, wids: tuple[int, ...] = (0, 1)
) -> tuple[subprocess.Popen[str], list[int]]:
    """Start a launcher (``--nproc len(wids)``) and wait for workers ``wids``: their pids."""
    script = tmp / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("STALWART_ELASTIC_STORE", None)
    cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", str(len(wids)), *rdzv,
           "--max-restarts", "2", "--events", str(tmp / "events"), "--json", str(script),
           str(tmp), mode]  # fmt: skip
    launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 30
    ready = [tmp / f"ready{w}" for w in wids]
    while not all(p.exists() and p.read_text() for p in ready):
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.05)
    return launcher, [int(p.read_text()) for p in ready]


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _stop(launcher: subprocess.Popen[str], pids: list[int]) -> None:
    """After a failed assertion: leave nothing running (these processes only, by id)."""
    for pid in [launcher.pid, *pids]:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)
    launcher.communicate()


def _exits(tmp: Path) -> dict[int, int]:
    lines = [json.loads(s) for s in (tmp / "events" / "launcher.jsonl").read_text().splitlines()]
    return {e["wid"]: e["rc"] for e in lines if e["kind"] == "exited"}


def test_sigterm_to_the_launcher_lets_every_worker_save_then_exits_143(tmp_path: Path) -> None:
    launcher, pids = _launch(tmp_path, "save")
    try:
        os.kill(launcher.pid, signal.SIGTERM)
        out, err = launcher.communicate(timeout=STOP_GRACE_S)
        assert launcher.returncode == 128 + signal.SIGTERM, err[-3000:]
        assert not [pid for pid in pids if _running(pid)], "workers left running"
    finally:
        _stop(launcher, pids)
    for wid in (0, 1):  # each worker's guard got SIGTERM and its save committed
        assert (tmp_path / f"signalled{wid}").read_text() == str(int(signal.SIGTERM))
        assert (tmp_path / f"ckpt{wid}").is_dir()
    assert _exits(tmp_path) == {0: 143, 1: 143}, "they exited by themselves, none replaced"
    doc = json.loads(out)
    assert doc["exit_code"] == 143 and doc["restarts"] == 0


def test_a_second_signal_stops_workers_stuck_in_their_save_at_once(tmp_path: Path) -> None:
    launcher, pids = _launch(tmp_path, "hang")
    try:
        os.kill(launcher.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while len(list(tmp_path.glob("signalled*"))) < 2:
            assert time.monotonic() < deadline, "the workers never got the signal"
            time.sleep(0.05)
        t0 = time.monotonic()
        os.kill(launcher.pid, signal.SIGTERM)
        launcher.communicate(timeout=STOP_GRACE_S / 2)
        assert time.monotonic() - t0 < STOP_GRACE_S / 3, "the second signal waited the grace"
        assert launcher.returncode == 128 + signal.SIGTERM
        assert not [pid for pid in pids if _running(pid)], "workers left running"
    finally:
        _stop(launcher, pids)
    assert _exits(tmp_path) == {0: -signal.SIGKILL, 1: -signal.SIGKILL}


def test_sigterm_to_an_agent_node_lets_its_workers_save_then_exits_143(tmp_path: Path) -> None:
    # An agent node (--rdzv, not the host) is one more launcher that a runtime signals alone.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        rdzv = ("--rdzv", f"127.0.0.1:{sock.getsockname()[1]}", "--nnodes", "1:2")
    host, pids = _launch(tmp_path, "save", *rdzv, wids=(0,))
    agent = None
    try:
        agent, agent_pids = _launch(tmp_path, "save", *rdzv, wids=(1,))
        pids += agent_pids
        os.kill(agent.pid, signal.SIGTERM)
        _, err = agent.communicate(timeout=STOP_GRACE_S)
        assert agent.returncode == 128 + signal.SIGTERM, err[-3000:]
        assert not _running(agent_pids[0]), "the agent's worker was left running"
        assert (tmp_path / "signalled1").read_text() == str(int(signal.SIGTERM))
        assert (tmp_path / "ckpt1").is_dir(), "the agent's worker did not save"
        assert host.poll() is None, "the host stops with its own signal only"
        os.kill(host.pid, signal.SIGTERM)
        host.communicate(timeout=STOP_GRACE_S)
        assert host.returncode == 128 + signal.SIGTERM
    finally:
        _stop(host, pids)
        if agent is not None:
            _stop(agent, [])
    assert _exits(tmp_path) == {0: 143, 1: 143}, "each worker exited by itself, none replaced"


def test_a_signal_to_the_whole_process_group_is_one_request_each_worker_saves(
    tmp_path: Path,
) -> None:
    # Ctrl-C in a terminal, or a scheduler signalling every process of the job: each worker
    # gets SIGTERM itself and again from the launcher during its save. The copy is not a
    # second request (which would kill the worker mid-save).
    launcher, pids = _launch(tmp_path, "slow")
    try:
        os.killpg(launcher.pid, signal.SIGTERM)
        _, err = launcher.communicate(timeout=STOP_GRACE_S)
        assert launcher.returncode == 128 + signal.SIGTERM, err[-3000:]
    finally:
        _stop(launcher, pids)
    for wid in (0, 1):
        assert (tmp_path / f"ckpt{wid}").is_dir(), f"worker {wid} died before its save"
    assert _exits(tmp_path) == {0: 143, 1: 143}
