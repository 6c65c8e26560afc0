"""A gigabyte heal: throughput against a raw loopback socket probe, and what the survivors feel.

Each run, on this box, with nothing else of the bench running at the same time:

1. **probe**: two processes move ``--probe-gib`` GiB over one loopback TCP connection, the
   way the heal does (``sendall`` from a tensor's memory, ``recv_into`` a preallocated one, in
   64 MiB chunks): the bandwidth the heal is compared with;
2. **job**: ``stalwart run --nproc 2`` trains an MLP with AdamW whose state (parameters and
   both moments) is ``--gib`` GiB per member; worker 1 is SIGKILLed at step ``--kill-at``; the
   survivor goes on alone, the launcher's replacement joins and heals from it
   (:mod:`stalwart.elastic.heal`), both train to ``--steps``; the final digests must agree.

Reported per run, from the workers' event logs and the heal's own log line:

* heal: bytes, seconds (listen to loaded, on the newcomer), MB/s, and that over the probe;
* the survivor's healthy step (median time between its commits with 2 members, before the
  kill), the survivor's step that contained the heal's epoch change (time between the commits
  around it), and their ratio;
* detection -> next commit: the survivor's ``fault-detected`` to its next commit;
* on the survivor's own clock (the workers time their loop): its step boundary that held the
  epoch change (join, digests, the heal, the check, the agreed copy) and its first commit
  with the newcomer (the all-reduce waits for the newcomer's first backward), against its
  healthy commit; the newcomer's first forward and backward, and its warm-up.

``--warmup`` (the default) gives the replacement a warm-up (``Job(warmup=...)``: one forward
and backward on zeros before it announces itself); ``--no-warmup`` leaves it out and runs
against a ``Job`` without that argument too (an older tree, for A/B runs).
Medians and ranges over ``--runs`` runs (probe and job interleaved).

    .venv/bin/python bench/heal_bench.py --runs 3 --gib 4.0

``--group-size 2``: the same job with replica groups (``stalwart run --nproc 4 --group-size 2``,
each layer sharded with FSDP2 on ``job.shard_mesh``; ``--gib`` is then the state per group,
half of it per rank). Worker 1 dies, so its group (0 and 1) is taken out; the survivor measured
is worker 2, rank 0 of the other group, and the replacement group heals (or, ``--follow``,
follows) shard by shard.

Memory: each member holds the state, its gradients and the parity checks' agreed copy
(about 2.4x the state), so ``--gib 4`` needs about 20 GiB of RAM for the two members.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import multiprocessing as mp
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

WIDTH = 8192
CHUNK = 64 << 20


def _model(gib: float) -> nn.Module:
    """An MLP of WIDTH-wide layers whose AdamW state (3 x 4 bytes a parameter) is >= ``gib``."""
    params = math.ceil(gib * (1 << 30) / 12)
    per = WIDTH * WIDTH + WIDTH
    full, rest = divmod(params, per)
    layers: list[nn.Module] = [nn.Linear(WIDTH, WIDTH) for _ in range(full)]
    if rest:
        layers.append(nn.Linear(WIDTH, max(1, math.ceil((rest - 1) / (WIDTH + 1)))))
    return nn.Sequential(*layers)


def worker(a: argparse.Namespace) -> None:
    """One elastic member (under ``stalwart run``)."""
    import stalwart
    from stalwart.elastic import Job

    wid = os.environ.get("STALWART_ELASTIC_WORKER", "0")
    heal_log = logging.getLogger("stalwart.elastic.heal")
    heal_log.setLevel(logging.INFO)
    handler = logging.FileHandler(a.out / f"heal-{wid}.log")
    handler.setFormatter(logging.Formatter("%(created).3f %(message)s"))
    heal_log.addHandler(handler)
    torch.manual_seed(0)  # the RNGs are state: seeded alike, the first members agree at once
    random.seed(0)
    np.random.seed(0)
    timed: dict[str, Any] = {"warmup_s": None, "steps": []}

    def warmup() -> None:  # a replacement's first backward, paid before it joins (with groups
        t0 = time.perf_counter()  # the job runs it once the model below is sharded)
        F.mse_loss(model(torch.zeros(2, WIDTH))[:, :1], torch.zeros(2, 1)).backward()
        opt.zero_grad()
        timed["warmup_s"] = time.perf_counter() - t0

    extra: dict[str, Any] = {"warmup": warmup} if a.warmup else {}  # runs on older Jobs too
    if a.follow:
        extra["follow"] = True
    if a.group_size > 1:  # the model is sharded on the group's mesh, which the Job builds
        state = stalwart.TrainingState()
        job = Job(state, verify_every=0, **extra)
        model, opt = _sharded(a.gib, job.shard_mesh)
        state.model, state.optimizer = model, opt
        torch.manual_seed(0)
        _train(a, job, model, opt, timed, wid)
        return
    model = _model(a.gib)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    job = Job(stalwart.TrainingState(model=model, optimizer=opt), verify_every=0, **extra)
    _train(a, job, model, opt, timed, wid)


def _sharded(gib: float, mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    """:func:`_model` with each layer and the root sharded by FSDP2 on ``mesh``."""
    from torch.distributed.fsdp import fully_shard

    model = _model(gib)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5)


def _train(a: argparse.Namespace, job: Any, model: nn.Module, opt: torch.optim.Optimizer,
           timed: dict[str, Any], wid: str) -> None:  # fmt: skip
    """The timed training loop of one member (:func:`worker`), its digest and timings."""
    from stalwart.testing import chaos

    chaos.install(job)
    model = job.data_parallel(model)
    optimizer = job.optimizer(opt)
    while job.step < a.steps:
        t0 = time.time()
        while job.step == a.steps - 4 and job.replicas < 2:
            job.refresh()  # a backstop: the replacement joins 4 steps before the end at latest
        optimizer.zero_grad()  # the boundary: an epoch change and its heal happen here
        t1, replicas = time.time(), job.replicas
        x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(job.step))
        F.mse_loss(model(x)[:, :1], torch.zeros(2, 1)).backward()
        t2 = time.time()
        optimizer.step()  # the all-reduce (waiting for the slowest member), the update
        timed["steps"].append({"replicas": replicas, "boundary_s": t1 - t0,
                               "compute_s": t2 - t1, "commit_s": time.time() - t2})  # fmt: skip
    job.close()
    final = {"digest": job.digest(), "shard_rank": job.shard_rank}
    (a.out / f"final-{wid}.json").write_text(json.dumps(final))
    (a.out / f"timed-{wid}.json").write_text(json.dumps(timed))


def _probe_send(port: int, nbytes: int) -> None:
    buf = np.ones(nbytes, dtype=np.uint8)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for c in range(0, nbytes, CHUNK):
            sock.sendall(buf[c : c + CHUNK])
        sock.recv(1)


def probe(nbytes: int) -> float:
    """MB/s of one loopback TCP stream between two processes, ``sendall`` to ``recv_into`` a
    fresh buffer in 64 MiB chunks, as the heal receives."""
    server = socket.create_server(("127.0.0.1", 0))
    sender = mp.get_context("spawn").Process(
        target=_probe_send, args=(server.getsockname()[1], nbytes)
    )
    buf = memoryview(torch.empty(nbytes, dtype=torch.uint8).numpy())  # as the heal allocates
    sender.start()
    conn, _ = server.accept()
    t0 = time.perf_counter()
    view = buf
    while len(view):
        got = conn.recv_into(view, min(len(view), CHUNK))
        view = view[got:]
    dt = time.perf_counter() - t0
    conn.sendall(b"k")
    sender.join()
    conn.close()
    server.close()
    return nbytes / dt / 1e6


class _Tensors:
    """A state of plain tensors (``state_dict`` / ``load_state_dict``): the transports' load."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.tensors = dict(sd)


