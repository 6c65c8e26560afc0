"""CheckFree: the loss after a lost pipeline stage is rebuilt, against the alternatives.

The pipeline of ``tests/distributed/checkfree_ranks.py`` (4 stages of identical blocks, an
input projection on the first and a head on the last; Adam per stage), run in one process
(the same arithmetic as the gloo pipeline with one micro-batch). At step ``--fail-at`` the
worker of stage ``--lost`` dies with nothing saved; contenders, same seed and data:

* ``none``: no failure (the reference);
* ``checkfree``: the stage rebuilt from its neighbours, gradient-norm weights (CheckFree);
* ``scratch``: the stage trains on from a fresh initialisation;
* ``replica``: its weights copied from a live data-parallel replica (exact; optimizer fresh);
* ``ckpt``: every stage rolls back to the last checkpoint, taken every ``--ckpt-every`` steps
  (the steps since are redone: they count against the same step budget); saves not charged;
* ``ckpt-equal-cost``: the same rollback, with the checkpoint interval chosen so the run's
  checkpoint overhead equals CheckFree's overhead (below).

Equal cost: measured on this machine before the runs, ``c_save`` = wall time of one
checkpoint of the pipeline (``torch.save`` of every stage's model and optimizer state to a
temp file, then ``fsync``; median of 5), ``o_step`` = CheckFree's per-step cost (every
stage's gradient norm, kept for the weights of a rebuild; median of 50) and ``t_rec`` = one
CheckFree rebuild (median of 5). CheckFree's overhead over the run is
``C = steps * o_step + t_rec``; the checkpoint schedule may afford ``n = floor(C / c_save)``
saves, one every ``k = ceil(steps / n)`` steps (``n = 0``: no save, a failure restarts from
the initial state, the free checkpoint at step 0).

Every contender executes the same number of steps (``--steps``), so the losses compare at
equal compute. Reported per contender: loss on the step after the failure, steps until the
loss is back under the reference's loss at the failure (x 1.5), and the mean loss of the last
10 steps; medians and ranges over ``--seeds`` seeds, and the ratio to ``scratch``.

    nice -n 10 .venv/bin/python bench/checkfree_bench.py --seeds 5
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed"))
import checkfree_ranks as cr  # the pipeline the gloo tests train

from stalwart.elastic.checkfree import fresh_optimizer, recover_stage

MODES = ("none", "checkfree", "scratch", "replica", "ckpt", "ckpt-equal-cost")


def _optimizers(stages: list[cr.Stage], lr: float) -> list[torch.optim.Optimizer]:
    return [torch.optim.Adam(s.parameters(), lr=lr) for s in stages]


def run(mode: str, seed: int, a: argparse.Namespace) -> tuple[list[float], float]:
    """Losses of every executed step, and the seconds the recovery took."""
    stages = cr.build(seed)
    opts = _optimizers(stages, a.lr)
    saved = (copy.deepcopy(stages), [copy.deepcopy(o.state_dict()) for o in opts], 0)
    losses, data_step, recover_s, failed = [], 0, 0.0, False
    while len(losses) < a.steps:
        if data_step == a.fail_at and mode != "none" and not failed:
            failed = True
            t0 = time.perf_counter()
            if mode.startswith("ckpt"):
                stages = copy.deepcopy(saved[0])
                opts = _optimizers(stages, a.lr)
                for o, st in zip(opts, saved[1], strict=True):
                    o.load_state_dict(st)
                data_step = saved[2]
            else:
                replica = stages[a.lost].state_dict() if mode == "replica" else None
                norms = {i: cr.grad_norm(s) for i, s in enumerate(stages)}
                states = {i: s.state_dict() for i, s in enumerate(stages) if i != a.lost}
                torch.manual_seed(10_000 + seed)
                stages[a.lost] = cr.Stage(a.lost)
                opts[a.lost] = fresh_optimizer(
                    torch.optim.Adam(stages[a.lost].parameters(), lr=a.lr)
                )
                if mode in ("checkfree", "replica"):
                    recover_stage(stages[a.lost], a.lost, states, cr.STAGES, grad_norms=norms,
                                  replica=replica)  # fmt: skip
            recover_s = time.perf_counter() - t0
        x, y = cr.batch(data_step + 7919 * seed)
        for o in opts:
            o.zero_grad()
        h = x
        for s in stages:
            h = s(h)
        loss = F.mse_loss(h, y)
        loss.backward()
        for o in opts:
            o.step()
        losses.append(float(loss.detach()))
        data_step += 1
        every = a.ckpt_every if mode == "ckpt" else a.equal_every
        if mode.startswith("ckpt") and every and data_step % every == 0 and not failed:
            saved = (
                copy.deepcopy(stages),
                [copy.deepcopy(o.state_dict()) for o in opts],
                data_step,
            )
    return losses, recover_s


def _median_s(fn: object, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_costs(a: argparse.Namespace) -> dict[str, float]:
    """Seconds: one fsync'd checkpoint save, CheckFree's per-step overhead, one rebuild."""
    stages = cr.build(0)  # a few steps first: the saved state has Adam moments, as in the run
    opts = _optimizers(stages, a.lr)
    for step in range(5):
        x, y = cr.batch(step)
        for o in opts:
            o.zero_grad()
        h = x
        for s in stages:
            h = s(h)
        F.mse_loss(h, y).backward()
        for o in opts:
            o.step()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "pipeline.pt"

        def save() -> None:
            state = {"stages": [s.state_dict() for s in stages],
                     "optimizers": [o.state_dict() for o in opts]}  # fmt: skip
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())

        c_save = _median_s(save, 5)
    o_step = _median_s(lambda: [cr.grad_norm(s) for s in stages], 50)
    norms = {i: cr.grad_norm(s) for i, s in enumerate(stages)}
    states = {i: s.state_dict() for i, s in enumerate(stages) if i != a.lost}

    def rebuild() -> None:
        recover_stage(cr.Stage(a.lost), a.lost, states, cr.STAGES, grad_norms=norms)

    return {"save": c_save, "step": o_step, "recover": _median_s(rebuild, 5)}


def equal_cost_interval(costs: dict[str, float], steps: int) -> tuple[int, int]:
    """(n, k): saves affordable at CheckFree's overhead, and the interval (0: never save)."""
    total = steps * costs["step"] + costs["recover"]
    n = math.floor(total / costs["save"])
    return n, (math.ceil(steps / n) if n > 0 else 0)


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):.4g} [{min(values):.3g}-{max(values):.3g}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--fail-at", type=int, default=175)
    p.add_argument("--lost", type=int, default=1)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-3)
    a = p.parse_args()
    torch.set_num_threads(1)
    costs = measure_costs(a)
    n_saves, a.equal_every = equal_cost_interval(costs, a.steps)
    rows: dict[str, dict[str, list[float]]] = {m: {"after": [], "back": [], "tail": [], "ms": []}
                                               for m in MODES}  # fmt: skip
    for seed in range(a.seeds):
        ref, _ = run("none", seed, a)
        target = 1.5 * ref[a.fail_at - 1]
        for mode in MODES:  # interleaved: every contender once per seed
            losses, rec_s = run(mode, seed, a)
            after = losses[a.fail_at]
            back = next((i - a.fail_at for i in range(a.fail_at, len(losses))
                         if losses[i] <= target), a.steps)  # fmt: skip
            rows[mode]["after"].append(after)
            rows[mode]["back"].append(float(back))
            rows[mode]["tail"].append(sum(losses[-10:]) / 10)
            rows[mode]["ms"].append(rec_s * 1000)
    scratch_tail = statistics.median(rows["scratch"]["tail"])
    print("| contender | loss after failure | steps back to 1.5x ref | final loss (last 10) "
          "| final / scratch | recovery ms |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for mode in MODES:
        r = rows[mode]
        ratio = statistics.median(r["tail"]) / scratch_tail
        print(f"| {mode} | {_summary(r['after'])} | {_summary(r['back'])} | {_summary(r['tail'])} "
              f"| {ratio:.2f} | {_summary(r['ms'])} |")  # fmt: skip
    print(f"\n{a.seeds} seeds, {a.steps} steps each, stage {a.lost} of {cr.STAGES} lost at step "
          f"{a.fail_at}, checkpoint every {a.ckpt_every} steps; medians [min-max]")  # fmt: skip
    cf = a.steps * costs["step"] + costs["recover"]
    every = f"every {a.equal_every} steps" if a.equal_every else "never (restart from step 0)"
    print(f"equal cost: c_save {costs['save'] * 1e3:.3g} ms, CheckFree o_step "
          f"{costs['step'] * 1e6:.3g} us/step + t_rec {costs['recover'] * 1e3:.3g} ms = "
          f"C {cf * 1e3:.3g} ms over {a.steps} steps -> n = floor(C / c_save) = {n_saves} "
          f"saves, ckpt-equal-cost checkpoints {every}")  # fmt: skip


if __name__ == "__main__":
    main()
