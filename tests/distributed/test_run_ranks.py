"""``run_ranks``, the harness every distributed test stands on: results, deaths, hangs, env.

Ranks are forked by a forkserver that imported torch once; these tests pin what the children
must still get from the test process at each call (its environment and ``sys.path`` as they are
then, not as they were when the forkserver started) and that failures still name their rank.
"""

from __future__ import annotations

import os
import signal
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
