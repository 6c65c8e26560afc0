"""``run_ranks``, the harness every distributed test stands on: results, deaths, hangs, env.

Ranks are forked by a forkserver that imported torch once; these tests pin what the children
must still get from the test process at each call (its environment and ``sys.path`` as they are
then, not as they were when the forkserver started) and that failures still name their rank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stalwart.errors import ConfigError, DistributedError
from stalwart.testing import run_ranks

from . import run_ranks_bodies as bodies

pytestmark = pytest.mark.timeout(120)


def test_results_come_back_in_rank_order_after_a_collective() -> None:
    assert run_ranks(bodies.sum_ranks, 3, 10) == [(0, 30), (1, 30), (2, 30)]


def test_children_get_the_environment_of_the_call_not_of_the_forkserver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run_ranks(bodies.sum_ranks, 1, 1)  # the forkserver is up before the variable exists
    monkeypatch.setenv("STALWART_TEST_PARENT_VAR", "from-parent")
    got = run_ranks(bodies.read_env, 2, "STALWART_TEST_PARENT_VAR")
    assert got == [("from-parent", True), ("from-parent", True)]
    monkeypatch.delenv("STALWART_TEST_PARENT_VAR")
    assert run_ranks(bodies.read_env, 1, "STALWART_TEST_PARENT_VAR") == [(None, False)]


def test_env_reaches_the_children_only_and_before_the_body_module_is_imported() -> None:
    got = run_ranks(
        bodies.read_env, 2, "STALWART_TEST_CHILD_VAR", env={"STALWART_TEST_CHILD_VAR": "7"}
    )
    assert got == [("7", True), ("7", True)]
    assert "STALWART_TEST_CHILD_VAR" not in os.environ


def test_children_see_the_callers_sys_path_as_it_is_at_the_call(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    run_ranks(bodies.sum_ranks, 1, 1)  # the forkserver is up before the folder is on the path
    monkeypatch.syspath_prepend(str(tmp_path))
    ((_, path),) = run_ranks(bodies.parent_and_path, 1)
    assert str(tmp_path) in path


def test_rank_output_reaches_the_capture_of_the_call(capfd: pytest.CaptureFixture[str]) -> None:
    run_ranks(bodies.sum_ranks, 1, 1)  # the forkserver may have started under another capture
    capfd.readouterr()
    run_ranks(bodies.say, 2, "hello")
    out, err = capfd.readouterr()
    assert "hello from rank 0" in out and "hello from rank 1" in out
    assert err.count("hello on stderr") == 2


def test_ranks_exit_when_their_caller_is_killed(tmp_path: Path) -> None:
    # A forked rank's parent is the forkserver, which lives while its ranks do: a rank that
    # watched its parent outlived a test runner killed by SIGKILL.
    driver = (
        "import sys; sys.path[:0] = sys.argv[2:]; "
        "from stalwart.testing import run_ranks; "
        "from tests.distributed import run_ranks_bodies as b; "
        "run_ranks(b.write_pid_then_sleep, 2, sys.argv[1], timeout_s=300)"
    )
    root = str(Path(__file__).resolve().parents[2])
    proc = subprocess.Popen([sys.executable, "-c", driver, str(tmp_path), root])
    try:
        pids = _wait_for_pids(tmp_path, 2, proc)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "ranks outlived their killed caller"


def _wait_for_pids(folder: Path, n: int, proc: subprocess.Popen[bytes]) -> list[int]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        files = sorted(folder.glob("rank*.pid"))
        if len(files) == n and all(f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.05)
    raise AssertionError(f"the ranks did not start (driver exit code {proc.poll()})")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited; its parent has not reaped it
        return f.read().split(") ")[-1][0] != "Z"


def test_an_expected_sigkill_gives_none_in_that_slot() -> None:
    got = run_ranks(bodies.die_on, 2, 1, expect_exit={1: -signal.SIGKILL})
    assert got == [0, None]


def test_an_unexpected_death_names_the_rank_and_its_signal() -> None:
    with pytest.raises(DistributedError, match=r"rank 1 exited with code -9 \(signal SIGKILL\)"):
        run_ranks(bodies.die_on, 2, 1)


def test_a_raising_rank_is_reported_with_its_traceback() -> None:
    with pytest.raises(DistributedError, match=r"(?s)rank 0 raised:.*ValueError: rank 0 refuses"):
        run_ranks(bodies.raise_on, 2, 0)


def test_a_hung_rank_is_killed_at_the_timeout_with_its_stack() -> None:
    with pytest.raises(DistributedError) as e:
        run_ranks(bodies.sleep_on, 2, 1, timeout_s=8)
    text = str(e.value)
    assert "rank(s) [1] did not finish within timeout_s=8" in text
    if hasattr(signal, "SIGUSR1"):
        assert "_stuck_here" in text


def test_a_lambda_is_refused_before_any_process_starts() -> None:
    with pytest.raises(ConfigError, match="module-level function"):
        run_ranks(lambda rank, world: rank, 2)