def transport_ranks(rank: int, world_size: int, gib: float, which: str) -> float | None:
    """Rank 0 holds ``gib`` GiB of float32 tensors (256 MiB each), rank 1 fetches them with
    ``which`` transport; returns the receiver's seconds (None on the holder)."""
    from datetime import timedelta

    import torch.distributed as dist

    n, per = int(gib * (1 << 30)), 64 << 20  # bytes; elements per tensor
    shapes = [min(per, (n - i) // 4) for i in range(0, n, per * 4)]
    held = {f"t{i}": torch.full((k,), float(i)) if rank == 0 else torch.empty(0)
            for i, k in enumerate(shapes)}  # fmt: skip
    if which == "stalwart":
        from stalwart.elastic.heal import heal

        dist.barrier()
        t0 = time.perf_counter()
        heal(_Tensors(held), 1, rank, [0], dist.group.WORLD)
        dt = time.perf_counter() - t0
        dist.barrier()
        return dt if rank == 1 else None
    from torchft.checkpointing.http_transport import HTTPTransport

    timeout = timedelta(seconds=300)
    transport = HTTPTransport(timeout, num_chunks=int(which.rsplit("-", 1)[1]))
    box = [transport.metadata()]
    dist.broadcast_object_list(box, src=0)
    if rank == 0:
        transport.send_checkpoint(dst_ranks=[1], step=1, state_dict=held, timeout=timeout)
    dist.barrier()
    t0 = time.perf_counter()
    if rank == 1:
        got = transport.recv_checkpoint(src_rank=0, metadata=box[0], step=1, timeout=timeout)
        assert float(got[f"t{len(shapes) - 1}"][0]) == len(shapes) - 1
    dt = time.perf_counter() - t0
    dist.barrier()
    transport.shutdown(wait=False)
    return dt if rank == 1 else None


def transports(a: argparse.Namespace) -> None:
    """The same bytes between two processes: stalwart's heal vs torchft's HTTPTransport
    (``num_chunks=0``, what torchft's Manager builds by default, and ``num_chunks=8``)."""
    from stalwart.testing import run_ranks

    kinds = ["stalwart", "torchft-http-0", "torchft-http-8"]
    got: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(a.runs):
        for k in kinds[i % 3 :] + kinds[: i % 3]:  # rotating order
            dt = run_ranks(transport_ranks, 2, a.gib, k, timeout_s=900)[1]
            got[k].append(a.gib * (1 << 30) / dt / 1e6)
            print(json.dumps({"run": i, "transport": k, "mb_s": got[k][-1]}), flush=True)
    print(f"\n| transport, {a.gib} GiB, 2 processes | MB/s, median (range) |\n|---|---|")
    for k in kinds:
        print(f"| {k} | {_cell(got[k], '.0f')} |")


def _mean_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int,
               contributors: int | None) -> dict[str, float]:  # fmt: skip
    """One committed step of a contributor on the default group: its share's forward and
    backward, the mean (``contributors``: over how many), the update; seconds of each."""
    import torch.distributed as dist

    from stalwart.elastic.reduce import average_

    t0 = time.perf_counter()
    opt.zero_grad()
    x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(1000 * rank + step))
    F.mse_loss(model(x)[:, :1], torch.zeros(2, 1)).backward()
    t1 = time.perf_counter()
    average_(list(model.parameters()), [], torch.zeros(1), dist.group.WORLD,
             contributors=contributors)  # fmt: skip
    t2 = time.perf_counter()
    opt.step()
    t3 = time.perf_counter()
    return {"compute_s": t1 - t0, "reduce_s": t2 - t1, "update_s": t3 - t2, "step_s": t3 - t0}


