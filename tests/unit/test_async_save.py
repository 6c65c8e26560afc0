"""save_async: eager and lazy staging, the optimizer guard, errors that surface, exit flush."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import stalwart
from stalwart.errors import CheckpointError, StorageFullError
from stalwart.storage import LocalStorage
from stalwart.testing import FlakyStorage

pytestmark = pytest.mark.timeout(120)


def make_model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(16, 256)).square().mean().backward()
    opt.step()


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_eager_returns_after_copy_so_the_state_may_change(tmp_path: Path) -> None:
    model, _opt = make_model()
    ckpt = stalwart.Checkpointer(tmp_path)
    before = snapshot(model)
    pending = ckpt.save_async(1, {"model": model})
    assert pending.staged.is_set()  # eager: copied before returning
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # mutate while the background persists
    result = pending.wait()
    assert result.step == 1 and pending.done() and ckpt.steps() == [1]
    loaded = ckpt.load(None)["model"]
    for k, v in before.items():
        assert torch.equal(loaded[k], v)
    ckpt.close()


def test_lazy_with_guard_snapshots_the_pre_step_values(tmp_path: Path) -> None:
    model, opt = make_model()
    ckpt = stalwart.Checkpointer(tmp_path)
    ckpt.guard(opt)
    for step in range(1, 6):
        before = snapshot(model) | {"exp_avg": _moment(opt)}
        pending = ckpt.save_async(step, {"model": model, "optim": opt}, lazy=True)
        train_step(model, opt)  # the guard makes opt.step() wait for the copy
        pending.wait()
        loaded = ckpt.load(None, step)
        for k, v in before.items():
            if k == "exp_avg":
                if v is not None:
                    assert torch.equal(loaded["optim"]["state"][0]["exp_avg"], v)
            else:
                assert torch.equal(loaded["model"][k], v), (step, k)
    ckpt.close()


def _moment(opt: torch.optim.Optimizer) -> torch.Tensor | None:
    state = opt.state_dict()["state"]
    return state[0]["exp_avg"].clone() if state else None


def test_background_failure_surfaces_on_wait_and_keeps_earlier_steps(tmp_path: Path) -> None:
    store = FlakyStorage(
        LocalStorage(tmp_path),
        fail_on=lambda op, key: op == "write" and key.startswith("packs/step-00000000000000000002"),
        error=StorageFullError,
    )
    ckpt = stalwart.Checkpointer(store)
    ckpt.save_async(1, {"x": torch.arange(10.0)}).wait()
    pending = ckpt.save_async(2, {"x": torch.arange(10.0) + 1})
    with pytest.raises(StorageFullError):
        pending.wait()
    assert ckpt.steps() == [1]
    assert torch.equal(ckpt.load(None)["x"], torch.arange(10.0))
    ckpt.close()


def test_unobserved_failure_surfaces_on_the_next_call(tmp_path: Path) -> None:
    store = FlakyStorage(
        LocalStorage(tmp_path),
        fail_on=lambda op, key: op == "write" and key.startswith("packs/step-00000000000000000002"),
        error=StorageFullError,
    )
    ckpt = stalwart.Checkpointer(store)
    ckpt.save(1, {"x": torch.ones(3)})
    pending = ckpt.save_async(2, {"x": torch.zeros(3)})
    pending.future.exception()  # finished, but nobody called wait()
    with pytest.raises(CheckpointError, match="background save of step 2 failed"):
        ckpt.save_async(3, {"x": torch.zeros(3)})
    ckpt.save_async(3, {"x": torch.full((3,), 3.0)}).wait()  # raised once, then goes on
    assert ckpt.steps() == [1, 3]
    ckpt.close()


def _failing_step_2(root: Path) -> FlakyStorage:
    return FlakyStorage(
        LocalStorage(root),
        fail_on=lambda op, key: op == "write" and key.startswith("packs/step-00000000000000000002"),
        error=StorageFullError,
    )


def test_close_raises_a_last_save_that_failed_unseen(tmp_path: Path) -> None:
    before = set(threading.enumerate())
    ckpt = stalwart.Checkpointer(_failing_step_2(tmp_path))
    ckpt.save(1, {"x": torch.ones(3)})
    ckpt.save_async(2, {"x": torch.zeros(3)})  # the run's last save, never waited on
    with pytest.raises(CheckpointError, match=r"background save of step 2 failed.*not committed"):
        ckpt.close()
    left = [t.name for t in set(threading.enumerate()) - before]
    assert not [n for n in left if n.startswith(("stalwart-persist", "stalwart-stage"))]
    assert stalwart.Checkpointer(tmp_path).steps() == [1]


def test_leaving_a_with_block_raises_the_lost_save(tmp_path: Path) -> None:
    with (
        pytest.raises(CheckpointError, match="step 2"),
        stalwart.Checkpointer(_failing_step_2(tmp_path)) as ckpt,
    ):
        ckpt.save(1, {"x": torch.ones(3)})
        ckpt.save_async(2, {"x": torch.zeros(3)})
    assert stalwart.Checkpointer(tmp_path).steps() == [1]


def test_a_block_already_failing_keeps_its_error_and_logs_the_lost_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        pytest.raises(KeyError, match="the user's own"),
        stalwart.Checkpointer(_failing_step_2(tmp_path)) as ckpt,
    ):
        ckpt.save(1, {"x": torch.ones(3)})
        ckpt.save_async(2, {"x": torch.zeros(3)})
        raise KeyError("the user's own")
    assert "background save of step 2 failed" in caplog.text


def test_a_failure_already_seen_is_not_raised_again_at_close(tmp_path: Path) -> None:
    ckpt = stalwart.Checkpointer(_failing_step_2(tmp_path))
    with pytest.raises(StorageFullError):
        ckpt.save_async(2, {"x": torch.zeros(3)}).wait()
    ckpt.close()


def test_in_flight_saves_are_bounded_and_buffers_reused(tmp_path: Path) -> None:
    opts = stalwart.CheckpointOptions(max_inflight_saves=1)
    ckpt = stalwart.Checkpointer(tmp_path, opts)
    state = {"w": torch.randn(512, 512)}
    first = ckpt.save_async(1, state)
    ckpt.save_async(2, state)
    assert first.done()  # the second call waited for the first to finish
    ckpt.wait()
    slot = ckpt._async.slots[0]
    assert slot.allocated_bytes == 512 * 512 * 4  # allocated once ...
    assert slot.reused_bytes == 512 * 512 * 4  # ... and reused by the second save
    assert ckpt.steps() == [1, 2]
    ckpt.close()


def test_interpreter_exit_flushes_saves_in_flight(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import torch, stalwart
        ckpt = stalwart.Checkpointer({str(tmp_path)!r})
        ckpt.save_async(7, {{"w": torch.arange(1 << 20, dtype=torch.float32)}})
        # no wait(): the atexit hook must flush it
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    ckpt = stalwart.Checkpointer(tmp_path)
    assert ckpt.steps() == [7]
    assert torch.equal(ckpt.load(None)["w"], torch.arange(1 << 20, dtype=torch.float32))


def test_one_exit_hook_for_every_checkpointer_and_it_still_flushes(tmp_path: Path) -> None:
    # Each closed Checkpointer used to leave one more hook in the interpreter's exit list; a
    # process making one per save grew it without end. The one hook must still flush the save
    # of a Checkpointer made after others were closed.
    code = textwrap.dedent(
        f"""
        import threading, torch, stalwart
        hooks = lambda: len(getattr(threading, "_threading_atexits", []))
        for i in range(5):
            with stalwart.Checkpointer({str(tmp_path / "a")!r} + str(i)) as ck:
                ck.save_async(1, {{"w": torch.ones(3)}})
            if i == 0:
                first = hooks()
        assert hooks() == first, (first, hooks())
        ckpt = stalwart.Checkpointer({str(tmp_path / "b")!r})
        ckpt.save_async(7, {{"w": torch.arange(1 << 20, dtype=torch.float32)}})
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert stalwart.Checkpointer(tmp_path / "b").steps() == [7]


