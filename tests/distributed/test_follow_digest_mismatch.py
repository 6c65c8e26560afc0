"""A follow whose digests differ at the promotion falls back on both sides of the pair.

``follow_diverging_worker.py``: worker 1 is SIGKILLed at step 8, its replacement follows
and diverges just before the digest comparison. The follower falls back to the heal; the
pusher must say so too (``fell-back``, never ``promoted``), and the replacement is healed
at the epoch change, so every member ends bit-identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.elastic import read_events, summarize
from stalwart.elastic.events import EventKind
from stalwart.testing import Kill, KillSchedule

from . import test_elastic
from .test_elastic import _finals, _launch

pytestmark = pytest.mark.timeout(120)

WORKER = Path(__file__).with_name("follow_diverging_worker.py")


def test_the_pusher_reports_fell_back_when_the_digests_differ(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(test_elastic, "WORKER", WORKER)  # _launch runs this script instead
    kill = Kill(worker=1, step=8, where="boundary")
    _launch(tmp_path, 3, KillSchedule((kill,)), "--hold-at", "10", "--hold-size", "3",
            "--follow", timeout_s=20)  # fmt: skip
    events = read_events(tmp_path / "events")
    follows = {(e["role"], e["outcome"]) for lines in events.values() for e in lines
               if e["kind"] == EventKind.FOLLOW}  # fmt: skip
    assert ("follower", "fell-back") in follows, follows
    assert ("pusher", "fell-back") in follows and ("pusher", "promoted") not in follows, follows
    assert any(e["kind"] == EventKind.STATE_RECEIVED for e in events[3]), "healed at the change"
    assert summarize(tmp_path / "events").follows == 0
    finals = _finals(tmp_path / "out")
    assert len({f["digest"] for f in finals.values()}) == 1, "bit parity at the end"