def lend_copy(state: Any, step: int, rate: float, group: Any) -> tuple[Any, dict[str, float]]:
    """Rank 0 at the boundary: record its agreed copy of ``step`` and lend it to rank 1
    (``rate``: bytes a second, one stream, 8 MiB chunks; 0: unpaced); the lender and the
    boundary's seconds (the copy, the address exchange)."""
    from stalwart.elastic.catchup import Lender
    from stalwart.elastic.state import AgreedState

    t0 = time.perf_counter()
    agreed = AgreedState()
    agreed.record(state, step)
    t1 = time.perf_counter()
    paced = {"rate_bytes_s": rate, "streams": 1, "chunk_bytes": 8 << 20} if rate else {}
    lender = Lender(agreed, 0, [1], group, **paced)
    return lender, {"copy_s": t1 - t0, "addresses_s": time.perf_counter() - t1}


def background_ranks(rank: int, world_size: int, gib: float, healthy: int,
                     most: int, warm: bool, rate: float) -> dict[str, Any]:  # fmt: skip
    """Increment B's pieces at ``gib`` GiB (:mod:`stalwart.elastic.catchup`), 2 processes.

    Both train ``healthy`` steps as 2 contributors; then rank 1 is replaced by a fresh
    member (new model, fresh AdamW: no fault, no detection, no coordinator here). At the
    boundary rank 0 records its agreed copy (what a parity check does) and lends it; rank 1
    listens (zeros in, the reduced gradients kept) and replays up to 2 kept steps between
    its steps once the copy landed; once caught up (at most ``most`` steps), rank 0 sends the
    rest, both compare digests and train 2 more steps as 2 contributors. ``warm``: the
    replacement warms up first (one forward and backward on zeros, as ``Job(warmup=...)``).
    ``rate``: the lender's pace, bytes a second (0: unpaced; paced: one stream, 8 MiB chunks).
    """
    import threading

    import torch.distributed as dist

    import stalwart
    from stalwart.elastic.catchup import Catchup, send_rest, take_rest
    from stalwart.elastic.state import digest

    def fresh(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        model = _model(gib)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-5)

    group = dist.group.WORLD
    model, opt = fresh(0)
    steps = [_mean_step(model, opt, s, rank, None) for s in range(healthy)]
    step = healthy
    out: dict[str, Any] = {"healthy": steps[1:]}  # the first step is cold
    if rank == 1:  # the replacement: a new process's state
        del model, opt
        model, opt = fresh(1)
        if warm:
            t0 = time.perf_counter()
            F.mse_loss(model(torch.zeros(2, WIDTH))[:, :1], torch.zeros(2, 1)).backward()
            opt.zero_grad()
            out["warmup_s"] = time.perf_counter() - t0
    state = stalwart.TrainingState(model=model, optimizer=opt)
    params = list(model.parameters())
    dist.barrier()
    t0 = time.perf_counter()
    landed: list[float] = []
    if rank == 0:
        lender, out["boundary"] = lend_copy(state, step, rate, group)
        threading.Thread(target=lambda: (lender.transfer.wait(), landed.append(
            time.perf_counter())), daemon=True).start()  # fmt: skip
    else:
        catchup = Catchup(state, opt, params, [], [1], group, **({"streams": 1} if rate else {}))
        out["boundary"] = {"addresses_s": time.perf_counter() - t0}
        threading.Thread(target=lambda: (catchup.transfer.wait(), landed.append(
            time.perf_counter())), daemon=True).start()  # fmt: skip
    lending: list[dict[str, float]] = []
    listened = 0
    caught = torch.zeros(1)
    while listened < most:
        if rank == 0:
            lending.append(_mean_step(model, opt, step, rank, 1))
            dist.all_reduce(caught)
        else:
            t1 = time.perf_counter()
            opt.zero_grad()  # its own (thrown away) forward and backward, as a loop would
            x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(step))
            F.mse_loss(model(x)[:, :1], torch.zeros(2, 1)).backward()
            catchup.reduce(torch.zeros(1), group)
            t2 = time.perf_counter()
            done = catchup.landed() and catchup.replay(limit=2)  # 1 kept, 2 replayed a step
            lending.append({"listen_s": t2 - t1, "replay_s": time.perf_counter() - t2})
            caught[0] = float(done)
            dist.all_reduce(caught)  # stands for the ready flag in the control vector
        step, listened = step + 1, listened + 1
        if float(caught[0]) > 0:
            break
    out["lending"], out["listened"] = lending, listened
    t1 = time.perf_counter()
    if rank == 1 and catchup.step is None:  # not caught up within ``most``: finish here
        catchup.replay()
    out["finish_replay_s"] = time.perf_counter() - t1
    out["landed_s"] = landed[0] - t0 if landed else None
    t1 = time.perf_counter()
    if rank == 0:
        lender.wait()
        send_rest(state, step, opt, params, [], 0, group)
    else:
        take_rest(state, opt, params, [], 0, group)
    t2 = time.perf_counter()
    mine = digest(state, step)
    table: list[Any] = [None, None]
    dist.all_gather_object(table, mine)
    out["promote"] = {"rest_s": t2 - t1, "digests_s": time.perf_counter() - t2}
    out["digests_equal"] = table[0] == table[1]
    out["after"] = [_mean_step(model, opt, step + s, rank, None) for s in range(2)]
    return out


