"""``diloco_worker.py`` whose first member to claim buffer ``--kill-v`` dies right after the claim.

Whoever fills the buffer claims it, so the victim is chosen on the store (the first claimer
only; the member that takes its claim over lives). The SIGKILL lands inside the aggregation
(after the claim on ``diloco/b{v}/claim``, before version v+1 is published), the one moment a
``KillSchedule`` cannot reach: the other members must take the departed claimer's buffer
over. Every other flag is ``diloco_worker.py``'s.

Usage: diloco_claimer_kill_worker.py --kill-v V <diloco_worker.py flags>
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

from stalwart.elastic.async_outer import AsyncOuter

if __package__:
    from . import diloco_worker
else:  # run as a script by `stalwart run`
    import diloco_worker  # type: ignore[no-redef]


def _dying_aggregate(kill_v: int) -> Any:
    aggregate = AsyncOuter._aggregate

    def wrapped(self: AsyncOuter, v: int, n: int) -> None:
        mark = str(self.wid)
        if v == kill_v and bytes(self.store.compare_set("test/killed", "", mark)) == mark.encode():
            os.kill(os.getpid(), signal.SIGKILL)
        aggregate(self, v, n)

    return wrapped


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--kill-v", type=int, required=True)
    a, rest = parser.parse_known_args()
    AsyncOuter._aggregate = _dying_aggregate(a.kill_v)
    sys.argv[1:] = rest
    diloco_worker.main()


if __name__ == "__main__":
    main()
