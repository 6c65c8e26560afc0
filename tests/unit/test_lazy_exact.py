"""Lazy saves are exact: the checkpoint holds the state of the call, whatever happens next.

The worst timing is forced, not hoped for: the background copy is held back until the next
forward, backward, EMA update, scheduler step and in-place edits have all run (only
``optimizer.step()`` still waits for it, through the guard). The checks compare bytes.
"""

from __future__ import annotations

import gc
import random
import threading
import weakref
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stalwart import Checkpointer, KeepLast, Tier, TieredCheckpointer, TrainingState
from stalwart.checkpoint.durable.manifest import Manifest
from stalwart.tree import flatten


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.drop = torch.nn.Dropout(0.3)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def _setup() -> tuple[Net, torch.optim.Optimizer, Any, dict[str, torch.Tensor], TrainingState]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def update_ema(module: torch.nn.Module, _inputs: Any, _out: Any) -> None:
        with torch.no_grad():  # EMA weights, changed by a hook in every forward
            for k, v in module.state_dict().items():
                if v.is_floating_point():
                    ema[k].mul_(0.9).add_(v, alpha=0.1)

    model.register_forward_hook(update_ema)
    extra = {"ema": ema, "counter": torch.zeros(1, dtype=torch.int64), "epoch": 3}
    state = TrainingState(model=model, optimizer=opt, scheduler=sched, extra=extra)
    return model, opt, sched, extra, state


pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")


def _train_step(model: Net, opt: Any, sched: Any, extra: dict[str, Any], release: Any) -> None:
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    loss = torch.nn.functional.cross_entropy(model(x), y)  # BN stats, EMA, dropout RNG
    loss.backward()
    sched.step()
    extra["counter"].add_(1)
    extra["epoch"] += 1
    random.random()
    np.random.rand()
    release()  # only now may the background copy run; the guard makes step() wait for it
    opt.step()
    opt.zero_grad()


def _reference(state: TrainingState) -> tuple[dict[str, bytes], dict[str, Any]]:
    flat = flatten(state)
    tensors = {k: leaf.tensor.detach().clone().numpy().tobytes() for k, leaf in flat.leaves.items()}
    return tensors, flat.skeleton


def _gate(pool: Any) -> threading.Event:
    """Hold a single-thread pool until the returned event is set (forces the late copy)."""
    gate = threading.Event()
    pool.submit(gate.wait)
    return gate


def _warm_up(model: Net, opt: Any, sched: Any, extra: dict[str, Any]) -> None:
    _train_step(model, opt, sched, extra, lambda: None)  # the optimizer has its moments


def test_lazy_checkpoint_holds_the_state_of_the_call(tmp_path: Path) -> None:
    model, opt, sched, extra, state = _setup()
    _warm_up(model, opt, sched, extra)
    with Checkpointer(tmp_path / "ck") as ckpt:
        ckpt.guard(opt)
        for step in range(1, 4):
            want, skeleton = _reference(state)
            gate = _gate(ckpt._async._stager)  # private on purpose: forces the worst timing
            pending = ckpt.save_async(step, state, lazy=True)
            _train_step(model, opt, sched, extra, gate.set)
            pending.wait()
            m: Manifest = ckpt.manifest(step)
            assert m.skeleton == skeleton  # scheduler, epoch, python/numpy RNG of the call
            loaded = flatten(ckpt.load(step=step)).leaves
            got = {k: leaf.tensor.numpy().tobytes() for k, leaf in loaded.items()}
            assert got.keys() == want.keys()
            changed = [k for k in want if got[k] != want[k]]
            assert not changed, f"step {step}: captured after the call: {changed}"


def test_lazy_copy_defers_only_what_the_guarded_optimizer_owns(tmp_path: Path) -> None:
    model, opt, sched, extra, state = _setup()
    _warm_up(model, opt, sched, extra)
    with Checkpointer(tmp_path / "ck") as ckpt:
        ckpt.guard(opt)
        gate = _gate(ckpt._async._stager)
        pending = ckpt.save_async(1, state, lazy=True)
        cap = pending.capture
        assert cap is not None
        state_bytes = sum(r.nbytes for r in cap.records)
        eager = cap.copied_bytes
        gate.set()
        pending.wait()
        assert cap.copied_bytes == state_bytes  # every box copied exactly once
        assert 0 < eager < state_bytes  # BN buffers, EMA, RNG now; parameters later
        # parameters, exp_avg and exp_avg_sq (fp32) were all left to the background copy
        assert state_bytes - eager >= sum(p.numel() * 4 for p in model.parameters()) * 3
        bn = model.bn
        assert bn.running_mean is not None and bn.num_batches_tracked is not None