def test_a_sync_save_waits_for_async_ones_so_steps_commit_in_order(tmp_path: Path) -> None:
    ckpt = stalwart.Checkpointer(tmp_path)
    a = ckpt.save_async(1, {"x": torch.ones(100_000)})
    ckpt.save(2, {"x": torch.zeros(100_000)})
    assert a.done() and ckpt.steps() == [1, 2]
    ckpt.close()


def test_lazy_guard_on_a_large_state_verifies_bytes_not_timing(tmp_path: Path) -> None:
    torch.manual_seed(1)
    layer = torch.nn.Linear(4096, 2048)  # 32 MiB: the copy is still running at opt.step()
    opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    ckpt = stalwart.Checkpointer(tmp_path)
    ckpt.guard(opt)
    before = layer.weight.detach().clone()
    pending = ckpt.save_async(1, {"layer": layer}, lazy=True)
    layer(torch.randn(4, 4096)).sum().backward()
    opt.step()
    assert not torch.equal(layer.weight, before)
    pending.wait()
    assert torch.equal(ckpt.load(None)["layer"]["weight"], before)
    ckpt.close()


def test_a_store_that_fails_sometimes_never_loses_a_committed_step(tmp_path: Path) -> None:
    from stalwart.errors import TransientStorageError

    store = FlakyStorage(
        LocalStorage(tmp_path), fail_probability=0.1, seed=3, error=TransientStorageError
    )
    ckpt = stalwart.Checkpointer(store)
    committed, failed = [], []
    for step in range(1, 16):
        pending = ckpt.save_async(step, {"x": torch.full((1000,), float(step))})
        try:
            pending.wait()
            committed.append(step)
        except (TransientStorageError, CheckpointError):  # the write, listing or lease failed
            failed.append(step)
    assert committed and failed  # the store really failed sometimes
    fresh = stalwart.Checkpointer(tmp_path)
    assert fresh.steps() == committed
    for step in committed:
        assert torch.equal(fresh.load(None, step)["x"], torch.full((1000,), float(step)))
    ckpt.close()


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (pinned staging, side stream)"
)
def test_cuda_tensors_stage_through_pinned_buffers(tmp_path: Path) -> None:
    layer = torch.nn.Linear(1024, 1024).cuda()
    ckpt = stalwart.Checkpointer(tmp_path)
    before = layer.weight.detach().cpu().clone()
    pending = ckpt.save_async(1, {"layer": layer})
    with torch.no_grad():  # queued right behind the copy on the same device
        layer.weight.add_(1.0)
    pending.wait()
    assert ckpt._async.slots[0].pin_memory
    assert torch.equal(ckpt.load(None)["layer"]["weight"], before)
    ckpt.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (side-stream ordering)")
