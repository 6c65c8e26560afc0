"""Healing off the survivors' critical path (``elastic/follow.py``): what the survivor feels.

The same two processes, model and state size as ``heal_bench.py --background`` (the listener
design, which measured 3.40x unpaced and 2.35x paced at 2 GiB), so the figures compare:

1. both train 4 steps as 2 contributors (the healthy step, with its all-reduce);
2. rank 1 is replaced by a fresh member (new model, fresh AdamW; warmed up: one forward and
   backward on zeros, as ``Job(warmup=...)``); rank 0 trains 3 steps alone on a group of its
   own meanwhile (the healthy step without a peer: the denominator that leaves the
   all-reduce out);
3. the boundary: rank 0 records its agreed copy of step *s* and lends it
   (:class:`~stalwart.elastic.catchup.Lender`); rank 1 becomes a
   :class:`~stalwart.elastic.follow.Follower`; rank 0 commits on its own group, pushing each
   step's reduced gradients (:class:`~stalwart.elastic.follow.Feed`) right after its
   all-reduce, and promotes at the first step the follower is ready for (``--lag``);
4. the promotion: the rest (RNG, skeleton) and the digests on the whole group, then 2 steps
   as 2 contributors.

No fault, detection or coordinator here: this measures the heal's cost to the survivor, not
the job's epoch change. Rank 0 is the survivor. Medians and ranges over ``--runs`` runs.

    OMP_NUM_THREADS=1 flock -x /tmp/quiet.lock flock /tmp/bigmem.lock \\
      .venv/bin/python bench/follow_bench.py --runs 3 --gib 2.0

Memory: the survivor holds its state, gradients, the copy and up to ``max_queue`` pushed
gradients; the follower its state, the received copy and the steps not applied yet:
about 3x the state each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from heal_bench import WIDTH, _model, lend_copy, print_table  # a sibling bench script


def _step(model: Any, opt: torch.optim.Optimizer, step: int, rank: int, group: Any,
          feed: Any = None, lag: int = 1) -> dict[str, Any]:  # fmt: skip
    """One committed step: forward and backward, the mean on ``group`` (with the pusher's
    ready flag), the push, the update; seconds of each, and whether it promoted."""
    from stalwart.elastic.reduce import average_

    t0 = time.perf_counter()
    opt.zero_grad()
    x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(1000 * rank + step))
    F.mse_loss(model(x)[:, :1], torch.zeros(2, 1)).backward()
    t1 = time.perf_counter()
    ready = feed is not None and feed.ready(step + 1, lag)
    control = average_(list(model.parameters()), [], torch.tensor([float(ready)]), group)
    t2 = time.perf_counter()
    promote = float(control[0]) > 0
    if feed is not None:
        feed.push(step + 1, list(model.parameters()), [], opt, promote=promote)
    t3 = time.perf_counter()
    opt.step()
    t4 = time.perf_counter()
    return {"compute_s": t1 - t0, "reduce_s": t2 - t1, "push_s": t3 - t2, "update_s": t4 - t3,
            "step_s": t4 - t0, "promote": promote}  # fmt: skip


def follow_ranks(rank: int, world_size: int, gib: float, lag: int, most: int,
                 rate: float) -> dict[str, Any]:  # fmt: skip
    """Steps 1 to 4 of the module docstring, on one rank (rank 0: the survivor)."""
    import torch.distributed as dist

    import stalwart
    from stalwart.elastic.catchup import send_rest, take_rest
    from stalwart.elastic.feed import Feed
    from stalwart.elastic.follow import Follower
    from stalwart.elastic.state import digest

    world, solo = dist.group.WORLD, dist.new_group([0])
    torch.manual_seed(0)
    model = _model(gib)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    out: dict[str, Any] = {}
    steps = [_step(model, opt, s, rank, world) for s in range(4)]
    out["healthy"], step = steps[1:], 4  # the first step is cold
    if rank == 1:  # the replacement: a new process's state, warmed up
        del model, opt
        torch.manual_seed(1)
        model = _model(gib)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        F.mse_loss(model(torch.zeros(2, WIDTH))[:, :1], torch.zeros(2, 1)).backward()
        opt.zero_grad()
    else:
        out["solo"] = [_step(model, opt, step + s, rank, solo) for s in range(3)]
        step += 3
    dist.barrier()
    state = stalwart.TrainingState(model=model, optimizer=opt)
    params = list(model.parameters())
    t0 = time.perf_counter()
    if rank == 0:
        lender, out["boundary"] = lend_copy(state, step, rate, world)
        t1 = time.perf_counter()
        feed = Feed.connect(1, True, world, params)
        out["boundary"]["addresses_s"] += time.perf_counter() - t1
        following = []
        while not (following and following[-1]["promote"]) and len(following) < most:
            following.append(_step(model, opt, step, rank, solo, feed, lag))
            step += 1
        out["following"] = following
        if feed.broken is not None or not following[-1]["promote"]:
            raise RuntimeError(f"no promotion after {len(following)} steps: {feed.broken}")
        t1 = time.perf_counter()
        send_rest(state, step, opt, params, [], 0, world)  # waits for the follower's last apply
        out["promote_wait_s"] = time.perf_counter() - t1
        lender.wait()
        feed.close()
    else:
        follower = Follower(1, world, **({"streams": 1} if rate else {}))
        out["boundary"] = {"addresses_s": time.perf_counter() - t0}
        step = follower.follow(state, opt, params, [])
        out["copy_landed_s"] = time.perf_counter() - t0
        take_rest(state, opt, params, [], 0, world)
    mine = digest(state, step)
    table: list[Any] = [None, None]
    dist.all_gather_object(table, mine)
    out["digests_equal"] = table[0] == table[1]
    out["after"] = [_step(model, opt, step + s, rank, world) for s in range(2)]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--lag", type=int, default=1, help="steps the follower may be behind")
    p.add_argument("--most", type=int, default=40, help="steps to follow at most")
    p.add_argument(
        "--rate-mb-s",
        type=float,
        default=0.0,
        help="pace the lent copy (one stream, 8 MiB chunks), MB/s; 0: unpaced",
    )
    a = p.parse_args()
    from stalwart.testing import run_ranks

    rows = []
    for i in range(a.runs):
        surv, new = run_ranks(
            follow_ranks, 2, a.gib, a.lag, a.most, a.rate_mb_s * 1e6, timeout_s=900
        )
        healthy = statistics.median(s["step_s"] for s in surv["healthy"])
        solo = statistics.median(s["step_s"] for s in surv["solo"])
        fol = surv["following"]
        worst = max(s["step_s"] for s in fol)
        row = {
            "run": i, "digests_equal": surv["digests_equal"] and new["digests_equal"],
            "healthy_step_s": healthy, "solo_step_s": solo,
            "boundary_copy_s": surv["boundary"]["copy_s"],
            "boundary_addresses_s": surv["boundary"]["addresses_s"],
            "steps_followed": len(fol), "promoted": fol[-1]["promote"],
            "max_following_step_s": worst, "median_following_step_s":
                statistics.median(s["step_s"] for s in fol),
            "max_over_healthy": worst / healthy, "max_over_solo": worst / solo,
            "first_with_boundary_over_healthy":
                (surv["boundary"]["copy_s"] + surv["boundary"]["addresses_s"]
                 + fol[0]["step_s"]) / healthy,
            "push_s_max": max(s["push_s"] for s in fol),
            "compute_s_median": statistics.median(s["compute_s"] for s in fol),
            "update_s_median": statistics.median(s["update_s"] for s in fol),
            "promote_wait_s": surv["promote_wait_s"],
            "follower_done_s": new["copy_landed_s"],
            "after_step_s": statistics.median(s["step_s"] for s in surv["after"]),
            "following": fol,
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    skip = ("run", "digests_equal", "following", "promoted")
    print(f"\n{a.runs} runs, {a.gib} GiB AdamW state per member, 2 processes, lag {a.lag}, "
          f"copy paced at {a.rate_mb_s or 'unpaced'} MB/s; "
          f"digests equal in {sum(r['digests_equal'] for r in rows)} of {a.runs}, promoted in "
          f"{sum(r['promoted'] for r in rows)}")  # fmt: skip
    print_table(rows, skip)


if __name__ == "__main__":
    main()