def test_lazy_without_a_guard_copies_everything_at_the_call(tmp_path: Path) -> None:
    state = _setup()[-1]
    with Checkpointer(tmp_path / "ck") as ckpt:
        pending = ckpt.save_async(1, state, lazy=True)
        cap = pending.capture
        assert cap is not None and pending.staged.is_set()
        assert cap.copied_bytes == sum(r.nbytes for r in cap.records)
        pending.wait()


def test_tiered_lazy_save_is_exact_and_copies_to_host_once(tmp_path: Path) -> None:
    model, opt, sched, extra, state = _setup()
    _warm_up(model, opt, sched, extra)
    tiers = [Tier(name="memory", keep=KeepLast(2)), Tier(name="disk", root=tmp_path / "disk")]
    with TieredCheckpointer(tiers) as tc:
        tc.guard(opt)
        for step in range(1, 4):
            want, skeleton = _reference(state)
            gate = _gate(tc._stager)  # private on purpose: forces the worst timing
            out = tc.save_async(step, state, lazy=True)
            _train_step(model, opt, sched, extra, gate.set)
            snap = out["memory"].result()
            result = out["disk"].wait()
            cap = tc.last_capture
            assert cap is not None
            # one host copy fed both tiers: the disk save read the memory snapshot's buffer
            assert out["disk"].capture is cap and snap.buffer is cap.buffer
            assert cap.copied_bytes == sum(r.nbytes for r in cap.records)
            assert result.step == step
            got_mem = {r.fqn: snap.tensor(r.fqn).numpy().tobytes() for r in snap.tensors}
            assert got_mem == want and snap.skeleton == skeleton
            disk = tc.durable["disk"].load(step=step)
            got_disk = {
                k: leaf.tensor.numpy().tobytes() for k, leaf in flatten(disk).leaves.items()
            }
            assert got_disk == want


def _closed_and_forgotten(make: Any, opt: torch.optim.Optimizer, model: torch.nn.Module) -> Any:
    """Guard ``opt`` with a new checkpointer, save lazily twice, close it, drop it: its weakref."""
    ck = make()
    ck.guard(opt)
    for step in (1, 2):
        ck.save_async(step, {"model": model.state_dict(), "optim": opt.state_dict()}, lazy=True)
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    ck.wait()
    ck.close()
    return weakref.ref(ck)


def test_a_closed_checkpointer_lets_go_of_the_guarded_optimizer(tmp_path: Path) -> None:
    # A guard's hook refers to its checkpointer: left on the optimizer it kept every closed
    # checkpointer alive with its host copy of the state (a script that made one per save
    # grew by the state's size each time). close() now takes the hooks off.
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters())
    makers = {
        "durable": lambda: Checkpointer(tmp_path / "ck"),
        "tiered": lambda: TieredCheckpointer([Tier.memory(keep=KeepLast(1))]),
    }
    for name, make in makers.items():
        ref = _closed_and_forgotten(make, opt, model)
        gc.collect()
        assert ref() is None, f"a closed {name} checkpointer is still referenced"
        assert not opt._optimizer_step_pre_hooks, f"{name}: the guard stayed on the optimizer"
        opt.step()  # the optimizer trains on without the closed checkpointer


def test_a_tiered_checkpointer_whose_snapshot_failed_still_closes() -> None:
    # close() raises the failed lazy snapshot's error, after it took the guard off and
    # stopped its threads (before, the error skipped all of that).
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = TieredCheckpointer([Tier.memory(keep=KeepLast(1))])
    ck.guard(opt)
    failed: Future[None] = Future()
    failed.set_exception(OSError("the snapshot's copy failed"))
    ck._pending_snapshot = failed  # what a lazy snapshot that raised leaves behind
    with pytest.raises(OSError, match="copy failed"):
        ck.close()
    assert not opt._optimizer_step_pre_hooks
    assert ck._snapshotter._shutdown and ck._stager._shutdown