def test_cuda_lazy_save_is_exact_under_the_next_optimizer_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(2048, 2048), torch.nn.BatchNorm1d(2048), torch.nn.Linear(2048, 10)
    ).cuda()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(256, 2048, device="cuda")
    model(x).sum().backward()
    opt.step()
    ckpt = stalwart.Checkpointer(tmp_path)
    ckpt.guard(opt)
    for step in range(3):
        # a long kernel queue ahead of the save: the copy must wait for it, not race it
        for _ in range(20):
            model(x).sum().backward()
        want = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        pending = ckpt.save_async(step, {"model": model}, lazy=True)
        model(x).sum().backward()  # BN running stats change now
        opt.step()
        opt.zero_grad()
        pending.wait()
        got = ckpt.load(None, step)["model"]
        for k, v in want.items():
            assert torch.equal(got[k], v), k
    ckpt.close()


def test_load_waits_for_this_checkpointers_saves_in_flight(tmp_path: Path) -> None:
    with stalwart.Checkpointer(tmp_path) as ckpt:
        ckpt.save_async(1, {"x": torch.arange(1 << 20, dtype=torch.float32)})
        assert torch.equal(ckpt.load(None)["x"], torch.arange(1 << 20, dtype=torch.float32))
        ckpt.save_async(2, {"x": torch.zeros(1 << 20)})
        assert ckpt.load(None)["x"].sum() == 0 and ckpt.last_load.step == 2