def background(a: argparse.Namespace) -> None:
    """``--background``: :func:`background_ranks`, ``--runs`` times; rank 0 is the survivor."""
    from stalwart.testing import run_ranks

    rows = []
    for i in range(a.runs):
        rate = a.rate_mb_s * 1e6
        got = run_ranks(background_ranks, 2, a.gib, 4, 12, a.warmup, rate, timeout_s=900)
        surv, new = got
        healthy = statistics.median(s["step_s"] for s in surv["healthy"])
        lend = [s["step_s"] for s in surv["lending"]]
        row = {
            "run": i, "digests_equal": surv["digests_equal"] and new["digests_equal"],
            "healthy_step_s": healthy, "copy_s": surv["boundary"]["copy_s"],
            "addresses_s": surv["boundary"]["addresses_s"],
            "first_lending_step_s": lend[0], "max_lending_step_s": max(lend),
            "median_lending_step_s": statistics.median(lend),
            "max_over_healthy": max(lend) / healthy,
            "boundary_and_first_over_healthy": (surv["boundary"]["copy_s"]
                                                + surv["boundary"]["addresses_s"]
                                                + lend[0]) / healthy,
            "landed_s": new["landed_s"], "listened_steps": new["listened"],
            "replay_s": sum(s["replay_s"] for s in new["lending"]),
            "finish_replay_s": new["finish_replay_s"], "rest_s": surv["promote"]["rest_s"],
            "digests_s": surv["promote"]["digests_s"],
            "after_step_s": statistics.median(s["step_s"] for s in surv["after"]),
            "survivor_lending": surv["lending"], "listener": new["lending"],
            "warmup_s": new.get("warmup_s"),
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    skip = ("run", "digests_equal", "survivor_lending", "listener", "warmup_s")
    col = {k: [r[k] for r in rows] for k in rows[0] if k not in skip}
    print(f"\n{a.runs} runs, {a.gib} GiB AdamW state per member, 2 processes; digests equal "
          f"in {sum(r['digests_equal'] for r in rows)} of {a.runs}")  # fmt: skip
    print("\n| measure | median (range) |\n|---|---|")
    for k, v in col.items():
        print(f"| {k} | {_cell(v)} |")


def _gaps(steps: list[dict[str, Any]]) -> dict[int, float]:
    """Seconds between a commit and the one before it, by step."""
    return {b["step"]: b["t"] - a["t"] for a, b in itertools.pairwise(steps)}


def _kill_one(a: argparse.Namespace, tmp: Path, nproc: int,
              *launcher: str) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """``stalwart run --nproc nproc`` of this script's worker (events and outputs under
    ``tmp``), worker 1 SIGKILLed at step ``--kill-at``."""
    from stalwart.testing import Kill, KillSchedule

    (tmp / "out").mkdir()
    me = [str(Path(__file__).resolve()), "--worker", "--gib", str(a.gib),
          "--steps", str(a.steps), "--out", str(tmp / "out"),
          "--warmup" if a.warmup else "--no-warmup", "--group-size", str(a.group_size),
          *(["--follow"] if a.follow else [])]  # fmt: skip
    cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", str(nproc), *launcher,
           "--group-size", str(a.group_size),
           "--max-restarts", "2", "--events", str(tmp / "events"),
           "--timeout", str(a.timeout), *me]  # fmt: skip
    sched = KillSchedule((Kill(worker=1, step=a.kill_at, where="boundary"),))
    env = {**os.environ, "OMP_NUM_THREADS": "1", **sched.to_env()}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500)


