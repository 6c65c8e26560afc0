"""``summarize`` counts failed members, never the survivors that committed the step.

Synthetic events folders: worker files written through ``EventLog`` and a launcher log.
"""

from __future__ import annotations

from pathlib import Path

from stalwart.elastic.events import LAUNCHER_LOG, EventKind, EventLog, summarize


def _backup_run(folder: Path, *, launcher: bool) -> None:
    """4 members; worker 1 dies mid-step: only worker 0 (waiting on the result) reports it,
    2 and 3 commit. Then worker 4 replaces it and worker 0 again reports, 2 and 3 commit."""
    for wid in (0, 2, 3):
        log = EventLog(folder, wid)
        log.write(EventKind.RECONFIGURED, step=0, epoch=1, members=[0, 1, 2, 3])
        if wid == 0:
            log.write(EventKind.FAULT_DETECTED, step=5, epoch=1, members=[0, 1, 2, 3], error="x")
        log.write(EventKind.RECONFIGURED, step=6, epoch=2, members=[0, 2, 3])
        if wid == 0:
            log.write(EventKind.FAULT_DETECTED, step=11, epoch=2, members=[0, 2, 3], error="x")
        log.write(EventKind.RECONFIGURED, step=12, epoch=3, members=[0, 2, 3, 4])
        log.close()
    if launcher:
        log = EventLog(folder, -1, name=LAUNCHER_LOG)
        for wid in range(4):
            log.write(EventKind.SPAWNED, wid=wid, replaces=None)
        log.write(EventKind.EXITED, wid=1, rc=-9, stopped=False)
        log.write(EventKind.SPAWNED, wid=4, replaces=1)
        for wid in (0, 2, 3, 4):
            log.write(EventKind.EXITED, wid=wid, rc=0, stopped=False)
        log.close()


def test_survivors_that_committed_are_not_counted_as_failed(tmp_path: Path) -> None:
    _backup_run(tmp_path, launcher=True)
    s = summarize(tmp_path)
    assert (s.faults, s.fault_reports) == (1, 2), "worker 1 died; 2 and 3 only committed"


def test_without_a_launcher_log_the_next_epoch_says_who_failed(tmp_path: Path) -> None:
    _backup_run(tmp_path, launcher=False)
    assert summarize(tmp_path).faults == 1, "epoch 2 lacks worker 1; epoch 3 lacks nobody"


def test_a_death_nobody_reported_still_counts_and_a_stopped_joiner_does_not(
    tmp_path: Path,
) -> None:
    log = EventLog(tmp_path, -1, name=LAUNCHER_LOG)
    log.write(EventKind.EXITED, wid=1, rc=-9, stopped=False)  # died between steps
    log.write(EventKind.EXITED, wid=5, rc=-15, stopped=True)  # a joiner the job did not need
    log.write(EventKind.EXITED, wid=6, rc=-9, stopped=False, taken_down_by=1)
    log.close()
    EventLog(tmp_path, 0).close()
    assert summarize(tmp_path).faults == 1
