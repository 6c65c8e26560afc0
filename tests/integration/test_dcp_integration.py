"""DCP and torchtitan through stalwart's StorageWriter/StorageReader, on 2 real gloo ranks.

torchtitan is not installable here, so ``CheckpointManager`` below is a faithful copy of
its save/load loop (``torchtitan/components/checkpoint.py``): model parts and optimizers
wrapped as ``Stateful`` containers built on ``get_model_state_dict`` /
``get_optimizer_state_dict(flatten_optimizer_state_dict=True)``, the model state flattened
into the top level, ``checkpoint_id = <folder>/step-<n>``, ``dcp.async_save`` on a gloo
process group (waited for before the next save), ``dcp.load`` of the newest step. The only
change a torchtitan user makes is passing ``storage_writer=`` / ``storage_reader=``.
"""

from __future__ import annotations

import functools
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from stalwart import Checkpointer
from stalwart.integrations.dcp import StalwartReader, StalwartWriter, import_dcp
from stalwart.testing.run_ranks import run_ranks

STEPS = 8
INTERVAL = 2


class ModelWrapper(Stateful):
    def __init__(self, parts: list[nn.Module]) -> None:
        self.model = parts

    def state_dict(self) -> dict[str, Any]:
        return {k: v for sd in map(get_model_state_dict, self.model) for k, v in sd.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        func = functools.partial(
            set_model_state_dict,
            model_state_dict=state_dict,
            options=StateDictOptions(strict=False),
        )
        list(map(func, self.model))


class OptimizersContainer(Stateful):
    def __init__(self, parts: list[nn.Module], lr: float) -> None:
        self.model_parts = parts
        self.optimizers = [torch.optim.AdamW(p.parameters(), lr=lr) for p in parts]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        func = functools.partial(
            get_optimizer_state_dict,
            options=StateDictOptions(flatten_optimizer_state_dict=True),
        )
        return {k: v for sd in map(func, self.model_parts, self.optimizers) for k, v in sd.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        func = functools.partial(
            set_optimizer_state_dict,
            optim_state_dict=state_dict,
            options=StateDictOptions(flatten_optimizer_state_dict=True),
        )
        list(map(func, self.model_parts, self.optimizers))


class LRSchedulersContainer(Stateful):
    def __init__(self, optimizers: OptimizersContainer) -> None:
        warmup = functools.partial(_warmup, warmup_steps=3)
        self.schedulers = [
            torch.optim.lr_scheduler.LambdaLR(o, warmup) for o in optimizers.optimizers
        ]

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def state_dict(self) -> dict[str, Any]:
        return self.schedulers[0].state_dict()  # torchtitan: every scheduler is the same

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for s in self.schedulers:
            s.load_state_dict(dict(state_dict))


def _warmup(step: int, warmup_steps: int) -> float:
    return min(1.0, (step + 1) / warmup_steps)


class TrainState(Stateful):
    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": torch.tensor(self.step, dtype=torch.int32),
            "ntokens_seen": torch.tensor(self.ntokens_seen, dtype=torch.int64),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"].item())
        self.ntokens_seen = int(state_dict["ntokens_seen"].item())


class CheckpointManager:
    """torchtitan's CheckpointManager loop, writing through stalwart."""

    def __init__(self, states: dict[str, Any], folder: str, interval: int, async_mode: bool):
        self.states = states
        self.folder = folder
        self.interval = interval
        self.async_mode = async_mode
        self.pg = dist.new_group(backend="gloo") if async_mode else None
        self.async_future: Any = None
        self.storage_writer = StalwartWriter()  # the adopter's line: stalwart's format

    def _create_checkpoint_id(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    def _flattened_model_states_sd(self) -> dict[str, Any]:
        state_dict = dict(self.states)
        model = state_dict.pop("model")
        state_dict.update(model.state_dict())
        return state_dict

    def _async_wait(self) -> None:
        if self.async_future is not None:
            self.async_future.result()
            self.async_future = None

    def save(self, curr_step: int, last_step: bool = False) -> None:
        if curr_step % self.interval != 0 and not last_step:
            return
        self._async_wait()
        checkpoint_id = self._create_checkpoint_id(curr_step)
        states = self._flattened_model_states_sd()
        if self.async_mode:
            self.async_future = dcp.async_save(
                states,
                checkpoint_id=checkpoint_id,
                process_group=self.pg,
                storage_writer=self.storage_writer,
            )
        else:
            dcp.save(states, checkpoint_id=checkpoint_id, storage_writer=self.storage_writer)

    def _find_load_step(self) -> int:
        latest = Checkpointer(self.folder).latest_step() if os.path.isdir(self.folder) else None
        return -1 if latest is None else latest

    def load(self, step: int = -1) -> bool:
        if step == -1:
            step = self._find_load_step()
            if step == -1:
                return False
        states = self._flattened_model_states_sd()
        dcp.load(
            states,
            checkpoint_id=self._create_checkpoint_id(step),
            storage_reader=StalwartReader(),
        )
        return True

    def close(self) -> None:
        self._async_wait()


def _parts() -> list[nn.Module]:
    torch.manual_seed(0)
    full = nn.ModuleDict({"embed": nn.Linear(8, 16), "head": nn.Linear(16, 1)})
    return [nn.ModuleDict({"embed": full["embed"]}), nn.ModuleDict({"head": full["head"]})]


def train_body(rank: int, world: int, folder: str, kill_at: int | None) -> list[float]:
    """torchtitan's train loop, shrunk: resume, step, save every INTERVAL; maybe die."""
    parts = _parts()
    optimizers = OptimizersContainer(parts, lr=0.05)
    schedulers = LRSchedulersContainer(optimizers)
    train_state = TrainState()
    states = {
        "model": ModelWrapper(parts),
        "optimizer": optimizers,
        "lr_scheduler": schedulers,
        "train_state": train_state,
    }
    ckpt = CheckpointManager(states, folder, INTERVAL, async_mode=True)
    ckpt.load()
    losses: list[float] = []
    while train_state.step < STEPS:
        train_state.step += 1
        g = torch.Generator().manual_seed(1000 * train_state.step + rank)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        optimizers.zero_grad()
        loss = ((parts[1]["head"](torch.tanh(parts[0]["embed"](x))) - y) ** 2).mean()
        loss.backward()
        for p in (p for part in parts for p in part.parameters()):
            dist.all_reduce(p.grad)
            p.grad /= world
        optimizers.step()
        schedulers.step()
        train_state.ntokens_seen += x.numel()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
        ckpt.save(train_state.step, last_step=train_state.step == STEPS)
        if kill_at is not None and train_state.step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # no flush, no goodbye
    ckpt.close()
    params = [p.detach().clone() for part in parts for p in part.parameters()]
    return [*losses, *[float(v) for p in params for v in p.flatten().tolist()]]


@pytest.mark.timeout(240)
def test_torchtitan_loop_killed_and_resumed_is_bit_identical(tmp_path: Path) -> None:
    whole = run_ranks(train_body, 2, str(tmp_path / "a"), None, timeout_s=180)
    run_ranks(
        train_body,
        2,
        str(tmp_path / "b"),
        5,
        timeout_s=180,
        expect_exit={0: -signal.SIGKILL, 1: -signal.SIGKILL},
    )
    resumed_from = Checkpointer(tmp_path / "b").latest_step()
    assert resumed_from in (2, 4)  # step 4's async save may not have committed before the kill
    resumed = run_ranks(train_body, 2, str(tmp_path / "b"), None, timeout_s=180)
    done = STEPS - resumed_from
    for r in range(2):
        assert resumed[r][:done] == whole[r][resumed_from:STEPS]  # losses, bit for bit
        assert resumed[r][done:] == whole[r][STEPS:]  # final parameters, bit for bit
    assert Checkpointer(tmp_path / "b").verify(STEPS).ok


def reshard_body(rank: int, world: int, root: str, dcp_dir: str) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(64 * 6, dtype=torch.float32).reshape(64, 6)
    state = {
        "w": distribute_tensor(full, mesh, [Shard(0)]),
        "b": torch.ones(5),
        "meta": {"epoch": 3, "tags": ["a", "b"]},
    }
    dcp.save(state, checkpoint_id=f"{root}/step-3", storage_writer=StalwartWriter())
    dcp.save(state, storage_writer=FileSystemWriter(dcp_dir))
    target = {
        "w": distribute_tensor(torch.zeros(64, 6), mesh, [Shard(1)]),
        "b": torch.zeros(5),
        "meta": {"epoch": 0, "tags": []},
    }
    dcp.load(target, checkpoint_id=f"{root}/step-3", storage_reader=StalwartReader())
    want = full[:, rank * 3 : rank * 3 + 3]
    ok = torch.equal(target["w"].to_local(), want) and torch.equal(target["b"], torch.ones(5))
    return ok and target["meta"] == {"epoch": 3, "tags": ["a", "b"]}


@pytest.mark.timeout(180)
def test_dtensor_saved_on_two_ranks_reshards_on_load(tmp_path: Path) -> None:
    root, dcp_dir = tmp_path / "root", tmp_path / "dcp"
    assert run_ranks(reshard_body, 2, str(root), str(dcp_dir), timeout_s=150) == [True, True]
    full = torch.arange(64 * 6, dtype=torch.float32).reshape(64, 6)
    ck = Checkpointer(root)
    assert len(ck.manifest(3).tensors["w"].shards) == 2  # each rank wrote its own rows
    tree = ck.load(None, 3)  # one process, consolidated
    assert torch.equal(tree["w"], full) and tree["meta"] == {"epoch": 3, "tags": ["a", "b"]}
    plain = {"w": torch.zeros(64, 6), "b": torch.zeros(5)}
    dcp.load(plain, storage_reader=StalwartReader(root, step=3), no_dist=True)
    assert torch.equal(plain["w"], full)
    # A DCP folder written by two ranks, imported (resharded to whole tensors) by one.
    r = import_dcp(dcp_dir, tmp_path / "imported", 1)
    assert r.tensors == 2
    got = Checkpointer(tmp_path / "imported").load(None, 1)
    assert torch.equal(got["w"], full) and got["meta"]["tags"] == ["a", "b"]