def job_run(a: argparse.Namespace) -> dict[str, Any]:
    """One kill/replace/heal run; the measures of the module docstring."""
    from stalwart.elastic import read_events

    g = a.group_size  # workers per member: 0 .. g-1 the first group (worker 1 dies), g .. 2g-1
    with tempfile.TemporaryDirectory() as tmp:  # the survivors, 2g .. 3g-1 the replacement
        ev, out = Path(tmp) / "events", Path(tmp) / "out"
        done = _kill_one(a, Path(tmp), 2 * g)
        if done.returncode != 0:
            raise SystemExit(f"the job failed:\n{done.stdout}\n{done.stderr[-3000:]}")
        events = read_events(ev)
        finals = [json.loads(p.read_text()) for p in out.glob("final-*.json")]
        timed = {int(p.stem.split("-")[1]): json.loads(p.read_text())
                 for p in out.glob("timed-*.json")}  # fmt: skip
        heal_lines = [[ln for ln in (out / f"heal-{w}.log").read_text().splitlines()
                       if " healed " in ln] for w in events if w >= 2 * g]  # fmt: skip
    equal = len(events) == 3 * g and all(  # per shard: one digest across the members
        len({f["digest"] for f in finals if f["shard_rank"] == r}) == 1 for r in range(g)
    )
    first = 0 if g == 1 else g  # the survivor measured: worker 0, or rank 0 of the live group
    survivor = events[first]
    steps = [e for e in survivor if e["kind"] == "step" and e["committed"]]  # not the discarded
    gaps = _gaps(steps)
    healthy = [gaps[s["step"]] for s in steps if s["step"] in gaps and s["step"] <= a.kill_at
               and len(s["members"]) == 2 * g]  # fmt: skip
    fault = next(e for e in survivor if e["kind"] == "fault-detected")
    after_fault = next(s for s in steps if s["t"] > fault["t"])
    rejoin = [e for e in survivor if e["kind"] == "reconfigured" and len(e["members"]) == 2 * g
              and e["t"] > fault["t"]]  # fmt: skip
    heal_step = next(s for s in steps if rejoin and s["t"] > rejoin[0]["t"])
    newcomer = next(lines for w, lines in events.items() if w >= 2 * g)
    begins = next((e["t"] for e in survivor if e["kind"] == "follow"), rejoin[0]["t"])
    cost = _survivor_cost(steps, gaps, statistics.median(healthy), after_fault, newcomer, begins,
                          g)  # fmt: skip
    mine = timed[first]["steps"]  # the survivor's steps: the first with 2 members after the kill
    # none alone: the replacement came before the survivor's first commit without it, and
    # the step after the failed one (index kill_at) held the epoch change
    alone = next((i for i, s in enumerate(mine) if s["replicas"] == 1), a.kill_at + 1)
    heal_at = mine[next(i for i in range(alone, len(mine)) if mine[i]["replicas"] == 2)]
    healthy_at = mine[1 : alone - 1]  # 2 members: not the first (cold) nor the failed one
    theirs = timed[max(timed)]  # the replacement's
    split = {  # the survivor's own clock: the boundary holding the change, then its commit
        "survivor_boundary_s": heal_at["boundary_s"], "survivor_commit_s": heal_at["commit_s"],
        "healthy_commit_s": statistics.median(s["commit_s"] for s in healthy_at),
        "newcomer_first_compute_s": theirs["steps"][0]["compute_s"],
    }  # fmt: skip
    if a.follow:
        return _followed(survivor, steps, gaps, healthy, fault, after_fault, heal_step,
                         newcomer, equal, cost["alone_step_s"], g) | cost | split  # fmt: skip
    # each replacement rank's last "<t> healed <bytes> bytes from <n> holders in <s> s ...";
    # with groups the ranks heal their shards at once: the bytes summed, the slowest's time
    words = [lines[-1].split() for lines in heal_lines]
    heal_end, heal_s = max(float(w[0]) for w in words), max(float(w[8]) for w in words)
    nbytes = sum(int(w[2]) for w in words)
    received = next(e for e in newcomer if e["kind"] == "state-received")
    return {
        "digests_equal": equal,
        "heal_bytes": nbytes,
        "heal_s": heal_s,
        "heal_mb_s": nbytes / heal_s / 1e6,
        "healthy_step_s": statistics.median(healthy),
        "heal_step_s": gaps[heal_step["step"]],
        "detect_to_commit_s": after_fault["t"] - fault["t"],
        "join_s": rejoin[0]["t"] - steps[steps.index(heal_step) - 1]["t"],  # boundary to formed
        "until_heal_end_s": heal_end - rejoin[0]["t"],  # digests, addresses, the heal
        "verify_and_record_s": received["t"] - heal_end,  # digests again, the agreed copy
        "first_step_s": heal_step["t"] - received["t"],  # the first step with the newcomer
        # its boundary: join, digests, heal, check, agreed copy; its commit: waiting for
        # the newcomer's first forward and backward
        **split,
        "survivor_heal_step_s": sum(v for k, v in heal_at.items() if k.endswith("_s")),
        "survivor_healthy_step_s": statistics.median(
            sum(v for k, v in s.items() if k.endswith("_s")) for s in healthy_at
        ),
        "newcomer_warmup_s": theirs["warmup_s"] or 0.0,
        **cost,
    }


