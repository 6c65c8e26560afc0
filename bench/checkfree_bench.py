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
  (the steps since are redone: they count against the same step budget).

Every contender executes the same number of steps (``--steps``), so the losses compare at
equal compute. Reported per contender: loss on the step after the failure, steps until the
loss is back under the reference's loss at the failure (x 1.5), and the mean loss of the last
10 steps; medians and ranges over ``--seeds`` seeds, and the ratio to ``scratch``.

    nice -n 10 .venv/bin/python bench/checkfree_bench.py --seeds 5
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed"))
import checkfree_ranks as cr  # the pipeline the gloo tests train

from stalwart.elastic.checkfree import fresh_optimizer, recover_stage

MODES = ("none", "checkfree", "scratch", "replica", "ckpt")


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
            if mode == "ckpt":
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
        if mode == "ckpt" and data_step % a.ckpt_every == 0 and not failed:
            saved = (
                copy.deepcopy(stages),
                [copy.deepcopy(o.state_dict()) for o in opts],
                data_step,
            )
    return losses, recover_s


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


if __name__ == "__main__":
    main()
