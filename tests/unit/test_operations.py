"""Operations: keep-best-K retention, STALWART_* variables, checkpoint events and listeners,
the preemption guard's signal handling (the save-and-exit path runs in a real process in
tests/integration/test_preemption.py)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import stalwart
from stalwart import AnyOf, CheckpointOptions, KeepBest, KeepLast
from stalwart.checkpoint.policy import kept_steps
from stalwart.checkpoint.results import CheckpointEvent
from stalwart.errors import ConfigError, UnsupportedValueError

pytestmark = pytest.mark.timeout(120)


def _state(v: float) -> dict[str, Any]:
    return {"w": torch.full((64,), float(v))}


def test_keep_best_ranks_by_metadata() -> None:
    losses = {1: "0.9", 2: "0.5", 3: "0.7", 4: "0.2", 5: "nan", 6: "0.3"}
    meta = {s: {"val_loss": v} for s, v in losses.items()} | {7: {}}
    steps = sorted(meta)
    assert kept_steps(KeepBest(2, "val_loss"), steps, meta.__getitem__) == {4, 6, 5, 7}
    strict = KeepBest(2, "val_loss", keep_unscored=False)
    assert kept_steps(strict, steps, meta.__getitem__) == {4, 6}
    assert kept_steps(KeepBest(1, "val_loss", mode="max"), steps, meta.__getitem__) >= {1}
    both = AnyOf(KeepLast(1), KeepBest(1, "val_loss", keep_unscored=False))
    assert both.uses_metadata and kept_steps(both, steps, meta.__getitem__) == {4, 7}
    assert KeepBest(1, "val_loss").keep(steps) == set(steps)  # no metadata: keeps all
    for bad in ({"k": 0, "metric": "m"}, {"k": 1, "metric": "m", "mode": "best"}):
        with pytest.raises(ConfigError):
            KeepBest(**bad)


def test_keep_best_in_a_checkpointer(tmp_path: Path) -> None:
    keep = AnyOf(KeepLast(1), KeepBest(2, metric="val_loss"))
    losses = [0.8, 0.3, 0.6, 0.1, 0.9, 0.7]
    with stalwart.Checkpointer(tmp_path / "ck", CheckpointOptions(keep=keep)) as ck:
        for step, loss in enumerate(losses):
            ck.save(step, _state(step), metadata={"val_loss": f"{loss:.6g}"})
        assert ck.steps() == [1, 3, 5]  # the two best (0.3, 0.1) and the newest
        assert torch.equal(ck.load(None, step=3)["w"], _state(3)["w"])


def test_a_damaged_manifest_that_stops_retention_is_named_at_every_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with stalwart.Checkpointer(tmp_path, CheckpointOptions(keep=KeepLast(2))) as ck:
        for step in (1, 2, 3):
            ck.save(step, _state(step))
        m = tmp_path / "manifests" / f"step-{2:020d}.json"
        m.write_bytes(m.read_bytes()[:-40])  # a kept step's manifest, truncated
        for step in (4, 5):
            ck.save(step, _state(step))
        assert ck.steps() == [2, 3, 4, 5]  # nothing deleted: step 2's references are unknown
    warned = [r.getMessage() for r in caplog.records if "retention deleted nothing" in r.message]
    assert len(warned) == 2 and all("stalwart ckpt rm ROOT 2" in w for w in warned)


def test_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    from stalwart.checkpoint.options import ENV_VARS, env_signals

    monkeypatch.setenv("STALWART_IO_THREADS", "7")
    monkeypatch.setenv("STALWART_COMPRESSION", "zstd")
    monkeypatch.setenv("STALWART_LEASE_S", "60")
    monkeypatch.setenv("STALWART_PREEMPTION_SIGNALS", "usr1, SIGINT")
    o = CheckpointOptions()
    assert (o.io_threads, o.compression, o.lease_s) == (7, "zstd", 60.0)
    assert CheckpointOptions(io_threads=2, compression=None).io_threads == 2  # argument wins
    assert CheckpointOptions(compression=None).compression is None
    assert env_signals(()) == (signal.SIGUSR1, signal.SIGINT)
    monkeypatch.setenv("STALWART_COMPRESSION", "none")
    assert CheckpointOptions().compression is None
    monkeypatch.setenv("STALWART_IO_THREADS", "many")
    with pytest.raises(ConfigError, match="STALWART_IO_THREADS"):
        CheckpointOptions()
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert all(name in readme for name in ENV_VARS), "README must list every STALWART_ variable"


def test_events_for_save_async_load_and_failure(tmp_path: Path) -> None:
    events: list[CheckpointEvent] = []
    lock = threading.Lock()

    def on_event(e: CheckpointEvent) -> None:
        with lock:
            events.append(e)
        if e.step == 2:
            raise RuntimeError("a broken listener never breaks a save")

    opts = CheckpointOptions(on_event=on_event)
    with stalwart.Checkpointer(tmp_path / "ck", opts) as ck:
        ck.save(1, _state(1), metadata={"val_loss": "0.5"})
        ck.save_async(2, _state(2)).wait()
        ck.load(_state(0), step=1)
        with pytest.raises(UnsupportedValueError):
            ck.save(3, {"bad": object()})
    kinds = [(e.kind, e.step) for e in events]
    assert kinds == [("save", 1), ("save", 2), ("load", 1), ("save_failed", 3)]
    save, load, failed = events[0], events[2], events[3]
    assert save.bytes_total == 256 and save.bytes_written > 0 and save.metadata["val_loss"] == "0.5"
    assert load.bytes_read > 0 and load.url == save.url and failed.error


def test_listeners_for_tensorboard_prometheus_wandb(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stalwart.integrations.events import (
        fan_out,
        prometheus_listener,
        tensorboard_listener,
        wandb_listener,
    )

    listeners = []
    tb = pytest.importorskip("tensorboard", reason="the dev extra installs tensorboard")
    del tb
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    listeners.append(tensorboard_listener(writer))
    prom = pytest.importorskip("prometheus_client")
    registry = prom.CollectorRegistry()
    listeners.append(prometheus_listener(registry))
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(mode="offline", dir=str(tmp_path), project="stalwart-test")
    listeners.append(wandb_listener(run))
    opts = CheckpointOptions(on_event=fan_out(*listeners))
    with stalwart.Checkpointer(tmp_path / "ck", opts) as ck:
        ck.save(10, _state(1))
        ck.load(_state(0))
    run.finish()
    writer.close()
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())
    value = registry.get_sample_value
    assert value("stalwart_checkpoint_events_total", {"kind": "save"}) == 1
    assert value("stalwart_checkpoint_last_step", {"kind": "load"}) == 10
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))


def test_preemption_guard_sets_a_flag_and_restores_handlers() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with stalwart.PreemptionGuard((signal.SIGUSR1,)) as guard:
        assert not guard.requested and not guard.should_stop()
        signal.raise_signal(signal.SIGUSR1)  # the handler has run when this returns
        assert guard.requested and guard.should_stop() and guard.received == signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) == before


def test_a_signal_delivered_twice_at_once_is_one_request_a_later_repeat_kills() -> None:
    # Ctrl-C, or a scheduler signalling every process of the job, reaches a worker directly
    # and through its launcher a moment later: that copy must not kill the save under way.
    # A deliberate repeat (later than repeat_after_s) goes to the handler from before.
    calls: list[int] = []
    before = signal.signal(signal.SIGUSR1, lambda signum, _frame: calls.append(signum))
    try:
        with stalwart.PreemptionGuard((signal.SIGUSR1,), repeat_after_s=60.0) as guard:
            signal.raise_signal(signal.SIGUSR1)
            signal.raise_signal(signal.SIGUSR1)  # the launcher's copy
            assert guard.requested and calls == []
        with stalwart.PreemptionGuard((signal.SIGUSR1,), repeat_after_s=0.0) as guard:
            signal.raise_signal(signal.SIGUSR1)
            assert calls == []
            signal.raise_signal(signal.SIGUSR1)  # asked again: the previous handler runs
            assert calls == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_preemption_guard_needs_the_main_thread() -> None:
    errors: list[BaseException] = []

    def enter() -> None:
        try:
            with stalwart.PreemptionGuard():
                pass
        except ConfigError as e:
            errors.append(e)

    t = threading.Thread(target=enter)
    t.start()
    t.join()
    assert errors and "main thread" in str(errors[0])
