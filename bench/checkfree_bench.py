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

``--stage-mb MB`` measures the costs on one stage of ``MB`` megabytes of fp32 weights
(residual blocks of width ``--width``; with Adam its checkpoint is 3x that) instead of the toy
pipeline: in a pipeline every stage's host saves, norms and steps its own stage in parallel, so
the per-stage costs are the ones that compare. The loss columns still come from the toy
pipeline, trained with the checkpoint interval those large-stage costs afford. It also prints
the time to recover at that size: CheckFree averages two neighbours, a replica is copied,
rollback loads the stage's checkpoint and redoes the steps since it (measured stage step time x
stages, one micro-batch: no overlap). Shipping weights to the new host is *modelled* at
``--link-gbps`` (bytes / bandwidth). ``--norm-free`` charges CheckFree no per-step cost (the
gradient norm is computed anyway for gradient clipping); only its rebuild is charged. On the
shared box, CPU-bound costs (step, norm, average, copy) are one thread's CPU seconds; the save
(fsync'd) and the load (from the page cache: an optimistic load) are wall seconds.

    nice -n 10 .venv/bin/python bench/checkfree_bench.py --seeds 5 --stage-mb 400
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


def _median_s(fn: object, reps: int, clock: object = time.perf_counter) -> float:
    times = []
    for _ in range(reps):
        t0 = clock()  # type: ignore[operator]
        fn()  # type: ignore[operator]
        times.append(clock() - t0)  # type: ignore[operator]
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


class _Big(torch.nn.Module):
    """One large stage: residual blocks ``h + tanh(W h + b)`` of width ``width``."""

    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(blocks))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        return h


def measure_stage_costs(a: argparse.Namespace) -> dict[str, float]:
    """Seconds, on one stage of ``a.stage_mb`` MB of fp32 weights (see the module docstring)."""
    blocks = max(1, round(a.stage_mb * 2**20 / 4 / (a.width * a.width + a.width)))
    torch.manual_seed(0)
    stage = _Big(a.width, blocks)
    opt = torch.optim.Adam(stage.parameters(), lr=a.lr)
    x = torch.randn(a.rows, a.width)

    def train_step() -> None:
        opt.zero_grad()
        stage(x).pow(2).mean().backward()
        opt.step()

    cpu = time.process_time  # CPU-bound parts: CPU seconds (one thread; the box is shared)
    train_step()  # Adam's state exists before anything is timed or saved
    t_step = _median_s(train_step, 3, cpu)
    nbytes = sum(p.numel() * p.element_size() for p in stage.parameters())
    with tempfile.TemporaryDirectory(dir=a.save_dir) as tmp:
        path = Path(tmp) / "stage.pt"

        def save() -> None:
            with open(path, "wb") as f:
                torch.save({"model": stage.state_dict(), "optimizer": opt.state_dict()}, f)
                f.flush()
                os.fsync(f.fileno())

        c_save = _median_s(save, 3)
        ckpt_bytes = path.stat().st_size
        t_load = _median_s(lambda: torch.load(path, weights_only=True), 3)
    grads = [p.grad for p in stage.parameters() if p.grad is not None]
    o_step = _median_s(lambda: float(torch.linalg.vector_norm(
        torch.stack(torch._foreach_norm(grads)))), 5, cpu)  # fmt: skip
    neighbours = {0: stage.state_dict(), 2: {k: v.clone() for k, v in stage.state_dict().items()}}
    norms = {0: 1.0, 2: 2.0}
    fresh = _Big(a.width, blocks)
    t_avg = _median_s(lambda: recover_stage(fresh, 1, neighbours, 3, grad_norms=norms), 3, cpu)
    t_copy = _median_s(lambda: recover_stage(fresh, 1, {}, 3, replica=neighbours[0]), 3, cpu)
    link = a.link_gbps * 1e9 / 8
    return {"save": c_save, "step": 0.0 if a.norm_free else o_step, "norm": o_step,
            "recover": t_avg, "train_step": t_step, "load": t_load, "copy": t_copy,
            "bytes": float(nbytes), "ckpt_bytes": float(ckpt_bytes), "blocks": float(blocks),
            "ship_checkfree": 2 * nbytes / link, "ship_replica": nbytes / link}  # fmt: skip


def recovery_table(costs: dict[str, float], a: argparse.Namespace, lost_steps: int) -> str:
    """Markdown: the time each contender takes to be back at the failure step (large stage)."""
    pipe_step = cr.STAGES * costs["train_step"]
    rows = [
        ("checkfree (neighbour average)", costs["ship_checkfree"], costs["recover"], 0.0),
        ("replica (exact copy)", costs["ship_replica"], costs["copy"], 0.0),
        (f"rollback ({lost_steps} steps redone)", 0.0, costs["load"], lost_steps * pipe_step),
    ]
    out = ["| contender | ship weights (modelled) | rebuild / load (measured) "
           "| redo steps (from measured step) | total s |", "|---|---|---|---|---|"]  # fmt: skip
    for name, ship, local, redo in rows:
        out.append(
            f"| {name} | {ship:.3g} | {local:.3g} | {redo:.3g} | {ship + local + redo:.3g} |"
        )
    return "\n".join(out)


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
    p.add_argument("--stage-mb", type=float, default=0.0, help="measure costs at this size")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--rows", type=int, default=16, help="micro-batch rows (large stage)")
    p.add_argument("--link-gbps", type=float, default=10.0)
    p.add_argument("--norm-free", action="store_true")
    p.add_argument("--save-dir", default=None, help="where the large checkpoint is written")
    a = p.parse_args()
    torch.set_num_threads(1)
    costs = measure_stage_costs(a) if a.stage_mb > 0 else measure_costs(a)
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
    if a.stage_mb > 0:
        print(f"\nstage of {costs['bytes'] / 2**20:.0f} MiB fp32 weights ({costs['blocks']:.0f} "
              f"blocks of width {a.width}), checkpoint {costs['ckpt_bytes'] / 2**20:.0f} MiB "
              f"(+ Adam), fsync'd save {costs['save']:.3g} s, load {costs['load']:.3g} s (wall); "
              f"grad norm {costs['norm'] * 1e3:.3g} ms{' (not charged)' if a.norm_free else ''}, "
              f"stage step ({a.rows} rows) {costs['train_step']:.3g} s (CPU)\n")  # fmt: skip
        last = (a.fail_at // a.equal_every) * a.equal_every if a.equal_every else 0
        print(recovery_table(costs, a, a.fail_at - last))
        print(f"(link {a.link_gbps} Gb/s modelled; rollback to step {last} of the "
              "ckpt-equal-cost schedule)\n")  # fmt: skip
    print(f"equal cost: c_save {costs['save'] * 1e3:.3g} ms, CheckFree o_step "
          f"{costs['step'] * 1e6:.3g} us/step + t_rec {costs['recover'] * 1e3:.3g} ms = "
          f"C {cf * 1e3:.3g} ms over {a.steps} steps -> n = floor(C / c_save) = {n_saves} "
          f"saves, ckpt-equal-cost checkpoints {every}")  # fmt: skip


if __name__ == "__main__":
    main()
