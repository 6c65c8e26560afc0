"""Lightning through StalwartCheckpointIO: stop, resume bit-identically, load, rotate, dedup."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import pathlib
import shutil
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from stalwart.checkpoint import Checkpointer  # noqa: E402
from stalwart.errors import CheckpointNotFoundError  # noqa: E402
from stalwart.integrations.lightning import (  # noqa: E402
    StalwartCheckpointIO,
    load_from_checkpoint,
    read_checkpoint,
)
from stalwart.integrations.lightning_pointer import read_pointer  # noqa: E402
from stalwart.tree import allow_types  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class Act(enum.Enum):
    TANH = "tanh"
    RELU = "relu"


@dataclasses.dataclass(frozen=True)
class Sched:
    gamma: float = 0.9
    tags: frozenset[str] = frozenset({"a", "b"})


class TinyModule(pl.LightningModule):
    """Hyper-parameters of every awkward kind Lightning users put there."""

    def __init__(
        self,
        args: argparse.Namespace,
        act: Act = Act.TANH,
        sched: Sched = Sched(),
        out: pathlib.Path = pathlib.Path("runs/x"),
        seen: frozenset[int] = frozenset({1, 2}),
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )
        self.losses: list[float] = []

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.args.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=self.hparams.sched.gamma)
        return [opt], [sched]


def _data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    ds = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return torch.utils.data.DataLoader(ds, batch_size=8)


def _module() -> TinyModule:
    torch.manual_seed(0)
    return TinyModule(argparse.Namespace(lr=0.05, name="tiny"), act=Act.RELU)


def _trainer(tmp: pathlib.Path, epochs: int, plugin: Any, **kw: Any) -> Any:
    ckpt = pl.callbacks.ModelCheckpoint(
        dirpath=tmp / "ckpts", save_top_k=2, monitor="epoch", mode="max", save_last=True
    )
    return pl.Trainer(
        max_epochs=epochs,
        plugins=[plugin],
        callbacks=[ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        deterministic=True,
        **kw,
    )


@pytest.fixture(autouse=True)
def _allow() -> None:
    allow_types(Act, Sched)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_stop_and_resume_is_bit_identical(tmp_path: pathlib.Path, async_save: bool) -> None:
    full = _module()
    _trainer(tmp_path / "full", 4, StalwartCheckpointIO(async_save=async_save)).fit(full, _data())

    first = _module()
    _trainer(tmp_path / "run", 2, StalwartCheckpointIO(async_save=async_save)).fit(first, _data())
    resumed = _module()
    trainer = _trainer(tmp_path / "run", 4, StalwartCheckpointIO(async_save=async_save))
    trainer.fit(resumed, _data(), ckpt_path="last")

    assert first.losses + resumed.losses == full.losses
    for a, b in zip(full.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)

    # Lightning rotated its files (top 2 + last); the root holds the steps they point to.
    ckpts = tmp_path / "run" / "ckpts"
    files = sorted(p.name for p in ckpts.iterdir() if p.suffix == ".ckpt")
    assert files == ["epoch=2-step=12.ckpt", "epoch=3-step=16.ckpt", "last.ckpt"]
    pointed = {read_pointer(ckpts / f)["step"] for f in files}
    with Checkpointer(ckpts / "stalwart") as ck:
        assert set(ck.steps()) == pointed
        # epoch=3 and last.ckpt are saved at one global step: the second reuses every chunk.
        newest = [ck.manifest(s) for s in sorted(pointed)[-2:]]
        assert [m.metadata["lightning.global_step"] for m in newest] == ["16", "16"]
        assert all(m.stats.get("bytes_written", 0) == 0 for m in newest[1:]), newest[1].stats


def test_load_from_checkpoint_and_hparams_round_trip(tmp_path: pathlib.Path) -> None:
    module = _module()
    trainer = _trainer(tmp_path, 1, StalwartCheckpointIO(tmp_path / "root"))
    trainer.fit(module, _data())
    best = trainer.checkpoint_callback.best_model_path

    loaded = load_from_checkpoint(TinyModule, best)
    assert loaded.hparams.args == argparse.Namespace(lr=0.05, name="tiny")
    assert loaded.hparams.act is Act.RELU and loaded.hparams.sched == Sched()
    assert loaded.hparams.out == pathlib.Path("runs/x") and loaded.hparams.seen == {1, 2}
    for a, b in zip(module.parameters(), loaded.parameters(), strict=True):
        assert torch.equal(a, b)
    raw = read_checkpoint(best)
    assert raw["global_step"] == 4 and "optimizer_states" in raw

    # Lightning's own loader reads the pointer too (the plugin installed the loader).
    own = TinyModule.load_from_checkpoint(best, map_location="cpu")
    assert own.hparams.args == loaded.hparams.args and own.hparams.act is Act.RELU
    for a, b in zip(module.parameters(), own.parameters(), strict=True):
        assert torch.equal(a, b)

    # A plain Trainer, without the plugin, resumes from the pointer through Lightning's loader.
    resumed = _module()
    plain = _trainer(tmp_path / "plain", 2, pl.plugins.TorchCheckpointIO())
    plain.fit(resumed, _data(), ckpt_path=best)
    assert len(resumed.losses) == 4  # one epoch of 4 batches after the restored one


def test_a_plain_torch_checkpoint_still_resumes_under_the_plugin(tmp_path: pathlib.Path) -> None:
    module = _module()
    trainer = _trainer(tmp_path / "old", 1, pl.plugins.TorchCheckpointIO())
    trainer.fit(module, _data())
    old = trainer.checkpoint_callback.last_model_path
    resumed = _module()
    # A torch.save checkpoint with these hyper-parameters needs unpickling: the user's call.
    trainer = _trainer(tmp_path / "new", 2, StalwartCheckpointIO())
    trainer.fit(resumed, _data(), ckpt_path=old, weights_only=False)
    assert len(resumed.losses) == 4  # one epoch of 4 batches after the restored one


def test_remove_checkpoint_keeps_a_step_another_pointer_names(tmp_path: pathlib.Path) -> None:
    io = StalwartCheckpointIO(tmp_path / "root")
    state = {"state_dict": {"w": torch.ones(3)}, "global_step": 1, "epoch": 0}
    a, b = tmp_path / "c" / "a.ckpt", tmp_path / "c" / "b.ckpt"
    io.save_checkpoint(state, a)
    b.write_bytes(a.read_bytes())  # Lightning copies last.ckpt where it cannot symlink
    io.remove_checkpoint(a)
    assert torch.equal(io.load_checkpoint(b)["state_dict"]["w"], torch.ones(3))
    io.remove_checkpoint(b)
    assert io.checkpointer(str(tmp_path / "root")).steps() == []
    io.teardown()


def _save_one(io: StalwartCheckpointIO, path: pathlib.Path, value: float) -> None:
    io.save_checkpoint({"state_dict": {"w": torch.full((3,), value)}, "global_step": 1}, path)


def test_a_copied_or_renamed_run_folder_still_loads(tmp_path: pathlib.Path) -> None:
    io = StalwartCheckpointIO()  # the root goes beside the checkpoints: run/ckpts/stalwart
    _save_one(io, tmp_path / "run" / "ckpts" / "last.ckpt", 2.0)
    io.teardown()
    body = (tmp_path / "run" / "ckpts" / "last.ckpt").read_text().splitlines()[-1]
    assert json.loads(body)["root"] == "stalwart"  # relative to the pointer's folder
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    (tmp_path / "run").rename(tmp_path / "renamed")
    for run in ("copy", "renamed"):
        pointer = tmp_path / run / "ckpts" / "last.ckpt"
        assert torch.equal(read_checkpoint(pointer)["state_dict"]["w"], torch.full((3,), 2.0))
        loaded = StalwartCheckpointIO().load_checkpoint(pointer)
        assert torch.equal(loaded["state_dict"]["w"], torch.full((3,), 2.0))


def test_a_pointer_whose_root_is_gone_says_the_path_came_from_it(tmp_path: pathlib.Path) -> None:
    io = StalwartCheckpointIO()
    _save_one(io, tmp_path / "run" / "last.ckpt", 1.0)
    io.teardown()
    (tmp_path / "elsewhere").mkdir()
    lone = tmp_path / "elsewhere" / "last.ckpt"
    shutil.copy(tmp_path / "run" / "last.ckpt", lone)  # the pointer without its root
    for load in (read_checkpoint, StalwartCheckpointIO().load_checkpoint):
        with pytest.raises(CheckpointNotFoundError) as e:
            load(lone)
        said = str(e.value)
        assert str(tmp_path / "elsewhere" / "stalwart") in said and "does not exist" in said
        assert f"came from the pointer file {lone}" in said and "root=" in said
    # Told where the root is, it loads.
    moved = read_checkpoint(lone, root=str(tmp_path / "run" / "stalwart"))
    assert torch.equal(moved["state_dict"]["w"], torch.ones(3))


def test_an_old_pointer_with_an_absolute_root_still_loads(tmp_path: pathlib.Path) -> None:
    io = StalwartCheckpointIO(tmp_path / "root")
    _save_one(io, tmp_path / "c" / "new.ckpt", 3.0)
    io.teardown()
    step = read_pointer(tmp_path / "c" / "new.ckpt")["step"]
    old = {"stalwart.lightning.pointer": 1, "root": str(tmp_path / "root"), "step": step}
    (tmp_path / "c" / "old.ckpt").write_text(json.dumps(old, indent=1))  # as version 1 wrote
    assert torch.equal(
        read_checkpoint(tmp_path / "c" / "old.ckpt")["state_dict"]["w"], torch.full((3,), 3.0)
    )


@pytest.mark.parametrize("weights_only", [True, False, None])
def test_torch_load_of_a_pointer_says_to_install_the_loader(
    tmp_path: pathlib.Path, weights_only: bool | None
) -> None:
    # What Lightning's loader meets in a process where install_loader() never ran: its
    # cloud_io._load is torch.load of the path (this process has the wrapper installed).
    io = StalwartCheckpointIO()
    _save_one(io, tmp_path / "last.ckpt", 1.0)
    io.teardown()
    with pytest.raises(RuntimeError, match=r"install_loader\(\) first") as e:
        torch.load(tmp_path / "last.ckpt", weights_only=weights_only)
    assert "stalwart pointer, not a torch.save file" in str(e.value)
    assert "weights_only" not in str(e.value)


def test_a_retention_policy_is_refused() -> None:
    from stalwart.checkpoint import CheckpointOptions, KeepLast
    from stalwart.errors import ConfigError

    with pytest.raises(ConfigError, match="save_top_k"):
        StalwartCheckpointIO(options=CheckpointOptions(keep=KeepLast(2)))


def _rank_zero_saves(rank: int, world_size: int, tmp: str) -> list[float]:
    """Lightning's DDP pattern: only rank 0 saves; every rank loads."""
    io = StalwartCheckpointIO(pathlib.Path(tmp) / "root")
    path = pathlib.Path(tmp) / "c" / "a.ckpt"
    if rank == 0:
        io.save_checkpoint({"state_dict": {"w": torch.arange(3.0)}, "global_step": 1}, path)
    torch.distributed.barrier()
    loaded = io.load_checkpoint(path)["state_dict"]["w"].tolist()
    io.teardown()
    return loaded


@pytest.mark.slow  # two processes that each import Lightning
def test_rank_zero_saves_alone_under_ddp(tmp_path: pathlib.Path) -> None:
    from stalwart.testing import run_ranks

    assert run_ranks(_rank_zero_saves, 2, str(tmp_path), timeout_s=90) == [[0.0, 1.0, 2.0]] * 2