def _survivor_cost(steps: list[dict[str, Any]], gaps: dict[int, float], healthy2: float,
                   after_fault: dict[str, Any], newcomer: list[dict[str, Any]],
                   begins: float, g: int = 1) -> dict[str, float]:  # fmt: skip
    """What the replacement cost the survivor, the same way for both designs: from the
    replacement's start to the survivor's first commit with it, each alone commit's gap over
    the survivor's alone step (the median alone gap before the design ``begins``: the follow
    starts, or the epoch change), and the first 2-member commit's over a healthy 2-member
    step; summed (seconds lost) and the longest (a ratio). ``g``: workers per member."""
    born = next(e["t"] for e in newcomer if e["kind"] == "start")
    alone = [s for s in steps if s["t"] > after_fault["t"] and s["step"] in gaps]
    solo = [(s["t"], gaps[s["step"]]) for s in alone if len(s["members"]) == g]
    if solo:
        base = statistics.median([d for t, d in solo if t <= begins] or [min(d for _, d in solo)])
    else:  # the replacement came before any commit without it (a slow step, a quick start)
        base = math.nan
    first2 = next(s for s in alone if s["t"] > born and len(s["members"]) == 2 * g)
    inside = [s for s in alone if born < s["t"] < first2["t"]]
    lost = sum(gaps[s["step"]] - base for s in inside) + gaps[first2["step"]] - healthy2
    longest = max([gaps[s["step"]] / base for s in inside] + [gaps[first2["step"]] / healthy2])
    return {"alone_step_s": base, "survivor_lost_s": lost, "survivor_longest_ratio": longest,
            "alone_steps_in_window": len(inside)}  # fmt: skip


