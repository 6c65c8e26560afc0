"""TrainingState round trips: model, optimizer, scheduler, extra and every RNG come back."""

from __future__ import annotations

import copy
import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from stalwart.checkpoint.training_state import TrainingState
from stalwart.errors import StateMismatchError


def _parts(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _train(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(5, 6)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def _draws(gen: torch.Generator) -> tuple[Any, ...]:
    return (
        torch.rand(4),
        torch.randn(3, generator=gen),
        np.random.rand(3).tolist(),
        np.random.randn(),  # uses (and refills) numpy's cached gaussian
        [random.random() for _ in range(3)],
        random.gauss(0.0, 1.0),  # uses python's gauss_next
    )


def _assert_draws_equal(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    assert torch.equal(a[0], b[0])
    assert torch.equal(a[1], b[1])
    assert a[2:] == b[2:]


def test_round_trip_restores_everything_with_fresh_objects() -> None:
    model, opt, sched = _parts(0)
    _train(model, opt, sched, 3)
    gen = torch.Generator().manual_seed(7)
    torch.randn(11, generator=gen)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    random.gauss(0.0, 1.0)  # leaves gauss_next set
    extra = {"step": 3, "note": "hi", "best": torch.tensor([1.5])}
    ts = TrainingState(
        model=model, optimizer=opt, scheduler=sched, extra=extra, generators={"data": gen}
    )
    saved = copy.deepcopy(ts.state_dict())
    expected = _draws(gen)
    _train(model, opt, sched, 1)
    expected_params = [p.detach().clone() for p in model.parameters()]
    expected_opt = copy.deepcopy(opt.state_dict())
    expected_lr = sched.get_last_lr()

    # A new process would build everything afresh: different init, empty optimizer state.
    model2, opt2, sched2 = _parts(1)
    gen2 = torch.Generator().manual_seed(99)
    extra2: dict[str, Any] = {"step": 0}
    ts2 = TrainingState(
        model=model2, optimizer=opt2, scheduler=sched2, extra=extra2, generators={"data": gen2}
    )
    assert opt2.state_dict()["state"] == {}
    torch.manual_seed(1234)
    np.random.seed(5)
    random.seed(5)
    ts2.load_state_dict(copy.deepcopy(saved))

    assert ts2.extra is extra2
    assert extra2["step"] == 3 and extra2["note"] == "hi"
    assert torch.equal(extra2["best"], torch.tensor([1.5]))
    _assert_draws_equal(_draws(gen2), expected)
    # Same draws, then the same training step: identical to the original continuation.
    _train(model2, opt2, sched2, 1)
    for p, q in zip(model2.parameters(), expected_params, strict=True):
        assert torch.equal(p, q)
    got_opt = opt2.state_dict()
    assert got_opt["param_groups"] == expected_opt["param_groups"]
    for idx, state in expected_opt["state"].items():
        for key, value in state.items():
            assert torch.equal(got_opt["state"][idx][key], value), (idx, key)
    assert sched2.get_last_lr() == expected_lr


def test_state_dict_layout_and_rank_key() -> None:
    gen = torch.Generator()
    ts = TrainingState(extra={"a": 1}, generators={"data": gen})
    sd = ts.state_dict()
    assert set(sd) == {"extra", "rng"}
    assert set(sd["rng"]) == {"rank0"}
    entry = sd["rng"]["rank0"]
    assert entry["torch"].dtype == torch.uint8
    assert entry["numpy"]["keys"].dtype == torch.int64
    assert entry["numpy"]["keys"].shape == (624,)
    assert entry["python"]["state"].shape == (625,)
    assert set(entry["generators"]) == {"data"}
    assert sd["extra"] == {"a": 1} and sd["extra"] is not ts.extra
    assert set(TrainingState(rng=False).state_dict()) == set()


def test_load_into_itself_keeps_extra() -> None:
    extra = {"step": 4}
    ts = TrainingState(extra=extra)
    ts.load_state_dict(ts.state_dict())
    assert extra == {"step": 4}


def test_missing_part_is_a_mismatch() -> None:
    model, _, _ = _parts(0)
    with pytest.raises(StateMismatchError, match="'model'"):
        TrainingState(model=model).load_state_dict({"extra": {}})


def test_missing_rank_reseeds_deterministically_from_rank0(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gen = torch.Generator().manual_seed(3)
    sd = TrainingState(generators={"data": gen}).state_dict()
    data_draw = torch.randn(2, generator=gen)
    other = {"rng": {"rank1": sd["rng"]["rank0"]}}  # as if saved by a different rank
    with pytest.raises(StateMismatchError):
        TrainingState().load_state_dict(other)

    moved = {"rng": {"rank0": sd["rng"]["rank0"]}}
    ts = TrainingState(generators={"data": gen})
    from stalwart.checkpoint import training_state as mod

    draws = []
    for _ in range(2):
        with caplog.at_level(logging.WARNING):
            mod._reseed_from_rank0(moved["rng"]["rank0"], 3, ts.generators)
        draws.append((torch.rand(3), np.random.rand(), random.random()))
        assert torch.equal(torch.randn(2, generator=gen), data_draw)  # rank 0's data order
    assert torch.equal(draws[0][0], draws[1][0]) and draws[0][1:] == draws[1][1:]
    mod._reseed_from_rank0(moved["rng"]["rank0"], 4, ts.generators)
    assert not torch.equal(torch.rand(3), draws[0][0])  # another rank, another stream


def test_missing_rank_entry_logs_and_reseeds(caplog: pytest.LogCaptureFixture) -> None:
    from stalwart.checkpoint import training_state as mod

    sd = TrainingState().state_dict()
    with caplog.at_level(logging.WARNING, logger=mod.__name__):
        TrainingState(rank=2).load_state_dict(sd)
    assert "no saved RNG state for rank 2" in caplog.text


def test_through_the_checkpointer_with_a_fresh_optimizer(tmp_path: Path) -> None:
    from stalwart.checkpoint import Checkpointer

    model, opt, sched = _parts(0)
    _train(model, opt, sched, 2)
    gen = torch.Generator().manual_seed(4)
    extra: dict[str, Any] = {"step": 2}
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(2, {"train": TrainingState(model=model, optimizer=opt, scheduler=sched,
                                         extra=extra, generators={"g": gen})})  # fmt: skip
    expected = _draws(gen)
    _train(model, opt, sched, 1)

    model2, opt2, sched2 = _parts(1)
    gen2 = torch.Generator()
    extra2: dict[str, Any] = {}
    ts = TrainingState(model=model2, optimizer=opt2, scheduler=sched2, extra=extra2,
                       generators={"g": gen2})  # fmt: skip
    ckpt.load({"train": ts})
    assert extra2 == {"step": 2}
    _assert_draws_equal(_draws(gen2), expected)
    _train(model2, opt2, sched2, 1)
    for p, q in zip(model2.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
    for idx, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(opt2.state_dict()["state"][idx][key], value), (idx, key)


def test_grown_world_loads_and_derives_the_new_ranks_rng(tmp_path: Path) -> None:
    from stalwart.checkpoint import Checkpointer

    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(1, {"train": TrainingState(extra={"a": 1})})
    ts = TrainingState(extra={}, rank=2)
    ckpt.load({"train": ts})  # rank 2 has no RNG entry: TrainingState derives one
    assert ts.extra == {"a": 1}
    model = torch.nn.Linear(2, 2)
    with pytest.raises(StateMismatchError, match="model"):  # TrainingState still checks parts
        ckpt.load({"train": TrainingState(model=model)})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rng_round_trip() -> None:
    torch.cuda.manual_seed_all(11)
    sd = copy.deepcopy(TrainingState().state_dict())
    assert len(sd["rng"]["rank0"]["cuda"]) == torch.cuda.device_count()
    expected = torch.rand(4, device="cuda")
    torch.rand(100, device="cuda")
    TrainingState().load_state_dict(sd)
    assert torch.equal(torch.rand(4, device="cuda"), expected)


def test_rank_keys_the_rng_entry() -> None:
    assert list(TrainingState(rank=3).state_dict()["rng"]) == ["rank3"]
    assert list(TrainingState().state_dict()["rng"]) == ["rank0"]  # not distributed here


def test_stateful_objects_ride_along_and_are_checked(tmp_path: Path) -> None:
    from stalwart.checkpoint import Checkpointer
    from stalwart.elastic.sampler import ElasticSampler

    model, opt, _ = _parts(0)
    ckpt = Checkpointer(tmp_path / "ckpt")
    saved = TrainingState(model=model, optimizer=opt, stateful={"sampler": ElasticSampler(50, 7)})
    ckpt.save(3, {"train": saved})
    assert saved.state_dict()["stateful"]["sampler"]["num_samples"] == 50
    model2, opt2, _ = _parts(1)
    same = TrainingState(model=model2, optimizer=opt2, stateful={"sampler": ElasticSampler(50, 7)})
    ckpt.load({"train": same})
    for p, q in zip(model2.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
    other = TrainingState(model=model2, optimizer=opt2,
                          stateful={"sampler": ElasticSampler(50, 8)})  # fmt: skip
    with pytest.raises(StateMismatchError, match="another data stream"):
        ckpt.load({"train": other})
    with pytest.raises(StateMismatchError, match="stateful objects"):
        TrainingState(stateful={"more": ElasticSampler(50, 7)}).load_state_dict({})
    with pytest.raises(ValueError, match="state_dict"):
        TrainingState(stateful={"n": 3})
