"""``--nnodes MIN:MAX`` caps the nodes at once: a node that left makes room for a replacement.

Launchers' rendezvous and agent loops run on one real ``TCPStore`` (the host's); an agent's
workers are tiny Python processes. A node leaves by running out of workers, or dies (its
launcher SIGKILLed) and is counted out once the host has written its workers off.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stalwart.elastic.nodes import ask_kill, rendezvous, run_agent
from stalwart.elastic.protocol import keys
from stalwart.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


def _address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_node_that_left_makes_room_for_a_replacement(tmp_path: Path) -> None:
    address = _address()
    host, _, _ = rendezvous(address, 2)
    assert host is not None
    agent, agent_store, _ = rendezvous(address, 2)
    assert agent is None
    with pytest.raises(ConfigError, match="already has 2 nodes running"):
        rendezvous(address, 2)
    dying = [sys.executable, "-c", "raise SystemExit(1)"]  # its only worker fails, no restarts
    code, _ = run_agent(dying, 1, 0, dict(os.environ), agent_store, subprocess.DEVNULL, address,
                        tmp_path)  # fmt: skip
    assert code == 1, "the node left the job"
    replacement, _, node = rendezvous(address, 2)
    assert replacement is None and node == 1, "the replacement takes the departed node's place"


def test_a_dead_node_is_counted_out_once_the_host_wrote_its_workers_off(tmp_path: Path) -> None:
    address = _address()
    host, store, _ = rendezvous(address, 2)
    assert host is not None
    sleeper = [sys.executable, "-c", "import time; time.sleep(3)"]
    agent = subprocess.Popen([sys.executable, "-c", (
        "import os, subprocess, sys; from pathlib import Path\n"
        "from stalwart.elastic.nodes import rendezvous, run_agent\n"
        f"_, store, _ = rendezvous({address!r}, 2)\n"
        f"run_agent({sleeper!r}, 1, 0, dict(os.environ), store, subprocess.DEVNULL, "
        f"{address!r}, Path({str(tmp_path)!r}))")])  # fmt: skip
    deadline = time.monotonic() + 20
    while int(store.add(keys.NEXT_WID, 0)) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)  # its worker list is written before the worker starts
    agent.send_signal(signal.SIGKILL)  # the node dies: nobody reports its worker's exit
    agent.wait()
    with pytest.raises(ConfigError, match="already has 2 nodes running"):
        rendezvous(address, 2)  # worker 0 is not written off yet: the node may be alive
    ask_kill(store, 0)  # the host took the silent worker for hung
    replacement, _, node = rendezvous(address, 2)
    assert replacement is None and node == 1
    with pytest.raises(ConfigError, match="already has 2 nodes running"):
        rendezvous(address, 2)  # the dead node was counted out once, not at every join
