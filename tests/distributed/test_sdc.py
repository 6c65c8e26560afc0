"""Silent data corruption caught in a real ``stalwart run``: one bit of one member's weights flips
(chaos ``BitFlip``), the parity check names the member and the tensor, every member rolls back
to the last agreed state and recomputes, and the run ends bit-identical to a fault-free one.
With two members nobody is decided by rank. A run with a kill becomes fleet-log rows that the
fleet reader accepts. gloo on CPU, ``elastic_worker.py``; nothing asserts a duration.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stalwart.diagnose.fleet import read_fleet
from stalwart.elastic import read_events
from stalwart.elastic.events import EventKind, launcher_lines
from stalwart.elastic.fleet_log import write_fleet_log
from stalwart.elastic.sdc import EXIT_EXCLUDED
from stalwart.elastic.supervisor import EXIT_FATAL
from stalwart.testing import Kill, KillSchedule
from stalwart.testing.chaos import BitFlip, GradFlip

from .test_elastic import RUN_TIMEOUT_S, STEPS, WORKER, _env

pytestmark = pytest.mark.timeout(200)


def _run(tmp: Path, nproc: int, schedule: KillSchedule | None, *launcher: str,
         code: int = 0) -> dict[str, Any]:  # fmt: skip
    cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", str(nproc), "--max-restarts", "2",
           "--events", str(tmp / "events"), "--timeout", "20", "--hang-timeout", "5", *launcher,
           "--json", str(WORKER), "--steps", str(STEPS), "--verify-every", "5"]  # fmt: skip
    done = subprocess.run(
        cmd, env=_env(schedule), capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    assert done.returncode == code, (
        f"stalwart run: rc {done.returncode}\n{done.stdout}\n" + (done.stderr[-4000:])
    )
    doc: dict[str, Any] = json.loads(done.stdout)
    doc["events"] = read_events(tmp / "events")
    return doc


def _kinds(doc: dict[str, Any], kind: EventKind) -> list[dict[str, Any]]:
    return [e for lines in doc["events"].values() for e in lines if e["kind"] == kind]


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """Fault-free runs of 3 and 2 workers: the references."""
    return {n: _run(tmp_path_factory.mktemp(f"clean{n}"), n, None) for n in (3, 2)}


def _flip(worker: int) -> KillSchedule:
    # after step 12; the check at step 15 sees it (verify every 5)
    return KillSchedule(flips=(BitFlip(worker, 12, "model.2.weight", index=4, bit=20),))


def test_a_clean_run_has_no_suspect(clean: dict[int, dict[str, Any]]) -> None:
    for doc in clean.values():
        assert _kinds(doc, EventKind.SDC_SUSPECT) == []
        assert _kinds(doc, EventKind.PARITY_MISMATCH) == [] and doc["final_digests_equal"]


def test_three_members_name_the_suspect_and_end_bit_identical(
    tmp_path: Path, clean: dict[int, dict[str, Any]]
) -> None:
    doc = _run(tmp_path, 3, _flip(1))
    suspects = _kinds(doc, EventKind.SDC_SUSPECT)
    assert sorted(e["wid"] for e in suspects) == [0, 1, 2], "every member writes it"
    for e in suspects:
        assert (e["suspect"], e["tensor"], e["decided_by"], e["step"]) == (
            1, "model.2.weight", "majority", 15,
        )  # fmt: skip
    for e in _kinds(doc, EventKind.PARITY_MISMATCH):
        assert (e["decision"], e["rolled_back_from"], e["step"]) == ("majority", 15, 10)
    assert doc["summary"]["final_digests"] == clean[3]["summary"]["final_digests"]


def test_a_nan_in_one_members_gradients_is_named_discarded_and_retried_clean(
    tmp_path: Path, clean: dict[int, dict[str, Any]]
) -> None:
    # worker 1's local gradient gets a NaN while step 12 is attempted, before the all-reduce
    doc = _run(tmp_path, 3, KillSchedule(grad_flips=(GradFlip(1, 12, "0.weight", index=3),)))
    suspects = _kinds(doc, EventKind.SDC_SUSPECT)
    assert sorted(e["wid"] for e in suspects) == [0, 1, 2], "every member decides alike"
    for e in suspects:
        assert (e["suspect"], e["decided_by"], e["step"]) == (1, "nonfinite-count", 12)
    discarded = [e for e in _kinds(doc, EventKind.STEP) if not e["committed"]]
    assert sorted(e["wid"] for e in discarded) == [0, 1, 2]
    assert {e["step"] for e in discarded} == {12}
    assert _kinds(doc, EventKind.FAULT_DETECTED) == [], "a discard, not a fault"
    assert doc["summary"]["final_digests"] == clean[3]["summary"]["final_digests"]


def test_two_members_are_never_decided_by_rank(
    tmp_path: Path, clean: dict[int, dict[str, Any]]
) -> None:
    doc = _run(tmp_path, 2, _flip(0))  # rank 0: the rank an old tie rule trusted
    for e in _kinds(doc, EventKind.PARITY_MISMATCH):
        assert (e["decision"], e["source"], e["rolled_back_from"]) == ("rollback", None, 15)
    suspects = {(e["suspect"], e["tensor"], e["decided_by"])
                for e in _kinds(doc, EventKind.SDC_SUSPECT)}  # fmt: skip
    assert suspects == {(0, "model.2.weight", "rollback"), (1, "model.2.weight", "rollback")}
    assert all(e["step"] == 0 for e in _kinds(doc, EventKind.STATE_RECEIVED)), "nobody adopted"
    assert doc["summary"]["final_digests"] == clean[2]["summary"]["final_digests"]


def test_a_killed_run_becomes_fleet_rows_the_reader_accepts(tmp_path: Path) -> None:
    doc = _run(tmp_path, 3, KillSchedule((Kill(worker=1, step=8, where="boundary"),)))
    assert doc["final_digests_equal"]
    rows = write_fleet_log(tmp_path / "events", tmp_path / "fleet" / "kill-run")
    crashes = [f for f in rows.faults if f["kind"] == "crash"]
    assert [(f["worker"], f["incarnation"], f["decided_by"]) for f in crashes] == [
        (1, 0, "exit-signal")
    ]
    assert crashes[0]["host"]["hostname"], "the host of the crashed worker's start line"
    assert {(m["worker"], m["incarnation"]) for m in rows.members} >= {(1, 0), (1, 1)}
    log = read_fleet(tmp_path / "fleet")
    assert log.faults.get("crash") == 1 and log.runs == 1


def test_a_flip_after_the_last_check_is_repaired_at_close_from_the_majority(
    tmp_path: Path, clean: dict[int, dict[str, Any]]
) -> None:
    # after the last step's check: close() finds it; nothing would recompute a rollback there
    flip = BitFlip(2, STEPS, "model.0.bias", index=3, bit=30)
    doc = _run(tmp_path, 3, KillSchedule(flips=(flip,)))
    suspects = {(e["suspect"], e["tensor"], e["step"]) for e in _kinds(doc, EventKind.SDC_SUSPECT)}
    assert suspects == {(2, "model.0.bias", STEPS)}
    for e in _kinds(doc, EventKind.PARITY_MISMATCH):
        assert (e["why"], e["decision"], e["rolled_back_from"]) == ("final", "majority", None)
    assert doc["summary"]["final_digests"] == clean[3]["summary"]["final_digests"]


def _launcher(doc: dict[str, Any], kind: EventKind) -> list[dict[str, Any]]:
    return [e for e in launcher_lines(Path(doc["events_dir"])) if e["kind"] == kind]


def test_a_member_named_twice_is_excluded_and_not_replaced(tmp_path: Path) -> None:
    # worker 1 flips after steps 7 and 17: named by the majority at the checks of steps 10
    # and 20; with --exclude-suspect-after 2 it leaves at the second, and nobody replaces it
    flips = tuple(BitFlip(1, s, "model.2.weight", index=4, bit=20) for s in (7, 17))
    doc = _run(tmp_path, 3, KillSchedule(flips=flips), "--exclude-suspect-after", "2")
    named = {(e["suspect"], e["step"]) for e in _kinds(doc, EventKind.SDC_SUSPECT)}
    assert named == {(1, 10), (1, 20)}
    exits = {e["wid"]: e for e in _launcher(doc, EventKind.EXITED)}
    assert (exits[1]["rc"], exits[1].get("excluded")) == (EXIT_EXCLUDED, True)
    assert [e["wid"] for e in _launcher(doc, EventKind.SPAWNED)] == [0, 1, 2], "no replacement"
    assert doc["excluded"] == [1] and doc["restarts"] == 0
    finals = doc["summary"]["final_digests"]
    assert sorted(finals) == ["0", "2"] and finals["0"] == finals["2"], "the others agree"
    rows = [f for f in write_fleet_log(tmp_path / "events").faults if f["worker"] == 1]
    assert sorted((f["kind"], f["decided_by"], f["step"]) for f in rows) == [
        ("sdc_suspect", "excluded", 20), ("sdc_suspect", "parity-majority", 10),
        ("sdc_suspect", "parity-majority", 20),
    ]  # fmt: skip
    assert all(f["host"]["hostname"] for f in rows), "the excluded worker's host"


def test_excluding_below_min_size_stops_with_a_clear_error(tmp_path: Path) -> None:
    flip = BitFlip(2, 7, "model.0.bias", index=1, bit=22)
    doc = _run(tmp_path, 3, KillSchedule(flips=(flip,)), "--exclude-suspect-after", "1",
               "--min-size", "3", code=EXIT_FATAL)  # fmt: skip
    assert doc["excluded"] == [2]
    assert "excluded after 1 SDC verdict" in doc["fatal"] and "--min-size 3" in doc["fatal"]
