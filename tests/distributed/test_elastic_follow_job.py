"""``Job(follow=True)`` under ``stalwart run``: a replacement heals while the survivors commit.

The worker script is ``elastic_worker.py`` (a tiny MLP; ``--batchnorm`` adds float buffers, an
integer one and the step counts a follow sends at its promotion). A worker is SIGKILLed at
step 8; its replacement asks to follow, the survivors' rank 0 lends it a copy and pushes
each step, and the replacement joins the next epoch with a state whose digest equals the
survivors': nothing is sent at the epoch change (no ``state-received`` line), and every
member ends bit-identical, close to a plain one-process run. Timing only bounds liveness.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stalwart.elastic import read_events, summarize
from stalwart.elastic.events import EventKind
from stalwart.testing import Kill, KillSchedule

from .test_elastic import (
    RUN_TIMEOUT_S,
    STEPS,
    WORKER,
    _assert_close_to,
    _env,
    _finals,
    _launch,
    _periodic_digests_agree,
)

pytestmark = pytest.mark.timeout(150)


def _follows(events: dict[int, list[dict[str, Any]]], wid: int) -> list[dict[str, Any]]:
    return [e for e in events[wid] if e["kind"] == EventKind.FOLLOW]


def _single(tmp: Path) -> dict[str, Any]:
    """The worker script as one plain process: the parameters every run should come close to."""
    out = tmp / "single"
    cmd = [sys.executable, str(WORKER), "--steps", str(STEPS), "--out", str(out)]
    subprocess.run(cmd, env=_env(), check=True, capture_output=True, timeout=RUN_TIMEOUT_S)
    return _finals(out)["single"]


@pytest.mark.parametrize(
    "extra",
    [
        # the survivors commit on (slowly) while the replacement starts: steps are pushed to it
        ("--hold-at", "30", "--hold-size", "3", "--step-sleep", "0.2", "--batchnorm"),
        # the survivors wait at step 10 for it: promoted where no step commits (job.refresh)
        ("--hold-at", "10", "--hold-size", "3"),
    ],
    ids=["while-committing", "while-waiting"],
)
def test_replacement_follows_and_joins_with_nothing_sent(tmp_path: Path, extra: tuple) -> None:
    kill = Kill(worker=1, step=8, where="boundary")
    _launch(tmp_path, 3, KillSchedule((kill,)), *extra, "--follow", timeout_s=20)
    events = read_events(tmp_path / "events")
    assert sorted(events) == [0, 1, 2, 3], "one replacement, worker 3"
    pusher = {e["outcome"]: e for e in _follows(events, 0)}  # rank 0 of the survivors (0, 2)
    assert set(pusher) == {"started", "promoted"} and pusher["started"]["peer"] == 3, pusher
    (followed,) = _follows(events, 3)
    assert followed["outcome"] == "promoted", followed
    assert followed["step"] == pusher["promoted"]["step"] >= pusher["started"]["step"] >= 8
    assert not _follows(events, 2), "the other survivor takes no part"
    assert not any(e["kind"] == EventKind.STATE_RECEIVED for e in events[3]), (
        "the replacement joined with the survivors' digest: nothing was sent at the change"
    )
    assert not any(e["kind"] == EventKind.PARITY_MISMATCH for w in events for e in events[w])
    _periodic_digests_agree(events)
    summary = summarize(tmp_path / "events")
    assert (summary.follows, summary.heals) == (1, 0), "the run's summary counts the follow"
    finals = _finals(tmp_path / "out")
    assert sorted(finals) == ["0", "2", "3"]
    assert len({f["digest"] for f in finals.values()}) == 1, "bit parity at the end"
    assert {f["step"] for f in finals.values()} == {STEPS}
    if "--batchnorm" not in extra:  # batch statistics of a member's share differ from one run's
        _assert_close_to(_single(tmp_path)["params"], finals["3"]["params"])


def test_two_replacements_one_follows_the_other_heals(tmp_path: Path) -> None:
    # Workers 1 and 2 die at step 8; one replacement wins the follow, the other announces
    # itself at once and is healed at the epoch change (one follow at a time). Whichever way
    # the race goes, each replacement either was promoted or received the state, and every
    # member ends bit-identical.
    kills = (Kill(worker=1, step=8, where="boundary"), Kill(worker=2, step=8, where="boundary"))
    _launch(tmp_path, 3, KillSchedule(kills), "--hold-at", "20", "--hold-size", "3",
            "--step-sleep", "0.1", "--follow", timeout_s=20)  # fmt: skip
    events = read_events(tmp_path / "events")
    replacements = [w for w in events if w > 2]
    assert len(replacements) == 2, sorted(events)
    promoted = 0
    for w in replacements:
        followed = any(e["outcome"] == "promoted" for e in _follows(events, w))
        received = any(e["kind"] == EventKind.STATE_RECEIVED for e in events[w])
        assert followed != received, (w, _follows(events, w))
        promoted += followed
    assert summarize(tmp_path / "events").follows == promoted
    starts = [e for e in _follows(events, 0) if e["outcome"] == "started"]
    assert len(starts) <= 2 and len({e["peer"] for e in starts}) == len(starts)
    finals = _finals(tmp_path / "out")
    assert len(finals) == 3 and len({f["digest"] for f in finals.values()}) == 1
    assert {f["step"] for f in finals.values()} == {STEPS}