def _followed(survivor: list[dict[str, Any]], steps: list[dict[str, Any]],
              gaps: dict[int, float], healthy: list[float], fault: dict[str, Any],
              after_fault: dict[str, Any], heal_step: dict[str, Any],
              newcomer: list[dict[str, Any]], equal: bool,
              alone_s: float, g: int = 1) -> dict[str, Any]:  # fmt: skip
    """``--follow``'s measures (``Job(follow=True)``): the survivor's steps while it lent the
    copy and pushed, over its alone step (``alone_s``, :func:`_survivor_cost`'s), and the
    step holding the promotion."""
    follow = {e["outcome"]: e for e in survivor if e["kind"] == "follow"}
    theirs = {e["outcome"]: e for e in newcomer if e["kind"] == "follow"}
    if "promoted" not in follow or "promoted" not in theirs:
        raise SystemExit(f"the follow did not promote: {follow} {theirs}")
    start, end = follow["started"], follow["promoted"]
    alone = [s for s in steps if len(s["members"]) == g and s["t"] > after_fault["t"]]
    during = [gaps[s["step"]] for s in alone if s["t"] > start["t"] and s["step"] in gaps]
    if not during:
        raise SystemExit("no step alone during the follow: raise --steps")
    return {
        "digests_equal": equal,
        "pushed_steps": end["step"] - start["step"],
        "follow_s": end["t"] - start["t"],
        "healthy_step_s": statistics.median(healthy),
        "max_following_step_s": max(during),
        "max_following_over_alone": max(during) / alone_s,
        "promotion_step_s": gaps[heal_step["step"]],
        "promotion_over_healthy": gaps[heal_step["step"]] / statistics.median(healthy),
        "detect_to_commit_s": after_fault["t"] - fault["t"],
        "newcomer_state_received": any(e["kind"] == "state-received" for e in newcomer),
    }


def _cell(xs: list[float], fmt: str = ".2f") -> str:
    return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}} to {max(xs):{fmt}})"


def recovery(a: argparse.Namespace) -> None:
    """``--recovery``: the launcher's recovery record (``stalwart run --json``) of one kill,
    ``--nproc`` members of ``--gib`` GiB each (issue 24's own shape: 3 members of 1.5 GiB),
    ``--runs`` times: last sign of life to reaped, to the survivors' fault detection, to their
    first commit without it (one step recomputed inside it), and the replacement's launch to
    its first commit (its start, the heal or follow, its first step)."""
    rows = []
    for i in range(a.runs):
        with tempfile.TemporaryDirectory() as tmp:
            done = _kill_one(a, Path(tmp), a.nproc, "--json")
        doc = json.loads(done.stdout)
        if not doc["ok"] or not doc["recoveries"]:
            raise SystemExit(f"the job failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        rec = doc["recoveries"][0]
        rows.append({"run": i, "digests_equal": doc["final_digests_equal"],
                     **{k: rec[k] for k in ("reaped_s", "detect_s", "resume_s", "rejoin_s",
                                            "lost_steps")}})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{a.runs} runs, {a.nproc} members of {a.gib} GiB (AdamW); digests equal in "
          f"{sum(r['digests_equal'] for r in rows)}")  # fmt: skip
    print_table(rows, ("run", "digests_equal"))


def followed(a: argparse.Namespace) -> None:
    """``--follow``: :func:`job_run` with ``Job(follow=True)``, ``--runs`` times."""
    rows = []
    for i in range(a.runs):
        rows.append({"run": i, **job_run(a)})
        print(json.dumps(rows[-1]), flush=True)
    skip = ("run", "digests_equal", "newcomer_state_received")
    print(f"\n{a.runs} runs, {a.gib} GiB AdamW state per member, 2 members, Job(follow=True); "
          f"digests equal in {sum(r['digests_equal'] for r in rows)}, promoted with nothing "
          f"received in {sum(not r['newcomer_state_received'] for r in rows)}")  # fmt: skip
    print_table(rows, skip)


