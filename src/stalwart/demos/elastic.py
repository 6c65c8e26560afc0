"""The ``stalwart demo`` section for elastic training: a worker killed, one paused, both replaced.

Three workers (real processes, gloo on CPU) train a small MLP under :func:`stalwart.elastic.launch`.
Worker 1 is SIGKILLed inside its gradient all-reduce at step 10; worker 2 is SIGSTOPped (a
hung host) at step 25 and taken for hung when its heartbeats stop. Worker 0 never stops: it
discards the step each fault cost, trains on alone, and heals each replacement peer to peer.
The table shows, per fault, the detection time, the survivors' lost steps, where the
replacement's state came from and how long its rejoin took, and the digests of the members
that finished, which must be equal.

The same file is the worker script: ``launch`` runs it with ``--worker``.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["run_elastic_demo"]

STEPS, HOLD_AT, HANG_S = 60, 45, 2.0
KILL_STEP, STOP_STEP = 10, 25


def _schedule() -> Any:
    from stalwart.testing.chaos import Kill, KillSchedule

    return KillSchedule(
        (
            Kill(worker=1, step=KILL_STEP, where="collective", delay_s=0.001),
            Kill(worker=2, step=STOP_STEP, where="boundary", signal="STOP"),
        )
    )


def _worker() -> None:
    """One member: a tiny MLP on a fixed global batch per step, split among the members."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from stalwart.checkpoint.training_state import TrainingState
    from stalwart.elastic import Job
    from stalwart.testing import chaos

    logging.getLogger("stalwart").setLevel(logging.ERROR)  # the tables tell the story
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    job = Job(TrainingState(model=model, optimizer=opt), verify_every=5)
    chaos.install(job)
    optimizer = job.optimizer(opt)
    while job.step < STEPS:
        while job.step == HOLD_AT and job.size < 3:
            job.refresh()  # wait for the replacements, so that the end shows three members
        optimizer.zero_grad()
        g = torch.Generator().manual_seed(job.step)
        x = torch.randn(12, 8, generator=g)[job.rank :: job.size]
        F.mse_loss(model(x), torch.sin(x.sum(1, keepdim=True))).backward()
        time.sleep(0.02)  # a step long enough to watch
        optimizer.step()
    job.close()


def _heal(events: list[dict[str, Any]]) -> tuple[str, int | None]:
    got = next((e for e in events if e["kind"] == "state-received"), None)
    return ("-", None) if got is None else (f"worker {got['source']}", int(got["step"]))


def _tables(result: Any, events: dict[int, list[dict[str, Any]]]) -> tuple[Table, Table]:
    faults = {1: f"SIGKILL in all-reduce, step {KILL_STEP}", 2: f"SIGSTOP, step {STOP_STEP}"}
    rec = Table(title="elastic: 3 workers, one killed, one paused; worker 0 never stops")
    for col in ("worker", "fault", "detected", "survivors commit", "lost steps", "replaced by",
                "healed from (step)", "rejoin"):  # fmt: skip
        rec.add_column(col)
    for r in result.recoveries:
        source, step = _heal(events.get(r.replacement, []) if r.replacement is not None else [])
        rec.add_row(
            str(r.worker), faults.get(r.worker, f"exit {r.exit_code}"), _s(r.detect_s),
            _s(r.resume_s), str(r.lost_steps), "-" if r.replacement is None else str(r.replacement),
            source if step is None else f"{source} ({step})", _s(r.rejoin_s),
        )  # fmt: skip
    digests = Table(title=f"final state of the members at step {result.summary.final_step}")
    for col in ("worker", "starts", "digest"):
        digests.add_column(col)
    for wid, digest in sorted(result.summary.final_digests.items()):
        starts = sum(e["kind"] == "start" for e in events.get(wid, []))
        digests.add_row(str(wid), str(starts), digest)
    return rec, digests


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def run_elastic_demo(console: Console, events_dir: Path | None = None) -> bool:
    """Run the section; True when the job finished with equal digests after both heals."""
    import os

    from stalwart.elastic import launch, read_events

    env = {**os.environ, "OMP_NUM_THREADS": "1", **_schedule().to_env()}
    folder = events_dir or Path(tempfile.mkdtemp(prefix="stalwart-elastic-demo-"))
    quiet = logging.getLogger("stalwart.elastic")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the launcher's warnings are in the table
    try:
        with console.status("elastic: 3 workers training; 1 killed, 1 paused, both replaced…"):
            result = launch(
                Path(__file__), ["--worker"], nproc=3, max_restarts=2, events_dir=folder,
                timeout_s=30.0, hang_s=HANG_S, env=env,
            )  # fmt: skip
    finally:
        quiet.setLevel(level)
    events = read_events(folder)
    rec, digests = _tables(result, events)
    console.print(rec)
    console.print(digests)
    equal = len(set(result.summary.final_digests.values())) == 1
    healed = len(result.recoveries) == 2 and all(r.rejoin_s is not None for r in result.recoveries)
    survivor = sum(e["kind"] == "start" for e in events.get(0, [])) == 1
    ok = result.exit_code == 0 and equal and healed and survivor
    console.print(
        f"elastic: {'digests equal on every member' if equal else 'DIGESTS DIFFER'} after "
        f"{len(result.recoveries)} heals; hang timeout {HANG_S:.0f} s (gloo timeout 30 s); "
        f"goodput {result.summary.goodput:.0%}; {result.wall_s:.1f} s"
        + ("" if ok else f" [red]✗ (events kept in {folder})[/]")
    )
    if ok and events_dir is None:
        shutil.rmtree(folder, ignore_errors=True)
    return ok


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a worker of the elastic demo section")
    parser.add_argument("--worker", action="store_true")
    if parser.parse_args().worker:
        _worker()
