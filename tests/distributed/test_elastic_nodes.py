"""Several nodes in one job: launchers meet at ``--rdzv``; a node joins, then leaves.

Nodes are simulated as separate ``stalwart run`` launchers on this machine. Real processes and
gloo; timing only bounds liveness.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stalwart.elastic import launch, read_events
from stalwart.elastic.events import EventKind
from stalwart.elastic.nodes import parse_nnodes, rendezvous
from stalwart.errors import ConfigError
from stalwart.testing import Kill, KillSchedule

from .test_elastic import STEPS, WORKER, _env, _finals

pytestmark = pytest.mark.timeout(180)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _node(
    tmp: Path, port: int, nproc: int, *extra: str, env: dict[str, str]
) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "stalwart", "run", "--rdzv", f"127.0.0.1:{port}",
           "--nnodes", "1:2", "--nproc", str(nproc), "--events", str(tmp / "events"),
           "--timeout", "20", "--hang-timeout", "3", "--json", *extra, str(WORKER),
           "--steps", str(STEPS), "--verify-every", "5", "--out", str(tmp / "out"),
           "--hold-at", "5", "--hold-size", "3"]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_second_node_joins_and_leaves_the_running_job(tmp_path: Path) -> None:
    # Node A (2 workers) hosts the job; its members wait at step 5 for a third. Node B (1
    # worker, id 2) joins; at step 12 its worker dies and, with no restarts, node B leaves.
    # A's workers never restart and finish with equal digests.
    port = _free_port()
    host = _node(tmp_path, port, 2, env=_env())
    try:
        # the second node joins a running job: wait until node A's two workers formed an epoch
        while not _reconfigured(tmp_path, 0):
            assert host.poll() is None, host.communicate()[1][-3000:]
            time.sleep(0.05)
        chaos = KillSchedule((Kill(worker=2, step=12),))
        agent = _node(tmp_path, port, 1, "--max-restarts", "0", env=_env(chaos))
        a_out, a_err = agent.communicate(timeout=150)
        h_out, h_err = host.communicate(timeout=150)
    finally:
        for p in (host, locals().get("agent")):
            if p is not None and p.poll() is None:
                p.kill()
    assert host.returncode == 0, h_err[-4000:]
    assert agent.returncode == 1, a_err[-4000:]  # the node left: its worker died, no restarts
    doc = json.loads(h_out)
    assert doc["ok"] and doc["summary"]["final_step"] == STEPS
    events = read_events(tmp_path / "events")
    assert sorted(events) == [0, 1, 2]
    sizes = [tuple(e["members"]) for e in events[0] if e["kind"] == EventKind.RECONFIGURED]
    assert sizes[:3] == [(0, 1), (0, 1, 2), (0, 1)], sizes
    assert any(e["kind"] == EventKind.STATE_RECEIVED for e in events[2]), "the newcomer healed"
    finals = _finals(tmp_path / "out")
    assert sorted(finals) == ["0", "1"]
    assert len({f["digest"] for f in finals.values()}) == 1
    assert {f["step"] for f in finals.values()} == {STEPS}


def _reconfigured(tmp: Path, wid: int) -> bool:
    try:
        lines = read_events(tmp / "events").get(wid, [])
    except (OSError, ValueError):  # the file is being written
        return False
    return any(e["kind"] == EventKind.RECONFIGURED for e in lines)


def test_rendezvous_hosts_once_and_refuses_nodes_past_max() -> None:
    port = _free_port()
    coord, _, node = rendezvous(f"127.0.0.1:{port}", 2)
    assert coord is not None and node == 0
    agent, _, second = rendezvous(f"127.0.0.1:{port}", 2)
    assert agent is None and second == 1
    with pytest.raises(ConfigError, match="already has 2 nodes"):
        rendezvous(f"127.0.0.1:{port}", 2)
    with pytest.raises(ConfigError, match="HOST:PORT"):
        rendezvous("nowhere", 2)
    assert parse_nnodes("1:3") == (1, 3) and parse_nnodes("2") == (2, 2)
    with pytest.raises(ConfigError, match="MIN:MAX"):
        parse_nnodes("3:1")
    # Several nodes and no address to meet at: it waited the whole join timeout, then ran alone.
    with pytest.raises(ConfigError, match="needs --rdzv HOST:PORT"):
        launch(WORKER, nproc=1, nnodes="2:2")