def print_table(rows: list[dict[str, Any]], skip: tuple[str, ...]) -> None:
    """Every measure of ``rows`` but ``skip``'s, as a markdown row: median (range)."""
    print("\n| measure | median (range) |\n|---|---|")
    for k in rows[0]:
        if k not in skip:
            print(f"| {k} | {_cell([r[k] for r in rows])} |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--transports", action="store_true", help="heal vs torchft's HTTPTransport")
    p.add_argument("--background", action="store_true",
                   help="increment B's pieces: lend, listen, replay (catchup.py)")  # fmt: skip
    p.add_argument("--rate-mb-s", type=float, default=0.0, help="--background: pace, MB/s")
    p.add_argument("--gib", type=float, default=4.0, help="AdamW state per member, GiB")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--kill-at", type=int, default=3)
    p.add_argument("--out", type=Path)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--probe-gib", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=60.0, help="stalwart run --timeout")
    p.add_argument("--recovery", action="store_true",
                   help="the launcher's recovery record of one kill (--nproc members)")  # fmt: skip
    p.add_argument("--nproc", type=int, default=3, help="--recovery: members")
    p.add_argument("--group-size", type=int, default=1,
                   help="ranks per replica group (FSDP2 inside; --gib per group)")  # fmt: skip
    p.add_argument("--follow", action="store_true",
                   help="the replacement follows (Job(follow=True)), no heal")  # fmt: skip
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="the replacement warms up before it joins (Job(warmup=...))")  # fmt: skip
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    if a.transports:
        transports(a)
        return
    if a.background:
        background(a)
        return
    if a.recovery:
        recovery(a)
        return
    if a.follow:
        followed(a)
        return
    rows = []
    for i in range(a.runs):
        mb_s = statistics.median(probe(int(a.probe_gib * (1 << 30))) for _ in range(3))
        row = {"run": i, "probe_mb_s": mb_s, **job_run(a)}
        row["heal_over_probe"] = row["heal_mb_s"] / mb_s
        row["heal_step_over_healthy"] = row["heal_step_s"] / row["healthy_step_s"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    col = {k: [r[k] for r in rows] for k in rows[0] if k not in ("run", "digests_equal")}
    print(f"\n{a.runs} runs, state {a.gib} GiB per member (AdamW), 2 members; "
          f"digests equal in {sum(r['digests_equal'] for r in rows)} of {a.runs}")  # fmt: skip
    print("\n| measure | median (range) |\n|---|---|")
    print(f"| loopback probe, one stream (MB/s) | {_cell(col['probe_mb_s'], '.0f')} |")
    print(f"| heal, bytes | {rows[0]['heal_bytes'] / (1 << 30):.2f} GiB |")
    print(f"| heal (s) | {_cell(col['heal_s'])} |")
    print(f"| heal (MB/s) | {_cell(col['heal_mb_s'], '.0f')} |")
    print(f"| heal / probe | {_cell(col['heal_over_probe'])} |")
    print(f"| survivor's healthy step (s) | {_cell(col['healthy_step_s'])} |")
    print(f"| survivor's step holding the heal (s) | {_cell(col['heal_step_s'])} |")
    print(f"| ... over a healthy step | {_cell(col['heal_step_over_healthy'])} |")
    print(f"| ... of it: epoch change until the group formed (s) | {_cell(col['join_s'])} |")
    print(f"| ... of it: digests, heal (s) | {_cell(col['until_heal_end_s'])} |")
    print(f"| ... of it: digests again, agreed copy (s) | {_cell(col['verify_and_record_s'])} |")
    print(f"| ... of it: the first step with the newcomer (s) | {_cell(col['first_step_s'])} |")
    print(f"| detection -> survivor's next commit (s) | {_cell(col['detect_to_commit_s'])} |")
    print(f"| survivor's boundary holding the heal (s) | {_cell(col['survivor_boundary_s'])} |")
    print(f"| survivor's first commit with the newcomer (s) | {_cell(col['survivor_commit_s'])} |")
    print(f"| survivor's healthy commit, 2 members (s) | {_cell(col['healthy_commit_s'])} |")
    print(f"| survivor's step holding the heal, timed (s) | {_cell(col['survivor_heal_step_s'])} |")
    print(f"| survivor's healthy step, timed (s) | {_cell(col['survivor_healthy_step_s'])} |")
    print(f"| newcomer's first forward+backward (s) | {_cell(col['newcomer_first_compute_s'])} |")
    print(f"| newcomer's warm-up, before it joined (s) | {_cell(col['newcomer_warmup_s'])} |")
    for k in ("alone_step_s", "survivor_lost_s", "survivor_longest_ratio"):
        print(f"| {k} | {_cell(col[k])} |")


if __name__ == "__main__":
    main()
